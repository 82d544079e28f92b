"""Where a replicated stream lives: its blocks, its manifest, and how each block's manifest goes with it.

The engine picks one replica at construction, from its store and transport:
- `OneStoreReplica`: blocks, manifests and progress records in the engine's own store, through the local
  transport (device copies on side streams). Each block and the progress record naming it are one write
  (one LMDB transaction), and so are several blocks with theirs (`flush_group_with_progress`).
- `SplitReplica`: blocks in another store (a peer's, through a network transport), manifests and progress
  records in the engine's own store, each progress record written right after the block it names is
  accepted.
Both give the cache manager `flush_with_progress`, and the engine `blocks` to fetch from, `delete` (a whole
stream, every run) and `delete_run` (one run's blocks and progress records, and the manifest while it is
still that run's).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from .backends import open_transport
from .blocks import BlockKey, ProgressGroup, ProgressKey
from .errors import BlockNotFound, CorruptBlock
from .store import Store, manifest_name
from .stream import BlockIO
from .transports.base import Transport
from .transports.local import LocalTransport


class OneStoreReplica:
    """Blocks, manifests and progress in `transport.store`; device blocks reach it through the local transport."""

    def __init__(self, transport: LocalTransport) -> None:
        self.transport = transport
        self.manifests: Store = transport.store
        self.blocks: BlockIO = transport  # device copies on the way, both ways

    def flush_with_progress(self, key: BlockKey, block: Any, progress: ProgressKey, record: bytes) -> None:
        self.transport.flush_with_progress(key, block, progress, record)

    def flush_group_with_progress(self, group: ProgressGroup) -> None:
        self.transport.flush_group_with_progress(group)

    def delete(self, stream_id: str) -> int:
        return self.manifests.delete(stream_id)

    def delete_run(self, stream_id: str, run: str) -> int:
        """The manifest while it is this run's, then the run's progress records, then its blocks, removed in
        one request (one LMDB transaction), after reading the manifest and listing the stream."""
        records = _records_of_run(self.manifests, stream_id, run)
        self.manifests.records.remove(_manifest_of_run(self.manifests, stream_id, run) + records.progress
                                      + records.blocks)
        return len(records.blocks)

    def close(self) -> None:
        self.transport.close()


class SplitReplica:
    """Blocks in `blocks` (another store), manifests and progress in `manifests`; progress follows its block."""

    def __init__(self, blocks: Store, manifests: Store) -> None:
        self.blocks, self.manifests = blocks, manifests

    def flush_with_progress(self, key: BlockKey, block: Any, progress: ProgressKey, record: bytes) -> None:
        self.blocks.flush(key, block)
        self.manifests.put_progress(progress, record)

    def delete(self, stream_id: str) -> int:
        self.manifests.delete(stream_id)
        return self.blocks.delete(stream_id)

    def delete_run(self, stream_id: str, run: str) -> int:
        """The manifest while it is this run's and the run's progress records, then its blocks."""
        self.manifests.records.remove(_manifest_of_run(self.manifests, stream_id, run)
                                      + _records_of_run(self.manifests, stream_id, run).progress)
        blocks = _records_of_run(self.blocks, stream_id, run).blocks
        self.blocks.records.remove(blocks)
        return len(blocks)

    def close(self) -> None:
        self.blocks.close()


def _manifest_of_run(store: Store, stream_id: str, run: str) -> list[str]:
    """The name of the stream's manifest if run `run` wrote it, else nothing: another run's manifest stays.
    The check and the removal are two requests, so a run that rewrites its manifest in between (a resume)
    loses it. The manifest goes first: it must never name a block that is gone."""
    try:
        owner = json.loads(store.read_manifest(stream_id)).get("run")
    except (BlockNotFound, CorruptBlock, ValueError, AttributeError, RecursionError):  # none, or not this run's
        owner = None
    return [manifest_name(stream_id)] if owner == run else []


@attrs.frozen
class _RunRecords:
    progress: list[str]
    blocks: list[str]


def _records_of_run(store: Store, stream_id: str, run: str) -> _RunRecords:
    """The names of the progress records and blocks of run `run` of the stream; those of its other runs stay."""
    return _RunRecords([str(key) for key in store.progress_keys(stream_id) if key.run == run],
                       [str(key) for key in store.keys(stream_id) if key.run == run])


def open_replica(store: Store, transport: str | Transport) -> OneStoreReplica | SplitReplica:
    """The replica for an engine whose manifests live in `store` and whose blocks travel by `transport`."""
    link = open_transport(transport, store=store) if transport == "local" else open_transport(transport)
    if isinstance(link, LocalTransport) and link.store is store:
        return OneStoreReplica(link)
    return SplitReplica(Store(link), store)
