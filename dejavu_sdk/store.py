"""`Store`: KV blocks, stream manifests and progress records by key, on top of any record store.

Callers (the cache manager, the engine, the CLI, users) flush and fetch blocks by `BlockKey`. The store
encodes each block into a checksummed record (`dejavu_sdk.codec`), names it `str(key)`, and keeps it in
its `records` (a `RecordStore`: a store backend, or a transport reaching a store in another process).
Encoding, checksums, `out` handling, closed-state checks and argument validation live here once, so every
backend behaves the same and wrappers stay complete.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from .blocks import BlockKey, ProgressGroup, ProgressKey, check_key, check_stream_id
from .codec import decode_block, encode_block
from .errors import ConfigError, StoreClosed
from .records import BlockStreaming, NamedRecord, RecordStore


class Store:
    """A place where KV blocks live: `flush(key, block)`, `fetch(key, out=None)`, `keys`, `delete`.

    `records` holds the encoded blocks; its capability flags say what the store promises:
    `persistent`: blocks outlive this process; `shared`: other processes can read what this one flushes.
    """

    def __init__(self, records: RecordStore) -> None:
        if not isinstance(records, RecordStore):
            raise ConfigError(f"a Store needs a RecordStore (a store backend or a transport), got {records!r}")
        self.records = records
        self.url = records.url
        # Chosen once: blocks go straight through a transport, or are encoded into records here.
        self._streaming = records if isinstance(records, BlockStreaming) else None
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def persistent(self) -> bool:
        return self.records.persistent

    @property
    def shared(self) -> bool:
        return self.records.shared

    # ---- blocks --------------------------------------------------------------------------------
    def flush(self, key: BlockKey, block: Any) -> None:
        """Store `block` (a tensor on any device, a numpy array or a buffer) under `key`, replacing any."""
        self._check_open()
        check_key(key)
        if self._streaming is not None:
            self._streaming.flush(key, block)
        else:
            self.records.put_records([(str(key), encode_block(key, block, self.records.allocate))])

    def flush_group(self, blocks: Sequence[tuple[BlockKey, Any]]) -> None:
        """`flush` each (key, block) of `blocks`, in one request where the records allow (LMDB: one
        transaction); in order otherwise."""
        self._check_open()
        if self._streaming is not None:
            for key, block in blocks:
                self.flush(key, block)
            return
        records: list[NamedRecord] = []
        for key, block in blocks:
            check_key(key)
            records.append((str(key), encode_block(key, block, self.records.allocate)))
        self.records.put_records(records)

    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor:
        """Return the block stored under `key`, verified, copied into `out` when given (any device)."""
        self._check_open()
        check_key(key)
        if self._streaming is not None:
            return self._streaming.fetch(key, out)
        with self.records.get_record(str(key)) as record:
            return decode_block(key, record, out)

    def keys(self, stream_id: str | None = None) -> list[BlockKey]:
        """The keys of every stored block of `stream_id` (of all streams when None), sorted."""
        self._check_open()
        prefix = "" if stream_id is None else check_stream_id(stream_id) + "/"
        parsed = (block_key_or_none(name) for name in self.records.names(prefix))
        return sorted(key for key in parsed if key is not None)

    def delete(self, stream_id: str) -> int:
        """Delete every block of `stream_id`, its manifest and progress records; return how many blocks."""
        self._check_open()
        names = self.records.names(check_stream_id(stream_id) + "/")
        self.records.remove(names)
        return sum(1 for name in names if block_key_or_none(name) is not None)

    # ---- manifests -----------------------------------------------------------------------------
    def write_manifest(self, stream_id: str, manifest: bytes) -> None:
        """Store a stream's manifest (small, checksummed like a block), replacing any; `delete` removes it."""
        self._check_open()
        self.records.put_records([self._small_record(manifest_name(stream_id), manifest)])

    def read_manifest(self, stream_id: str) -> bytes:
        """The stream's manifest; BlockNotFound if it has none, CorruptBlock if it is damaged."""
        self._check_open()
        return self._read_small(manifest_name(stream_id))

    # ---- progress records: what a generating stream writes per durable block -----------------------
    def flush_with_progress(self, key: BlockKey, block: Any, progress: ProgressKey, record: bytes) -> None:
        """Store `block` under `key` and the progress record `record` under `progress`, in one request, in
        that order.

        Record stores with atomic batches (LMDB) commit both at once; the others write the block first,
        so a progress record never names a block that is not stored.
        """
        self.flush_group_with_progress([(key, block, progress, record)])

    def flush_group_with_progress(self, group: ProgressGroup) -> None:
        """`flush_with_progress` for each (key, block, progress, record) of `group`, in one request: LMDB
        commits them all in one transaction (one fsync), the others write them in order."""
        self._check_open()
        records: list[NamedRecord] = []
        for key, block, progress, record in group:
            check_key(key)
            if not isinstance(progress, ProgressKey) or (progress.stream_id, progress.run) != (key.stream_id,
                                                                                                 key.run):
                raise ConfigError(f"the progress record {progress!r} does not belong to the stream and run of {key}")
            records += [(str(key), encode_block(key, block, self.records.allocate)),
                        self._small_record(str(progress), record)]
        self.records.put_records(records)

    def put_progress(self, progress: ProgressKey, record: bytes) -> None:
        """Store one progress record, for a stream whose blocks live in another store."""
        self._check_open()
        if not isinstance(progress, ProgressKey):
            raise ConfigError(f"expected a dejavu_sdk.ProgressKey, got {type(progress).__name__} {progress!r}")
        self.records.put_records([self._small_record(str(progress), record)])

    def progress_keys(self, stream_id: str) -> list[ProgressKey]:
        """The keys of every progress record of `stream_id` (all runs and logs), sorted."""
        self._check_open()
        parsed = (progress_key_or_none(name) for name in self.records.names(check_stream_id(stream_id) + "/"))
        return sorted(key for key in parsed if key is not None)

    def read_progress(self, progress: ProgressKey) -> bytes:
        """One progress record; BlockNotFound if it is missing, CorruptBlock if it is damaged."""
        self._check_open()
        return self._read_small(str(progress))

    def remove_progress(self, stream_id: str, run: str, below_log: int | None = None) -> None:
        """Remove the progress records of run `run` of the stream: all of them, or those of logs before
        `below_log` (what a manifest rewritten under log `below_log` already holds)."""
        self.records.remove([str(key) for key in self.progress_keys(stream_id)
                             if key.run == run and (below_log is None or key.log < below_log)])

    def _small_record(self, name: str, data: bytes) -> NamedRecord:
        """A manifest or progress record, checksummed like a block, ready for `put_records`."""
        return name, encode_block(name, data, self.records.allocate)

    def _read_small(self, name: str) -> bytes:
        with self.records.get_record(name) as record:
            return decode_block(name, record).numpy().tobytes()

    # ---- life cycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the record store; later calls raise `StoreClosed`. Closing twice is harmless."""
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self.records.close()

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


def manifest_name(stream_id: str) -> str:
    """The record name of a stream's manifest, beside its blocks."""
    return check_stream_id(stream_id) + "/manifest"


def block_key_or_none(name: str) -> BlockKey | None:
    """The key a record name stands for, or None for records that are not blocks (manifests, progress)."""
    try:
        return BlockKey.parse(name)
    except ConfigError:
        return None


def progress_key_or_none(name: str) -> ProgressKey | None:
    """The progress key a record name stands for, or None for records that are not progress records."""
    try:
        return ProgressKey.parse(name)
    except ConfigError:
        return None
