"""The SDK's one exception tree; backend errors are translated into it at the boundary.

    DejaVuError
    ├── ConfigError (ValueError)          bad arguments, URLs, options, `out` tensors
    │   └── RequestTooLarge               a request's KV cache can never fit the pipeline's KV budget
    ├── BackendUnavailable (ImportError)  a backend's optional dependency is missing; carries `hint`
    ├── BlockNotFound (KeyError)          no block is stored under that key
    ├── CorruptBlock                      stored bytes fail the header or checksum check
    ├── StoreError (OSError)              a replica store's backend failed
    │   └── StoreClosed                   the store was used after close()
    ├── TransportError (ConnectionError)  moving blocks between workers failed
    │   └── ServerBusy                    the server refused the request for now (too many connections, inbox full)
    ├── AccessDenied (PermissionError)    a server refused the token, or a stream outside the token's prefix
    ├── ReplicationError                  streaming a live cache to its replica failed (a gap)
    ├── JournalInUse                      another controller holds the journal's lease
    └── RequestFailed                     one request's own input or computation failed it (its neighbours go on)
"""

from __future__ import annotations

import reprlib

#: How error messages quote values they were given: short, however large the value (what a client sent may be
#: megabytes).
_QUOTING = reprlib.Repr()
_QUOTING.maxlevel, _QUOTING.maxlist, _QUOTING.maxtuple, _QUOTING.maxdict = 2, 8, 8, 4
_QUOTING.maxstring, _QUOTING.maxother, _QUOTING.maxlong = 120, 120, 60


class DejaVuError(Exception):
    """Base of every error the SDK raises on purpose."""


class ConfigError(DejaVuError, ValueError):
    """An argument, URL or option is invalid; the message says what to change."""


class RequestTooLarge(ConfigError):
    """A request's KV cache could never be admitted: alone in the pipeline it needs `needed` bytes on a stage,
    more than the `budget` (`kv_budget_bytes`) each stage gives. Shortening its prompt or `max_new_tokens`
    (`max_tokens`) to `most_new_tokens` or fewer (None: even one new token does not fit) makes it fit."""

    def __init__(self, message: str, needed: int, budget: int, most_new_tokens: int | None) -> None:
        super().__init__(message)
        self.needed, self.budget, self.most_new_tokens = needed, budget, most_new_tokens


class BackendUnavailable(DejaVuError, ImportError):
    """A backend needs an optional dependency that is not installed."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(f"{message}; install it with: {hint}" if hint else message)
        self.hint = hint


class BlockNotFound(DejaVuError, KeyError):
    """No block is stored under the requested key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CorruptBlock(DejaVuError):
    """A stored block is torn, truncated, tampered with or stored under the wrong key."""


class StoreError(DejaVuError, OSError):
    """The backend of a replica store failed (I/O error, server error, full disk)."""


class StoreClosed(StoreError):
    """A store was used after `close()`."""


class TransportError(DejaVuError, ConnectionError):
    """Moving a block or tensor between workers failed or timed out."""


class ServerBusy(TransportError):
    """A server refused a request for now (too many connections, a full inbox); trying later may work."""


class AccessDenied(DejaVuError, PermissionError):
    """A server refused the client's token, or a request that reaches outside the streams its token allows."""


class JournalInUse(DejaVuError):
    """Another controller serves from this journal (its lease is held and renewed): one writer at a time."""


class ReplicationError(DejaVuError):
    """Streaming a live cache to its replica failed; the replica has a gap from the named block on."""


class RequestFailed(DejaVuError):
    """One request failed on its own: its input (`input_error`: a setting the warpers reject, say) or its
    computation (non-finite probabilities, a stage that raised on its microbatch). Requests beside it go on.
    `request` numbers it as the pipeline does (`Result` and `Pipeline.status` use the same numbers)."""

    def __init__(self, message: str, request: int | None = None, input_error: bool = False) -> None:
        super().__init__(message if request is None else f"request {request}: {message}")
        self.request, self.input_error = request, input_error


def quoted(value: object, limit: int = 200) -> str:
    """`value` as an error message quotes it: its repr, at most about `limit` characters (a long list, text or
    number shows its start and `...`)."""
    shown = _QUOTING.repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}..."
