"""`memory://`: records in this process's CPU memory (page-locked when CUDA is present).

The fastest tier and the default for tests and single-process use: nothing survives the process.
Pinned (page-locked) records let device<->host copies run at full PCIe speed and asynchronously.
Records that are replaced or deleted are kept for reuse by the next record of the same size, once no
reader holds them, up to `SPARE_BYTES` in all: fresh memory costs a page fault per page (about 3 µs each
on a small VM, 75 µs for one decode step's 98 kB block), which would otherwise dominate flushes. A serving
process deletes each finished stream's records, so the next streams' blocks reuse that memory.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import BlockNotFound, ConfigError
from ..records import NamedRecord, RecordStore, record_array
from ..store import Store
from ..urls import ParsedURL

#: The most memory that replaced or deleted records keep for reuse (bytes), over all sizes.
SPARE_BYTES = 256 << 20


class MemoryRecords(RecordStore):
    """Encoded records in a dict in this process; thread-safe. A batch is put under one lock: atomically."""

    atomic_batches = True
    resident = True  # get_record yields the stored array itself

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.url = "memory://"
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            raise ConfigError("pin_memory=True needs CUDA, which is not available; omit it")
        self.pin_memory = cuda if pin_memory is None else pin_memory
        self._records: dict[str, np.ndarray] = {}
        self._spare: defaultdict[int, list[np.ndarray]] = defaultdict(list)
        self._spare_bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: ParsedURL, *, pin_memory: bool | None = None) -> MemoryRecords:
        if url.path:
            raise ConfigError(f"memory:// takes no path, got {url.text!r}; use 'memory://'")
        return cls(pin_memory=pin_memory)

    def allocate(self, nbytes: int) -> np.ndarray:
        with self._lock:
            if self._spare[nbytes]:
                self._spare_bytes -= nbytes
                return self._spare[nbytes].pop()
        if self.pin_memory:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(nbytes, dtype=np.uint8)

    def put_records(self, records: Sequence[NamedRecord]) -> None:
        arrays = [(name, record_array(record)) for name, record in records]  # refuse a bad one before storing any
        with self._lock:
            for name, record in arrays:
                self._keep_spare(self._records.get(name))
                self._records[name] = record

    def get_record(self, name: str) -> contextlib.nullcontext[np.ndarray]:
        # A plain context, not a generator: for small blocks the per-fetch overhead shows.
        with self._lock:
            record = self._records.get(name)
        if record is None:
            raise BlockNotFound(f"no block {name} in memory://")
        return contextlib.nullcontext(record)

    def names(self, prefix: str) -> list[str]:
        with self._lock:
            return [name for name in self._records if name.startswith(prefix)]

    def remove(self, names: Sequence[str]) -> None:
        with self._lock:
            for name in names:
                self._keep_spare(self._records.pop(name, None))

    def _keep_spare(self, record: np.ndarray | None) -> None:
        """Keep a record that leaves the store for reuse, unless someone still reads it (lock held)."""
        # References: the caller's expression, this argument, getrefcount's own; more means a reader.
        if record is not None and sys.getrefcount(record) <= 3 and self._spare_bytes + record.size <= SPARE_BYTES:
            self._spare[record.size].append(record)
            self._spare_bytes += record.size

    def close(self) -> None:
        with self._lock:
            self._records.clear()
            self._spare.clear()
            self._spare_bytes = 0


class MemoryStore(Store):
    """A `Store` over `MemoryRecords`: `MemoryStore()` is `open_store("memory://")`."""

    records: MemoryRecords

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        super().__init__(MemoryRecords(pin_memory=pin_memory))
