"""The transport interface: how KV blocks and activations move between live workers.

A `Transport` is one worker's connection to a peer. It flushes blocks into, and fetches them from, the
store that peer serves, and it sends tensors (activations) into the peer's inbox. A `Server` is the
serving side: it holds a store, answers its peers, and hands received tensors to `recv_tensor`.
`RemoteStore` (`open_store("tcp://host:port")`) is a `Store` on top of a transport's record operations.
All calls block; the cache manager's streamer is where concurrency lives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from ..blocks import BlockKey
from ..errors import ConfigError
from ..stores import Store


class Transport(ABC):
    """A connection to one peer that serves a store. Safe to share between threads."""

    url: str

    @abstractmethod
    def flush(self, key: BlockKey, block: Any) -> None:
        """Store `block` under `key` in the peer's store."""

    @abstractmethod
    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor:
        """The block stored under `key` at the peer, verified, in `out` when given.

        If the block turns out corrupt, CorruptBlock is raised; a host `out` may then hold partial data.
        """

    @abstractmethod
    def send_tensor(self, tensor: torch.Tensor) -> None:
        """Put `tensor` into the peer's inbox (its `Server.recv_tensor`); returns once the peer has it."""

    # Record-level operations, for RemoteStore: names and encoded records, passed through untouched.
    @abstractmethod
    def put_records(self, records: list[tuple[str, np.ndarray]]) -> None:
        """Store (name, record) pairs in order, in one request; in one transaction where the store allows."""

    @abstractmethod
    def get_record(self, name: str) -> np.ndarray: ...

    @abstractmethod
    def names(self, prefix: str) -> list[str]: ...

    @abstractmethod
    def remove(self, names: list[str]) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Drop the connection; later calls raise StoreClosed. Closing twice is harmless."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class Server(ABC):
    """Serves `store` to peers at `url` until closed; tensors peers send wait in an inbox."""

    url: str
    store: Store

    @abstractmethod
    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor:
        """The next tensor a peer sent; TransportError if none arrives within `timeout` seconds."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and close every connection. The store stays open: it belongs to the caller."""

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
