"""`lmdb:///path`: records in an LMDB environment on local disk (the paper's SSD tier).

Each `put_records` is one LMDB write transaction, so its records are wholly committed or absent, even if the
process is killed mid-write. `sync=True` (the default) makes every committed block survive power loss;
`sync=False` skips the fsync: committed blocks still survive a crash or SIGKILL of the process, but the
last ones may be lost if the machine itself goes down. Other processes opening the same path see every
committed block. The memory map starts at `map_size` and doubles whenever it fills.

Records are lent straight from the memory map (`lends_buffers`): a record got with `get_record` is valid
only inside its `with` block, which holds a read transaction and one of the `max_readers` reader slots
meanwhile. Every LMDB error becomes a `StoreError` naming the directory and what to do.

A damaged data file must not kill the process: LMDB reads pages through its memory map, and a page beyond
the end of a truncated data.mdb raises SIGBUS. `DataFileWatch` (lmdb_pages.py) refuses such a store at open,
and, since LMDB data files never shrink, looks at the file's size before every transaction: if it shrank, the
transaction, and every later one until the file is whole again, fails with StoreError where the current
snapshot reaches a missing page. What remains: a file truncated after that look and before the
transaction reads the page (microseconds), or while a record lent by `get_record` is being read, still
raises SIGBUS; so does a truncation that only drops pages of an older snapshot that a read transaction
still holds. Garbage written inside the file, rather than a missing end, is for the records' checksums
(CorruptBlock) and LMDB's own checks.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import lmdb

from ..errors import BlockNotFound, ConfigError, StoreError
from ..records import NamedRecord, RecordStore, record_array
from ..store import Store
from ..urls import ParsedURL
from .lmdb_pages import DataFileWatch

DEFAULT_MAP_SIZE = 1 << 30  # the memory map's first size; it doubles whenever it fills
DEFAULT_MAX_READERS = 126  # LMDB's own default number of reader slots
MIN_MAP_SIZE = 1 << 16
MAX_READERS = (1 << 31) - 1  # the reader table is sized by an unsigned int; LMDB refuses 0
_MAX_RESIZES = 48


class _SharedExclusiveLock:
    """Many transactions at once (shared), or one map resize with no transaction open (exclusive).

    Shared entry and exit are the hot path (every block written or read): plain methods, no generator,
    and a notification only when a resize is waiting for the last transaction to end.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._holders = 0
        self._exclusive = False
        self._waiting = 0  # resizes waiting for the holders to leave

    def __enter__(self) -> None:  # shared
        with self._condition:
            while self._exclusive:
                self._condition.wait()
            self._holders += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._condition:
            self._holders -= 1
            if self._waiting and self._holders == 0:
                self._condition.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            self._waiting += 1
            try:
                while self._exclusive or self._holders:
                    self._condition.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()


class _Environment:
    """One LMDB environment per directory and process (LMDB forbids opening it twice), shared by every
    LmdbStore on that directory and closed with the last of them."""

    _open: ClassVar[dict[str, _Environment]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, real_path: str, sync: bool, map_size: int, max_readers: int) -> None:
        self.real_path, self.sync, self.users = real_path, sync, 0
        self.env = lmdb.open(real_path, map_size=map_size, sync=sync, metasync=sync, readahead=False,
                             max_readers=max_readers, max_dbs=0)
        try:
            self.env.reader_check()  # free reader slots left behind by killed processes
            self.watch = DataFileWatch(self.env, real_path)  # StoreError if pages LMDB reads are missing
        except BaseException:
            self.env.close()
            raise
        self.gate = _SharedExclusiveLock()
        self.write_lock = threading.Lock()

    @classmethod
    def acquire(cls, path: str, sync: bool, map_size: int, max_readers: int) -> _Environment:
        with cls._registry_lock:
            try:
                os.makedirs(path, exist_ok=True)
                real_path = os.path.realpath(path)
                shared = cls._open.get(real_path)
                if shared is None:
                    shared = cls._open[real_path] = cls(real_path, sync, map_size, max_readers)
            except StoreError:
                raise
            except lmdb.ReadersFullError as error:
                raise StoreError(f"cannot open LMDB store at {path!r}: {error}; {_READERS_FULL_ADVICE}") from error
            except (lmdb.Error, OSError) as error:
                raise StoreError(f"cannot open LMDB store at {path!r}: {error}") from error
            if shared.sync != sync:
                raise ConfigError(f"the LMDB store at {path!r} is already open in this process with sync="
                                  f"{shared.sync}; open it again with the same setting")
            shared.users += 1
            return shared

    def release(self) -> None:
        with self._registry_lock:
            self.users -= 1
            if self.users == 0:
                del self._open[self.real_path]
                with self.gate.exclusive():
                    self.env.close()
                    self.watch.close()


class LmdbRecords(RecordStore):
    """Records in an LMDB environment at `path` (a directory, created if missing); thread- and process-safe."""

    atomic_batches = True
    persistent = True
    shared = True
    lends_buffers = True  # records are views of the memory map, valid while their read transaction lasts

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True, map_size: int = DEFAULT_MAP_SIZE,
                 max_readers: int = DEFAULT_MAX_READERS) -> None:
        path = os.fspath(path)
        self.url = f"lmdb://{os.path.abspath(path)}"
        if not _is_int(map_size) or map_size < MIN_MAP_SIZE:
            raise ConfigError(f"map_size must be an int of at least {MIN_MAP_SIZE} bytes, got {map_size!r}")
        if not _is_int(max_readers) or not 1 <= max_readers <= MAX_READERS:
            raise ConfigError(f"max_readers must be a positive int (at most {MAX_READERS}), got {max_readers!r}")
        self.path = path
        self.sync = bool(sync)
        self._shared = _Environment.acquire(path, self.sync, map_size, max_readers)
        self._env, self._gate, self._write_lock = self._shared.env, self._shared.gate, self._shared.write_lock
        self._watch = self._shared.watch
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: ParsedURL, *, sync: bool = True, map_size: int = DEFAULT_MAP_SIZE,
                 max_readers: int = DEFAULT_MAX_READERS) -> LmdbRecords:
        return cls(url.path, sync=sync, map_size=map_size, max_readers=max_readers)

    @property
    def map_size(self) -> int:
        with _Translated(self.path):
            return int(self._env.info()["map_size"])

    # ---- transactions -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator[lmdb.Transaction[memoryview]]:
        """A transaction that adopts a map grown by another process; commits a write when the block ends."""
        passing = (lmdb.MapFullError,) if write else ()  # `_write` grows the map and tries again
        for _ in range(_MAX_RESIZES):
            with self._gate:  # shared
                txn: lmdb.Transaction[memoryview] | None = None
                try:
                    with _Translated(self.path, passing=(lmdb.MapResizedError,)):
                        self._watch.check()  # StoreError, not SIGBUS, if data.mdb lost pages this txn reads
                        txn = self._env.begin(write=write, buffers=True)
                except lmdb.MapResizedError:  # another process grew the map: adopt its size and begin again
                    pass
                if txn is not None:
                    try:
                        with _Translated(self.path, passing=passing), txn:  # txn: commits, or aborts on error
                            yield txn
                        return
                    finally:
                        txn = None  # free its reader slot now, not when a traceback that holds this frame dies
            self._resize(grow=False)
        raise StoreError(f"LMDB store at {self.path!r} kept being resized by other processes")

    def _resize(self, grow: bool, needed: int = 0) -> None:
        with self._gate.exclusive(), _Translated(self.path):
            if grow:
                current = self._env.info()["map_size"]
                self._env.set_mapsize(max(2 * current, current + 2 * needed))
            else:
                self._env.set_mapsize(0)  # adopt the size another process chose

    def _write(self, action: Callable[[lmdb.Transaction[memoryview]], object], needed: int = 0) -> None:
        with self._write_lock:  # LMDB allows one writer; queue here rather than inside the C library
            for _ in range(_MAX_RESIZES):
                try:
                    with self._transaction(write=True) as txn:
                        action(txn)
                    return
                except lmdb.MapFullError:  # noqa: PERF203 - a full map is the signal to grow it and retry
                    self._resize(grow=True, needed=needed)
            raise StoreError(f"LMDB store at {self.path!r} could not grow its map enough")

    # ---- the record interface -----------------------------------------------------------------
    def put_records(self, records: Sequence[NamedRecord]) -> None:
        arrays = [(name, record_array(record)) for name, record in records]

        def put_all(txn: lmdb.Transaction[memoryview]) -> None:
            for name, record in arrays:
                txn.put(name.encode(), record.data)

        self._write(put_all, needed=sum(record.nbytes for _, record in arrays))

    @contextlib.contextmanager
    def get_record(self, name: str) -> Iterator[memoryview]:
        with self._transaction(write=False) as txn:
            record = txn.get(name.encode())
            if record is None:
                raise BlockNotFound(f"no block {name} in {self.url}")
            yield record

    def names(self, prefix: str) -> list[str]:
        encoded = prefix.encode()
        with self._transaction(write=False) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(encoded):
                return []
            names = []
            for key in cursor.iternext(values=False):
                name = bytes(key)
                if not name.startswith(encoded):
                    break
                names.append(name.decode())
            return names

    def remove(self, names: Sequence[str]) -> None:
        def delete_all(txn: lmdb.Transaction[memoryview]) -> None:
            for name in names:
                txn.delete(name.encode())

        self._write(delete_all)

    def close(self) -> None:
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._shared.release()


class LmdbStore(Store):
    """A `Store` over `LmdbRecords`: `LmdbStore(path)` is `open_store("lmdb://" + path)`."""

    records: LmdbRecords

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True, map_size: int = DEFAULT_MAP_SIZE,
                 max_readers: int = DEFAULT_MAX_READERS) -> None:
        super().__init__(LmdbRecords(path, sync=sync, map_size=map_size, max_readers=max_readers))


_READERS_FULL_ADVICE = ("too many concurrent readers: every reader slot is held by an open read transaction; "
                        "raise max_readers (open_store(url, max_readers=...)), or read from fewer threads "
                        "and processes at once")
_DAMAGED_ADVICE = "the store is damaged: restore it from a copy, or delete the directory"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Translated:
    """Turn every LMDB error, except those in `passing` (which the caller handles), into StoreError with
    advice on what to do. A class, not a generator: it wraps every transaction, and does nothing unless
    an error passes."""

    def __init__(self, path: str, passing: tuple[type[lmdb.Error], ...] = ()) -> None:
        self.path, self.passing = path, passing

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _traceback: object) -> None:
        if error is None or not isinstance(error, lmdb.Error) or isinstance(error, self.passing):
            return
        if isinstance(error, lmdb.ReadersFullError):
            advice = _READERS_FULL_ADVICE
        elif isinstance(error, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError,
                                lmdb.VersionMismatchError)):
            advice = _DAMAGED_ADVICE
        elif isinstance(error, lmdb.MapFullError):
            advice = "the memory map is full: open the store with a larger map_size"
        elif isinstance(error, lmdb.DiskError):
            advice = "check the disk: free space, I/O errors"
        else:
            advice = "check the directory (free space, permissions) and that no other program changes it"
        raise StoreError(f"LMDB store at {self.path!r} failed: {error}; {advice}") from error
