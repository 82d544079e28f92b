"""`PrefixCache`: prompt-prefix chunks kept in tiers of stores, fastest first, each bounded in bytes.

    cache = PrefixCache(["memory://?max_bytes=2GiB", "lmdb:///var/kv", "s3://bucket/kv"])

A read looks for each chunk in the tiers in order and stops at the first chunk found nowhere: a prefix is only of
use up to its first gap. A chunk found in a lower tier is copied into every tier above it (the next read is faster).
A damaged record (`CorruptBlock`), a missing one, or one of another shape is a miss in that tier and is dropped
there, and a tier that cannot be reached is a miss too: a read never returns wrong KV nor fails a request. Writes go
to every tier, on a thread of their own, so that the step that made the KV never waits for a disk or a bucket (a
chunk read before it is written is served from the write's own block); each tier then drops its least recently used
chunks while it holds more than its `max_bytes` (what a tier drops may still be in the tiers below it). A tier's
bytes and its order of use are this process's own view: chunks already in a persistent tier when it opens count as
least recently used.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..backends import open_store
from ..blocks import BlockKey, KVSpec
from ..errors import BlockNotFound, ConfigError, CorruptBlock, StoreError
from ..report import parse_size
from ..store import Store
from .keys import STREAM_PREFIX

#: Chunks waiting to be written, at most (a write asked for beyond them waits for room).
WRITE_QUEUE = 64
#: Seconds `drain` and `close` wait for the writes already asked for.
DRAIN_SECONDS = 60.0


def tier_url(text: str) -> tuple[str, int | None]:
    """A tier's store URL and its `max_bytes`, from `URL` or `URL?max_bytes=SIZE` (SIZE as `2GiB`, `512MiB`)."""
    url, separator, query = text.partition("?")
    if not separator:
        return url, None
    name, equals, value = query.partition("=")
    if name != "max_bytes" or not equals:
        raise ConfigError(f"{text!r}: a prefix cache tier takes one option, '?max_bytes=SIZE' (such as 2GiB)")
    size = parse_size(value)
    if size < 1:
        raise ConfigError(f"{text!r}: max_bytes must be positive")
    return url, size


@attrs.define
class Tier:
    """One store of the cache, with this process's view of what it holds: each chunk's bytes, least recently used
    first, and counters."""

    store: Store
    max_bytes: int | None
    owned: bool  # opened here from a URL (closed here too)
    entries: OrderedDict[BlockKey, int] = attrs.field(factory=OrderedDict)
    held: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    writes: int = 0

    def stats(self) -> dict[str, Any]:
        return {"url": self.store.url, "max_bytes": self.max_bytes, "bytes": self.held, "chunks": len(self.entries),
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions, "corrupt": self.corrupt,
                "errors": self.errors, "writes": self.writes}


class PrefixCache:
    """Prefix chunks in `tiers` (one URL, `Store` or a list of them, fastest first; see the module), for the KV
    geometry `spec` (its `batch` is 1: a chunk is one row's)."""

    def __init__(self, tiers: str | Store | Sequence[str | Store], spec: KVSpec) -> None:
        listed = [tiers] if isinstance(tiers, (str, Store)) else list(tiers)
        if not listed:
            raise ConfigError("a prefix cache needs at least one tier (a store URL)")
        self.spec = attrs.evolve(spec, batch=1)
        self.tiers: list[Tier] = []
        self._lock = threading.Lock()
        self._closed = False
        try:
            for tier in listed:
                if isinstance(tier, Store):
                    self.tiers.append(Tier(tier, None, owned=False))
                    continue
                if not isinstance(tier, str):
                    raise ConfigError(f"a prefix cache tier is a store URL or a Store, got {type(tier).__name__}")
                url, max_bytes = tier_url(tier)
                self.tiers.append(Tier(open_store(url), max_bytes, owned=True))
            for opened in self.tiers:
                self._adopt(opened)
        except BaseException:
            self._close_stores()
            raise
        self._queue: queue.Queue[list[tuple[BlockKey, Any]] | None] = queue.Queue(WRITE_QUEUE)
        self._pending = 0
        self._waiting: dict[BlockKey, Any] = {}  # chunks asked to be written, until they are
        self.waiting_hits = 0  # reads served from those
        self._idle = threading.Condition(self._lock)
        self.write_errors: list[str] = []
        self._writer = threading.Thread(target=self._write_loop, name="dejavu-prefix-writer", daemon=True)
        self._writer.start()

    # ---- reads ------------------------------------------------------------------------------------------------
    def read(self, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
        """The blocks (`[layers, 2, 1, H_kv, chunk, D]`) of the leading `keys` found in some tier, up to the first
        found in none; each found below the top tier is copied into the tiers above it."""
        blocks = []
        for key in keys:
            block = self._read_one(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _read_one(self, key: BlockKey) -> torch.Tensor | None:
        with self._lock:
            waiting = self._waiting.get(key)
        if waiting is not None:  # asked to be written and not yet in every tier: served from memory meanwhile
            with self._lock:
                self.waiting_hits += 1
            return waiting() if callable(waiting) else waiting
        expected = self.spec.block_shape(key)
        for level, tier in enumerate(self.tiers):
            try:
                block = tier.store.fetch(key)
            except BlockNotFound:
                with self._lock:
                    tier.misses += 1
                    self._forget(tier, key)
                continue
            except (StoreError, OSError):  # the tier is unreachable or closed: a miss there, never a failed request
                with self._lock:
                    tier.misses += 1
                    tier.errors += 1
                continue
            except CorruptBlock:
                block = None
            if block is None or tuple(block.shape) != expected or block.dtype != self.spec.torch_dtype:
                with self._lock:  # damaged, or of another shape: a miss here, and dropped from this tier
                    tier.corrupt += 1
                    self._forget(tier, key)
                self._delete(tier, key)
                continue
            with self._lock:
                tier.hits += 1
                self._note(tier, key)
            for upper in self.tiers[:level]:
                self._put(upper, key, block)
            return block
        return None

    # ---- writes -----------------------------------------------------------------------------------------------
    def write(self, blocks: Sequence[tuple[BlockKey, torch.Tensor | Callable[[], torch.Tensor]]]) -> None:
        """Keep each (key, block) in every tier that lacks it, on the writer thread (the caller does not wait
        for the stores; a block must not change meanwhile, and may be a function that builds it there)."""
        if self._closed:
            raise ConfigError("this prefix cache is closed")
        if not blocks:
            return
        with self._lock:
            self._pending += 1
            self._waiting.update(blocks)
        self._queue.put(list(blocks))

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Wait until every write asked for so far is in its tiers; False if `timeout` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout)

    def _write_loop(self) -> None:
        while True:
            blocks = self._queue.get()
            if blocks is None:
                return
            try:
                for key, block in blocks:
                    self._write_one(key, block)
                    with self._lock:
                        if self._waiting.get(key) is block:
                            del self._waiting[key]
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _write_one(self, key: BlockKey, block: Any) -> None:
        """Write one chunk into every tier that lacks it (building it first where it is a function); what fails
        is noted in `write_errors`, and the writer goes on with the next."""
        built = None
        try:
            for tier in self.tiers:
                with self._lock:  # a shared tier may have lost it to another process: this view does not know
                    present = key in tier.entries and not tier.store.shared
                    if present:
                        tier.entries.move_to_end(key)
                if not present:
                    built = built if built is not None else block() if callable(block) else block
                    self._put(tier, key, built)
        except Exception as error:  # a chunk not kept is a later miss: the writer must outlive it
            with self._lock:
                self.write_errors.append(f"{key}: {error!r}")

    def _put(self, tier: Tier, key: BlockKey, block: torch.Tensor) -> None:
        """Write one chunk into `tier`, then drop its least recently used chunks while it holds too much. A store
        that fails is noted (`write_errors`), never raised: a chunk not kept is a later miss, nothing worse."""
        try:
            tier.store.flush(key, block.contiguous())
        except (StoreError, OSError) as error:
            with self._lock:
                self.write_errors.append(f"{tier.store.url}: {error}")
            return
        with self._lock:
            tier.writes += 1
            self._note(tier, key)
            victims = []
            while tier.max_bytes is not None and tier.held > tier.max_bytes and len(tier.entries) > 1:
                victim, _ = next(iter(tier.entries.items()))
                self._forget(tier, victim)
                tier.evictions += 1
                victims.append(victim)
        for victim in victims:
            self._delete(tier, victim)

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    def _adopt(self, tier: Tier) -> None:
        """Count the chunks a tier already holds (a persistent one, reopened) as its least recently used."""
        for key in tier.store.keys(None):
            if key.stream_id.startswith(STREAM_PREFIX):
                self._note(tier, key)

    def _note(self, tier: Tier, key: BlockKey) -> None:
        if key not in tier.entries:
            tier.entries[key] = self._bytes(key)
            tier.held += tier.entries[key]
        tier.entries.move_to_end(key)

    def _forget(self, tier: Tier, key: BlockKey) -> None:
        size = tier.entries.pop(key, None)
        if size is not None:
            tier.held -= size

    def _bytes(self, key: BlockKey) -> int:
        return int(torch.Size(self.spec.block_shape(key)).numel()) * self.spec.torch_dtype.itemsize

    @staticmethod
    def _delete(tier: Tier, key: BlockKey) -> None:
        with contextlib.suppress(StoreError, OSError):  # gone, or unreachable: the chunk stays a miss either way
            tier.store.delete(key.stream_id)

    def stats(self) -> list[dict[str, Any]]:
        """Each tier's URL, bounds, bytes and chunks held, hits, misses, evictions, corrupt records, failed reads
        and writes."""
        with self._lock:
            return [tier.stats() for tier in self.tiers]

    def close(self) -> None:
        """Finish the writes asked for (at most DRAIN_SECONDS), stop the writer, close the stores opened from URLs."""
        if self._closed:
            return
        self._closed = True
        self.drain()
        self._queue.put(None)
        self._writer.join(timeout=DRAIN_SECONDS)
        self._close_stores()

    def _close_stores(self) -> None:
        for tier in self.tiers:
            if tier.owned:
                tier.store.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
