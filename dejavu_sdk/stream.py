"""DejaVuLib's streaming primitives, on top of any store or transport (anything with flush/fetch).

    scatter       cut a region of a live cache (some layers x some positions) into blocks and flush them;
                  with a `StagingBuffer`, all layers' slices are first gathered into one reusable
                  contiguous buffer and flushed as one block (buffered copies), else one block per layer
    gather        rebuild a cache tensor `[layers, 2, B, H_kv, positions, D]` by tiling stored blocks
    stream_out    split blocks along the layer axis at another pipeline's stage boundaries
    stream_in     merge the pieces one stage receives into one block per position range

The cache manager calls `scatter` while a model runs and `gather` to resume; a prompt pipeline and a
token pipeline that cut the model differently use `stream_out` and `stream_in` between them.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from .blocks import BlockKey, KVSpec, ProgressGroup, ProgressKey
from .codec import HostBlock
from .errors import ConfigError


class BlockSink(Protocol):
    """Takes blocks: a Store, a Transport."""

    def flush(self, key: BlockKey, block: Any) -> None: ...


class BlockSource(Protocol):
    """Gives blocks back: a Store, a Transport."""

    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor: ...


class BlockIO(BlockSink, BlockSource, Protocol):
    """Takes blocks and gives them back."""


@runtime_checkable
class ProgressSink(Protocol):
    """Takes each block together with a progress record naming it: a Store, the local transport, a replica."""

    def flush_with_progress(self, key: BlockKey, block: Any, progress: ProgressKey, record: bytes) -> None: ...


@runtime_checkable
class BlockGroupSink(Protocol):
    """A `BlockSink` that also takes several blocks in one request (one LMDB transaction), in order."""

    def flush_group(self, blocks: Sequence[tuple[BlockKey, Any]]) -> None: ...


@runtime_checkable
class GroupSink(Protocol):
    """A `ProgressSink` that also takes several blocks with their progress records in one request (one LMDB
    transaction: group commit), in order, so that no record names a block that is not written."""

    def flush_group_with_progress(self, group: ProgressGroup) -> None: ...


def _check_boundaries(_instance: object, _attribute: object, value: tuple[int, ...]) -> None:
    if len(value) < 2 or value[0] != 0 or any(b <= a for a, b in itertools.pairwise(value)):
        raise ConfigError(f"stage boundaries must rise strictly from 0, like (0, 15, 30); got {value!r}")


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class LayerPartition:
    """How a pipeline cuts a model's layers into stages: stage i holds layers [boundaries[i], boundaries[i+1])."""

    boundaries: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_check_boundaries)

    @classmethod
    def even(cls, layers: int, stages: int) -> LayerPartition:
        """`stages` stages of as equal a size as possible (earlier stages take the remainder)."""
        if not 1 <= stages <= layers:
            raise ConfigError(f"cannot cut {layers} layers into {stages} stages")
        size, extra = divmod(layers, stages)
        boundaries = [0]
        for stage in range(stages):
            boundaries.append(boundaries[-1] + size + (1 if stage < extra else 0))
        return cls(tuple(boundaries))

    @property
    def layers(self) -> int:
        return self.boundaries[-1]

    @property
    def stages(self) -> list[tuple[int, int]]:
        return list(zip(self.boundaries, self.boundaries[1:], strict=False))


class StagingBuffer:
    """A reusable contiguous buffer for one block of `layers` x `tokens` positions (buffered copies).

    One decode step touches one position of every layer: gathering those small, scattered slices into
    this buffer is cheap device-memory work, and the block then leaves in one copy instead of one per layer.
    """

    def __init__(self, spec: KVSpec, layers: tuple[int, int], tokens: int = 1,
                 device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.layers = layers
        self.buffer = torch.empty(spec.shape(layers[1] - layers[0], tokens), dtype=spec.torch_dtype, device=device)
        #: The buffer as a `HostBlock`, described once, when it is in CPU memory: handed off as such, a block
        #: reaches a store or transport without a numpy or torch call on the streamer's thread.
        self.host_block = HostBlock.of(self.buffer) if self.buffer.device.type == "cpu" else None

    def fill(self, layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], tokens: tuple[int, int],
             slot: int = 0) -> torch.Tensor:
        """Copy positions `tokens` of each layer's (keys, values) `[B, H_kv, S, D]` into the buffer, at
        position `slot` onwards (several decode steps can share one buffer); one copy for all layers."""
        t0, t1 = tokens
        if slot + t1 - t0 > self.buffer.shape[4]:
            raise ConfigError(f"this staging buffer holds {self.buffer.shape[4]} positions, not {slot + t1 - t0}")
        if len(layer_kv) != self.buffer.shape[0]:
            raise ConfigError(f"expected {self.buffer.shape[0]} layers of (keys, values), got {len(layer_kv)}")
        slices = [_positions(part, tokens) for pair in layer_kv for part in pair]
        target = self.buffer[:, :, :, :, slot:slot + t1 - t0]
        with torch.no_grad():  # a copy off the graph; cheaper than detaching every slice
            if target.is_contiguous():
                torch.stack(slices, out=target.view(-1, *target.shape[2:]))
            else:
                target.copy_(torch.stack(slices).view(target.shape))
        return self.buffer


def scatter(sink: BlockSink, stream_id: str, layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
            layers: tuple[int, int], tokens: tuple[int, int], staging: StagingBuffer | None = None) -> list[BlockKey]:
    """Flush positions `tokens` of layers `layers` (whose (keys, values) are `layer_kv`, whole caches or
    just those positions, as a decode step produces them) to `sink`.

    With `staging`: one block over all the layers. Without: one block per layer, each its own copy.
    """
    if len(layer_kv) != layers[1] - layers[0]:
        raise ConfigError(f"layers {layers} need {layers[1] - layers[0]} (keys, values) pairs, got {len(layer_kv)}")
    if staging is not None:
        key = BlockKey(stream_id, layers=layers, tokens=tokens)
        sink.flush(key, staging.fill(layer_kv, tokens))
        return [key]
    flushed = []
    for offset, (keys, values) in enumerate(layer_kv):
        key = BlockKey(stream_id, layers=(layers[0] + offset, layers[0] + offset + 1), tokens=tokens)
        sink.flush(key, torch.stack((_positions(keys, tokens), _positions(values, tokens))).unsqueeze(0))
        flushed.append(key)
    return flushed


def _positions(states: torch.Tensor, tokens: tuple[int, int]) -> torch.Tensor:
    """Positions `tokens` of `[B, H_kv, S, D]`: a whole cache is sliced, a delta of that length taken as is."""
    return states if states.shape[2] == tokens[1] - tokens[0] else states[:, :, tokens[0]:tokens[1]]


def check_tiling(keys: Iterable[BlockKey], layers: tuple[int, int], tokens: tuple[int, int]) -> list[BlockKey]:
    """The keys, if they cover layers x tokens exactly once (no gap, no overlap, nothing outside)."""
    keys = sorted(keys)
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for key in keys:
        if key.layers[0] < layers[0] or key.layers[1] > layers[1] or key.tokens[0] < tokens[0] \
                or key.tokens[1] > tokens[1]:
            raise ConfigError(f"{key} lies outside layers {layers} x positions {tokens}")
        for layer in range(*key.layers):
            covered[layer].append(key.tokens)
    for layer in range(*layers):
        position = tokens[0]
        for start, stop in sorted(covered.get(layer, [])):
            if start != position:
                problem = "overlap" if start < position else "gap"
                raise ConfigError(f"blocks of layer {layer} leave a {problem} at position {min(start, position)}")
            position = stop
        if position != tokens[1]:
            raise ConfigError(f"blocks of layer {layer} stop at position {position}, short of {tokens[1]}")
    return keys


def gather(source: BlockSource, keys: Iterable[BlockKey], spec: KVSpec, tokens: int,
           layers: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild layers x positions [0, tokens) of a cache from blocks that tile it exactly.

    Returns (or fills) `[layers, 2, B, H_kv, tokens, D]`; each block is fetched straight into its place
    when that place is contiguous, else through a temporary.
    """
    layers = layers or (0, spec.layers)
    keys = check_tiling(keys, layers, (0, tokens))
    shape = spec.shape(layers[1] - layers[0], tokens)
    if out is None:
        out = torch.empty(shape, dtype=spec.torch_dtype)
    elif tuple(out.shape) != shape or out.dtype != spec.torch_dtype:
        raise ConfigError(f"out is {out.dtype} {tuple(out.shape)}, the cache is {spec.torch_dtype} {shape}")
    for key in keys:
        place = out[key.layers[0] - layers[0]:key.layers[1] - layers[0], :, :, :, key.tokens[0]:key.tokens[1]]
        if place.is_contiguous():
            source.fetch(key, out=place)
        else:
            place.copy_(source.fetch(key))
    return out


@attrs.frozen
class Piece:
    """Layers `layers` (global indices) of the block `key`, bound for one stage of another partition."""

    key: BlockKey
    layers: tuple[int, int]
    stage: int


def plan_stream_out(keys: Iterable[BlockKey], destination: LayerPartition) -> list[Piece]:
    """Cut each block at the destination's stage boundaries: which layers of which block go to which stage."""
    pieces = []
    for key in sorted(keys):
        if key.layers[1] > destination.layers:
            raise ConfigError(f"{key} reaches layer {key.layers[1]}; the destination has {destination.layers}")
        for stage, (start, stop) in enumerate(destination.stages):
            low, high = max(start, key.layers[0]), min(stop, key.layers[1])
            if low < high:
                pieces.append(Piece(key, (low, high), stage))
    return pieces


def stream_out(source: BlockSource, keys: Iterable[BlockKey],
               destination: LayerPartition) -> Iterator[tuple[int, BlockKey, torch.Tensor]]:
    """Fetch each block once and yield (stage, key of the piece, piece) for every destination stage it feeds."""
    fetched: dict[BlockKey, torch.Tensor] = {}
    for piece in plan_stream_out(keys, destination):
        if piece.key not in fetched:
            fetched.clear()  # pieces of one block come together: keep one block in memory at a time
            fetched[piece.key] = source.fetch(piece.key)
        block = fetched[piece.key]
        offset = piece.layers[0] - piece.key.layers[0]
        part = block[offset:offset + piece.layers[1] - piece.layers[0]]
        yield piece.stage, attrs.evolve(piece.key, layers=piece.layers), part  # same stream, run and positions


def stream_in(pieces: Iterable[tuple[BlockKey, torch.Tensor]],
              stage_layers: tuple[int, int]) -> list[tuple[BlockKey, torch.Tensor]]:
    """Merge the pieces one stage received into one block per position range over all of its layers."""
    by_block: dict[tuple[str, str, tuple[int, int]], list[tuple[BlockKey, torch.Tensor]]] = defaultdict(list)
    for key, tensor in pieces:
        by_block[(key.stream_id, key.run, key.tokens)].append((key, tensor))
    merged = []
    for (_, _, tokens), parts in sorted(by_block.items()):
        parts.sort(key=lambda part: part[0].layers)
        check_tiling([key for key, _ in parts], stage_layers, tokens)
        key = attrs.evolve(parts[0][0], layers=stage_layers)  # same stream, run and positions
        merged.append((key, torch.cat([tensor for _, tensor in parts], dim=0)))
    return merged
