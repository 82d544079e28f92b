"""The replication ring: each decoding stage streams its microbatches' KV to the next decoding stage's memory.

Decoding stage x of T keeps a replica of its caches in the store that stage (x + 1) % T serves beside its
inbox (every stage worker's inbox is a transport server over a `MemoryStore`), or, with a replica store
configured (`file://`, `s3://`, any store other processes read), in that store, which outlives any stage.
Per microbatch j, stage x streams through a `CacheManager` under the stream `replica_stream(x, j)`: the
prompt as one block per layer as soon as the stage holds it, then every decode step's new position over all
its layers (buffered copies, flushed by the manager's streamer thread while the next step computes). When
the microbatch ends, the stage deletes its replica.

How far a replica reaches is read from the replica itself when it matters (at recovery, `held_positions`
over the holder's keys) rather than acknowledged step by step: an acknowledgement per step and stage would
double the head's messages for a number that is only ever read after a failure, and the holder's own store
is the truth a recovery restores from. Blocks are checksummed, so what a holder reports and sends back is
exactly what the stage computed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import DynamicCache

from ...blocks import BlockKey
from ...cache import CacheManager
from ...errors import DejaVuError, ReplicationError, StoreError
from ...store import Store


def replica_stream(stage: int, microbatch: int, prefix: str = "") -> str:
    """The stream under which decoding stage `stage` replicates microbatch `microbatch`'s cache (`prefix`: the
    pipeline's, in a store that several pipelines may share)."""
    return f"{prefix}stage{stage}-microbatch{microbatch}"


def held_positions(keys: Iterable[BlockKey], layers: int) -> int:
    """Positions [0, n) that the blocks `keys` cover for every one of `layers` layers (blocks may overlap, as a
    replica rewound by a recovery and streamed again holds the same positions twice, with the same bytes)."""
    ends = [0] * layers
    by_start = sorted(keys, key=lambda key: key.tokens[0])
    advanced = True
    while advanced:
        advanced = False
        for key in by_start:
            for layer in range(*key.layers):
                if layer < layers and key.tokens[0] <= ends[layer] < key.tokens[1]:
                    ends[layer] = key.tokens[1]
                    advanced = True
    return min(ends, default=0)


def assemble(store: Store, stream_id: str, layers: int, positions: int) -> torch.Tensor:
    """Layers x positions [0, `positions`) of a replicated cache, `[layers, 2, B, H_kv, positions, D]`, from the
    blocks of `stream_id` in `store` (which must cover them: `held_positions`)."""
    keys = store.keys(stream_id)
    out: torch.Tensor | None = None
    filled = [0] * layers
    for key in sorted(keys, key=lambda key: key.tokens[0]):
        start, stop = key.tokens
        wanted = [layer for layer in range(*key.layers) if layer < layers and start <= filled[layer] < stop]
        if not wanted or start >= positions:
            continue
        block = store.fetch(key)
        if out is None:
            shape = list(block.shape)
            shape[0], shape[4] = layers, positions
            out = block.new_empty(shape)
        for layer in wanted:
            begin, end = filled[layer], min(stop, positions)
            out[layer, :, :, :, begin:end] = block[layer - key.layers[0], :, :, :, begin - start:end - start]
            filled[layer] = end
    if out is None or min(filled) < positions:
        raise DejaVuError(f"the replica {stream_id} holds {min(filled, default=0)} of the {positions} positions "
                          "asked for")
    return out


def cache_from(block: torch.Tensor, config: Any) -> DynamicCache:
    """A cache holding `[layers, 2, B, H_kv, positions, D]`, each layer at its local index."""
    cache = DynamicCache(config=config)
    for layer in range(block.shape[0]):
        cache.update(block[layer, 0].clone(), block[layer, 1].clone(), layer)
    return cache


class Replicator:
    """A decoding stage's side of the ring: one `CacheManager` per microbatch, streaming to `holder` (the next
    decoding stage's served store, or a durable store that every stage shares) as stage number `stage` with
    `layers` layers, under streams named with `prefix`."""

    def __init__(self, holder: Store, stage: int, layers: int, prefix: str = "") -> None:
        self.holder, self.stage, self.layers, self.prefix = holder, stage, layers, prefix
        self._managers: dict[int, CacheManager] = {}

    def start(self, microbatch: int, cache: DynamicCache, durable_positions: int = 0) -> None:
        """Replicate `microbatch` from now on; its replica already holds positions [0, `durable_positions`), and
        whatever `cache` holds beyond them is streamed now, one block per layer."""
        self.finish(microbatch)
        manager = CacheManager(self.holder, replica_stream(self.stage, microbatch, self.prefix), self.layers,
                               durable_positions=durable_positions)
        self._managers[microbatch] = manager
        length = cache.get_seq_length()
        layers: list[Any] = cache.layers  # key/value layers: a pipeline refuses replication of any other kind
        if length > durable_positions:
            new = slice(durable_positions, length)
            for layer, kv in enumerate(layers):
                manager.observe(layer, kv.keys[:, :, new], kv.values[:, :, new], durable_positions)

    def step(self, microbatch: int, cache: DynamicCache) -> None:
        """Stream the position `cache` has just appended (one decode step) of `microbatch`."""
        manager = self._managers[microbatch]
        first = cache.get_seq_length() - 1
        layers: list[Any] = cache.layers
        for layer, kv in enumerate(layers):
            manager.observe(layer, kv.keys[:, :, -1:], kv.values[:, :, -1:], first)

    def finish(self, microbatch: int) -> None:
        """Wait until what `microbatch` handed off reached the holder (or failed, the holder being gone)."""
        manager = self._managers.pop(microbatch, None)
        if manager is not None:
            _quietly_finish(manager)

    def finish_all(self) -> None:
        for microbatch in list(self._managers):
            self.finish(microbatch)

    def end(self, microbatch: int) -> None:
        """The microbatch ended: stop replicating it and delete its replica."""
        self.finish(microbatch)
        with contextlib.suppress(DejaVuError):  # a holder gone takes the replica with it
            self.holder.delete(replica_stream(self.stage, microbatch, self.prefix))


def _quietly_finish(manager: CacheManager) -> None:
    """Finish a manager whose holder may be gone (a recovery is under way): its error then says nothing new."""
    with contextlib.suppress(ReplicationError):
        manager.finish()


def delete_replicas(store: Store, stages: list[int], microbatches: list[int], prefix: str) -> None:
    """Delete what the decoding `stages` (numbers in the token pipeline) replicated of `microbatches` into a shared
    replica store (a slot's pieces included), and close it: a closing pipeline leaves nothing behind."""
    remove_replicas(store, set(microbatches).__contains__, prefix, stages)
    store.close()


def remove_replicas(store: Store, dropped: Callable[[int], bool], prefix: str,
                    stages: Iterable[int] | None = None) -> None:
    """Delete the replica streams in `store`, under the pipeline's `prefix`, of the microbatches (and slots, their
    pieces included) whose number is `dropped`, that `stages` wrote (None: any stage); a store that fails is left
    as it is."""
    writers = None if stages is None else set(stages)
    pattern = re.compile(rf"{re.escape(prefix)}stage(\d+)-microbatch(\d+)(-.+)?")
    with contextlib.suppress(StoreError):
        for stream in sorted({key.stream_id for key in store.keys(None)}):
            match = pattern.fullmatch(stream)
            if match and dropped(int(match[2])) and (writers is None or int(match[1]) in writers):
                with contextlib.suppress(StoreError):
                    store.delete(stream)
