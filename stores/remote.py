"""`tcp://host:port`, `ucx://host:port`: a store held in another process's memory (the remote CPU tier).

The serving process runs `dejavu serve-store --listen URL --store STORE`; this class speaks to it through
a transport. Flush and fetch stream blocks straight from and into tensors; the record-level hooks carry
encoded records untouched, so a block is verified end to end by the process that decodes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..blocks import BlockKey, check_key
from ..urls import ParsedURL
from .base import Store


class RemoteStore(Store):
    """A store served by another process, reached through `transport`."""

    shared = True

    def __init__(self, transport: Any) -> None:
        super().__init__(transport.url)
        self.transport = transport

    @classmethod
    def from_url(cls, url: ParsedURL, **options: Any) -> RemoteStore:
        from ..transports import open_transport

        return cls(open_transport(url.text, **options))

    def flush(self, key: BlockKey, block: Any) -> None:
        self._check_open()
        self.transport.flush(check_key(key), block)

    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check_open()
        return self.transport.fetch(check_key(key), out)

    def _put(self, name: str, record: np.ndarray) -> None:
        self.transport.put_records([(name, record)])

    def _put_many(self, records: list[tuple[str, np.ndarray]]) -> None:
        self.transport.put_records(records)  # one request; the server stores them with its own _put_many

    @contextlib.contextmanager
    def _get(self, name: str) -> Iterator[np.ndarray]:
        yield self.transport.get_record(name)

    def _names(self, prefix: str) -> list[str]:
        return self.transport.names(prefix)

    def _remove(self, names: list[str]) -> None:
        self.transport.remove(names)

    def _close(self) -> None:
        self.transport.close()
