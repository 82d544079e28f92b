"""The replica-store interface: flush/fetch blocks by key, list and delete them by stream.

Callers (the cache manager, the CLI, users) use the public methods. A backend implements five small
hooks on encoded records named by `str(key)`: `_put`, `_get`, `_names`, `_remove` and `_close`
(and `_put_many`, where a backend can commit several records at once).
Encoding, checksums, `out` handling, closed-state checks and argument validation live here once, so
every backend behaves the same and wrappers stay complete.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import numpy as np
import torch

from ..blocks import BlockKey, check_key, check_stream_id
from ..codec import decode_block, encode_block
from ..errors import ConfigError, StoreClosed


class Store(ABC):
    """A place where KV blocks live: `flush(key, block)`, `fetch(key, out=None)`, `keys`, `delete`.

    Capability flags tell callers what a backend promises:
    `persistent`: blocks outlive this process; `shared`: other processes can read what this one flushes.
    """

    persistent: ClassVar[bool] = False
    shared: ClassVar[bool] = False

    def __init__(self, url: str) -> None:
        self.url = url
        self._closed = False
        self._close_lock = threading.Lock()

    # ---- the public interface -------------------------------------------------------------
    def flush(self, key: BlockKey, block: Any) -> None:
        """Store `block` (a tensor on any device, a numpy array or a buffer) under `key`, replacing any."""
        self._check_open()
        self._put(str(check_key(key)), encode_block(key, block, self._allocate))

    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor:
        """Return the block stored under `key`, verified, copied into `out` when given (any device)."""
        self._check_open()
        with self._get(str(check_key(key))) as record:
            return decode_block(key, record, out)

    def keys(self, stream_id: str | None = None) -> list[BlockKey]:
        """The keys of every stored block of `stream_id` (of all streams when None), sorted."""
        self._check_open()
        prefix = "" if stream_id is None else check_stream_id(stream_id) + "/"
        parsed = (_block_key_or_none(name) for name in self._names(prefix))
        return sorted(key for key in parsed if key is not None)

    def delete(self, stream_id: str) -> int:
        """Delete every block of `stream_id`; return how many were deleted."""
        self._check_open()
        names = list(self._names(check_stream_id(stream_id) + "/"))
        self._remove(names)
        return sum(1 for name in names if _block_key_or_none(name) is not None)

    def write_manifest(self, stream_id: str, manifest: bytes) -> None:
        """Store a stream's manifest (small, checksummed like a block), replacing any; `delete` removes it."""
        self._check_open()
        name = manifest_name(stream_id)
        self._put(name, encode_block(name, manifest, self._allocate))

    def flush_with_manifest(self, key: BlockKey, block: Any, manifest: bytes) -> None:
        """Store `block` under `key` and replace its stream's manifest, in that order.

        Backends that can write both atomically do (LMDB: one transaction, one sync); the others write the
        block first, so a manifest never names a block that is not stored.
        """
        self._check_open()
        name, manifest_record_name = str(check_key(key)), manifest_name(key.stream_id)
        self._put_many([(name, encode_block(key, block, self._allocate)),
                        (manifest_record_name, encode_block(manifest_record_name, manifest, self._allocate))])

    def read_manifest(self, stream_id: str) -> bytes:
        """The stream's manifest; BlockNotFound if it has none, CorruptBlock if it is damaged."""
        self._check_open()
        name = manifest_name(stream_id)
        with self._get(name) as record:
            return decode_block(name, record).numpy().tobytes()

    def close(self) -> None:
        """Release the backend's resources; later calls raise `StoreClosed`. Closing twice is harmless."""
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}{', closed' if self._closed else ''})"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"{self!r} is closed; open a new store with dejavu_sdk.open_store({self.url!r})")

    # ---- backend hooks ---------------------------------------------------------------------
    def _allocate(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array for one encoded record; memory stores return pinned memory on CUDA."""
        return np.empty(nbytes, dtype=np.uint8)

    @abstractmethod
    def _put(self, name: str, record: np.ndarray) -> None:
        """Store `record` under `name` atomically: readers see the old record or the new one, whole."""

    def _put_many(self, records: list[tuple[str, np.ndarray]]) -> None:
        """Store several records in order; backends with transactions override this to commit them at once."""
        for name, record in records:
            self._put(name, record)

    @abstractmethod
    def _get(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Context manager yielding the record stored under `name` as a buffer; BlockNotFound if none."""

    @abstractmethod
    def _names(self, prefix: str) -> Iterator[str] | Iterable[str]:
        """Names of stored records that start with `prefix` ("" for all)."""

    @abstractmethod
    def _remove(self, names: list[str]) -> None:
        """Delete the records under `names`; names already gone are ignored."""

    def _close(self) -> None:  # noqa: B027 - optional hook; most backends hold nothing to release
        """Release backend resources (connections, file handles, memory)."""


def manifest_name(stream_id: str) -> str:
    """The record name of a stream's manifest, beside its blocks."""
    return check_stream_id(stream_id) + "/manifest"


def _block_key_or_none(name: str) -> BlockKey | None:
    """The key a record name stands for, or None for records that are not blocks (temporary files)."""
    try:
        return BlockKey.parse(name)
    except ConfigError:
        return None
