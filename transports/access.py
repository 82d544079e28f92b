"""Who may use a server: shared tokens, each allowed every stream or only stream ids with a given prefix.

A client presents its token in the HELLO that opens every connection; the server checks it before it
reads any other request, in constant time, and then holds the connection to the token's streams: a
token for the prefix `tenant-a.` can list, read, write and delete only streams whose id starts with
`tenant-a.`. A server without tokens lets every client in (for loopback and trusted networks only).

Tokens are secrets: keep them in a file readable by the server's user (`--token-file`), or in the
environment (`DEJAVU_TOKEN`), not on command lines. Without TLS a token crosses the network in the clear.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

import attrs

from ..errors import ConfigError

#: The environment variable a client's token (and `dejavu serve-store`'s single token) comes from.
TOKEN_VARIABLE = "DEJAVU_TOKEN"
#: The longest token accepted; longer ones are refused before they are compared.
MAX_TOKEN_BYTES = 1024


@attrs.frozen
class Scope:
    """What a connection may touch: every stream (`prefix` ""), or stream ids that start with `prefix`."""

    prefix: str = ""

    def allows(self, name: str) -> bool:
        """Whether the record `name` (`stream_id/...`) belongs to a stream this scope allows."""
        stream_id, slash, _ = name.partition("/")
        return bool(slash) and stream_id.startswith(self.prefix)


class AccessPolicy:
    """Tokens and the stream-id prefix each may use ("" for every stream). No tokens: anyone may connect."""

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self._tokens: dict[bytes, Scope] = {}
        for token, prefix in (tokens or {}).items():
            if not isinstance(token, str) or not token or len(token.encode()) > MAX_TOKEN_BYTES \
                    or any(character.isspace() for character in token):
                raise ConfigError(f"a token must be 1-{MAX_TOKEN_BYTES} bytes without spaces")
            if not isinstance(prefix, str):
                raise ConfigError(f"a token's stream-id prefix must be a string, got {prefix!r}")
            self._tokens[token.encode()] = Scope(prefix)

    @classmethod
    def from_options(cls, token: str | None, tokens: Mapping[str, str] | None) -> AccessPolicy:
        """A policy from a server's `token=` (every stream) and `tokens=` ({token: prefix}) options."""
        merged = dict(tokens or {})
        if token is not None:
            merged[token] = ""
        return cls(merged)

    @property
    def open(self) -> bool:
        """True when the server has no tokens: every client is let in, to every stream."""
        return not self._tokens

    def scope_for(self, presented: bytes) -> Scope | None:
        """The scope of the token a client presented, or None if it is not one of ours."""
        if self.open:
            return Scope()
        found = None
        for token, scope in self._tokens.items():  # compare with every token, in constant time each
            if hmac.compare_digest(token, presented):
                found = scope
        return found


def read_token_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Tokens from a file, one per line: `TOKEN` (every stream) or `TOKEN PREFIX`; `#` starts a comment."""
    try:
        with open(path) as file:
            lines = file.read().splitlines()
    except OSError as error:
        raise ConfigError(f"cannot read the token file {os.fspath(path)!r}: {error}") from error
    tokens: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ConfigError(f"{os.fspath(path)}:{number}: write 'TOKEN' or 'TOKEN PREFIX'")
        tokens[fields[0]] = fields[1] if len(fields) == 2 else ""
    if not tokens:
        raise ConfigError(f"the token file {os.fspath(path)!r} holds no token")
    return tokens


def client_token(token: str | None) -> str | None:
    """The token a client presents: `token=` when given, else `DEJAVU_TOKEN` from the environment."""
    token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
    if token is not None and (not isinstance(token, str) or len(token.encode()) > MAX_TOKEN_BYTES
                              or "\n" in token):
        raise ConfigError(f"a token must be a string of at most {MAX_TOKEN_BYTES} bytes on one line")
    return token
