"""The replication ring: each decoding stage writes its slots' KV to the next decoding stage's memory.

Decoding stage x of T keeps a replica of its caches in the store that stage (x + 1) % T serves beside its
inbox (every stage worker's inbox is a transport server over a `MemoryStore`), or, with a replica store
configured (`file://`, `s3://`, any store other processes read), in that store, which outlives any stage.
Slot j's replica is a set of pieces under streams named from `replica_stream(x, j)` (`slot_replicas`); when the
slot ends, the stage deletes them. This module names the streams, says where they go (`Replicator`), reads a
replica back (`assemble`, `cache_from`) and removes what a pipeline leaves (`remove_replicas`). Blocks are
checksummed, so what a holder sends back is exactly what the stage computed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from ...errors import DejaVuError, StoreError
from ...store import Store


def replica_stream(stage: int, microbatch: int, prefix: str = "") -> str:
    """The stem of the streams under which decoding stage `stage` replicates slot `microbatch`'s cache (`prefix`:
    the pipeline's, in a store that several pipelines may share)."""
    return f"{prefix}stage{stage}-microbatch{microbatch}"


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


@attrs.frozen
class Replicator:
    """Where a decoding stage's replicas go: `holder` (the next decoding stage's served store, or a durable store
    that every stage shares), written as stage number `stage` with `layers` layers, under streams named with
    `prefix` (`slot_replicas.SlotReplicas` writes the pieces)."""

    holder: Store
    stage: int
    layers: int
    prefix: str = ""


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
