"""The transport interface: how KV blocks and activations move between live workers.

A `Transport` is one worker's connection to a peer's store. It is a `RecordStore` (records are put, got,
listed and removed at the peer), it streams whole blocks straight from and into tensors
(`BlockStreaming`), and it sends tensors (activations) into the peer's inbox. So a store in another
process is simply `Store(transport)`.

A `ServingTransport` can also serve: `serve(url, store)` answers its peers against `store` until the
returned `Server` is closed. Transports that only connect within one process (`local`) do not serve.
All calls block; the cache manager's streamer is where concurrency lives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from ..errors import ConfigError
from ..records import BlockStreaming, RecordStore
from ..store import Store
from ..urls import ParsedURL

#: Seconds a client waits for each step of a request before the link counts as broken.
CLIENT_TIMEOUT = 30.0
#: Seconds a client waits to reach its peer.
CONNECT_TIMEOUT = 10.0
#: Seconds a server waits for the rest of a request it has started to receive.
SERVER_TIMEOUT = 60.0
#: Seconds a server keeps a connection that sends no request; clients reconnect on their next call.
IDLE_TIMEOUT = 600.0
#: Connections a server serves at once; one more is refused with ServerBusy.
MAX_CONNECTIONS = 256
#: Tensors a server's inbox holds before refusing more with ServerBusy.
INBOX_SIZE = 64
#: Seconds a new connection has to say HELLO (TLS handshake included) before a server drops it.
HELLO_TIMEOUT = 5.0
#: Connections a tcp:// server holds that have not said HELLO yet; the oldest goes when one more comes.
MAX_UNAUTHENTICATED = 128
#: Threads a tcp:// server answers requests on, whatever the number of connections.
WORKERS = 16
#: Bytes of records a server holds for transfers at once (copies out of LMDB, records being received).
MAX_INFLIGHT_BYTES = 256 << 20
#: Seconds a transfer waits for room among those bytes (at most the server's timeout) before ServerBusy:
#: well within a client's own timeout, so that the client hears why.
ROOM_WAIT = 10.0


class Transport(RecordStore, BlockStreaming):
    """A connection to one peer that serves a store. Safe to share between threads.

    `shared`: what this transport puts, other processes reach through the same peer. Whether the peer's
    store persists or commits batches atomically is the peer's to say, so neither is promised here.
    """

    shared = True

    @abstractmethod
    def send_tensor(self, tensor: torch.Tensor) -> None:
        """Put `tensor` into the peer's inbox; returns once the peer has it."""

    def post_tensor(self, tensor: torch.Tensor) -> None:
        """Send `tensor` to the peer's inbox without waiting for the peer to confirm it: a stream of small
        tensors (a pipeline's activations) costs one transfer each instead of a round trip.

        Tensors posted on one transport arrive in order. A peer that cannot take one closes the link, and the
        next call on this transport raises `TransportError` saying how many posted tensors may be lost; a
        caller that must know the last one arrived sends it with `send_tensor`. Transports without such a
        link confirm every tensor (this default).
        """
        self.send_tensor(tensor)

    @abstractmethod
    def close(self) -> None:
        """Drop the connection; later calls raise StoreClosed. Closing twice is harmless."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ServingTransport(Transport):
    """A transport whose peers are servers: `serve` starts one, `from_url` connects to one."""

    @classmethod
    @abstractmethod
    def serve(cls, url: ParsedURL, store: Store, *args: Any, **options: Any) -> Server:
        """Serve `store` at the URL's address (port 0: any free port) until the Server is closed; `options`
        are keyword-only, declared by each backend."""


class Server(ABC):
    """Serves `store` to peers at `url` until closed; tensors peers send wait in an inbox.

    `close_store`: closing the server closes the store too. `dejavu_sdk.serve` sets it when it opened the
    store from a URL, since nobody else holds that store; a store the caller passed stays the caller's.
    """

    url: str
    store: Store
    close_store: bool = False

    @abstractmethod
    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor:
        """The next tensor a peer sent; TransportError if none arrives within `timeout` seconds."""

    def close(self) -> None:
        """Stop serving and close every connection, then the store if the server owns it."""
        self._stop()
        if self.close_store:
            self.store.close()

    @abstractmethod
    def _stop(self) -> None:
        """Stop accepting peers and close every connection."""

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def check_timeout(value: object, name: str) -> float | None:
    """Positive seconds or None (wait forever); ConfigError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)
