"""The record interface: named, encoded records, the one thing every store backend and transport provides.

A *record* is an encoded block or manifest (`dejavu_sdk.codec`: header, payload, checksum) kept under a
name such as `req-1/L0-1.T0-512`. Backends never look inside records; `Store` (dejavu_sdk/store.py) is the
block codec on top of any record store, so the same `Store` works over LMDB, a directory, S3, this
process's memory, or a transport that reaches another process's store.

Who implements what:
- store backends (`stores/`) implement `RecordStore` over their medium;
- transports (`transports/`) implement `RecordStore` by asking their peer, and also `BlockStreaming`,
  which moves blocks straight from and into tensors instead of through an encoded copy;
- `Store` calls only the public methods below, and conformance suites (`dejavu_sdk.testing`) check every
  backend against them, declared capabilities included.
"""

from __future__ import annotations

import contextlib
import mmap
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

    from .blocks import BlockKey
    from .urls import ParsedURL

#: A named record: the name and the record's bytes (a uint8 array, or any buffer a backend returns).
NamedRecord = tuple[str, Any]


def record_array(record: Any) -> np.ndarray:
    """A record's bytes as a uint8 array, without a copy; ConfigError for something that is not a buffer."""
    if isinstance(record, np.ndarray) and record.dtype == np.uint8:
        return record
    try:
        return np.frombuffer(record, dtype=np.uint8)
    except (TypeError, ValueError):
        raise ConfigError(f"a record must be a bytes-like buffer, got {type(record).__name__}") from None


class RecordStore(ABC):
    """Named records: put several, get one, list names by prefix, remove names, allocate a buffer.

    Capabilities, declared by each backend and checked by the conformance suites:
    `atomic_batches`: `put_records` commits all of its records or none of them (LMDB: one transaction);
    `persistent`: records outlive this process; `shared`: other processes see what this one puts;
    `lends_buffers`: `get_record` yields memory that is valid only inside the `with` block and holds a
    resource meanwhile (LMDB: a read transaction): callers that keep the record past a quick copy must copy
    it out first. `resident`: `get_record` yields the memory the store keeps the record in, so reading it
    copies nothing (memory stores); other stores read into a copy (files) or lend a view (LMDB).
    """

    atomic_batches: bool = False
    persistent: bool = False
    shared: bool = False
    lends_buffers: bool = False
    resident: bool = False
    url: str

    @classmethod
    @abstractmethod
    def from_url(cls, url: ParsedURL, *args: Any, **options: Any) -> RecordStore:
        """Open the backend a parsed URL names, with backend `options` (keyword-only, declared by each
        backend; `open_store` refuses options a backend does not declare)."""

    @abstractmethod
    def put_records(self, records: Sequence[NamedRecord]) -> None:
        """Store each (name, record) in order, replacing any record of that name.

        Each record lands whole or not at all; readers never see half a record. Order matters to callers:
        a block goes before the manifest that names it.
        """

    @abstractmethod
    def get_record(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A context manager yielding the record under `name` as a buffer; BlockNotFound if none.

        The buffer may be valid only inside the `with` block (LMDB lends its memory map).
        """

    @abstractmethod
    def names(self, prefix: str) -> list[str]:
        """Names of stored records that start with `prefix` ("" for all), in any order."""

    @abstractmethod
    def remove(self, names: Sequence[str]) -> None:
        """Delete the records under `names`; names already gone are ignored."""

    def record_size(self, name: str) -> int | None:
        """The size of record `name` when the store knows it without reading the record (a local file's), else
        None: a server reserves the memory for a read before making it."""
        return None

    def allocate(self, nbytes: int) -> np.ndarray:
        """A writable uint8 buffer for one record about to be put; memory stores return memory they keep."""
        return np.empty(nbytes, dtype=np.uint8)

    @abstractmethod
    def close(self) -> None:
        """Release connections, files or memory. Closing twice is harmless."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class BlockStreaming(ABC):
    """A record store that moves whole blocks itself, straight from and into tensors (transports).

    `Store` hands blocks to these methods instead of encoding them into a buffer first: a network
    transport then streams a block from its tensor's memory and verifies it as it lands in `out`.
    """

    @abstractmethod
    def flush(self, key: BlockKey, block: Any) -> None:
        """Store `block` (a tensor on any device, a numpy array or a buffer) under `key`."""

    @abstractmethod
    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor:
        """The block under `key`, verified, copied into `out` when given.

        If the block turns out corrupt, CorruptBlock is raised; a host `out` may then hold partial data.
        """


#: Buffers at least this large are mapped on their own (`returned_memory`).
MAPPED_BYTES = 256 << 10
_PRIVATE = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}


def returned_memory(size: int) -> np.ndarray:
    """A writable uint8 buffer of `size` bytes whose memory goes back to the system as soon as it is dropped:
    large ones are mapped on their own, since the allocator keeps a large buffer freed by another thread
    for later (a server whose readers came and went would keep their copies' memory)."""
    if size < MAPPED_BYTES:
        return np.empty(size, np.uint8)
    return np.frombuffer(mmap.mmap(-1, size, **_PRIVATE), np.uint8)
