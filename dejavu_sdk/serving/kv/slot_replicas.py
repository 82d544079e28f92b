"""Replicas of continuous batching's slots: what a decoding stage streams of a slot, and how the slot's cache is
rebuilt from it at a round boundary.

A slot's cache does not only grow, as a static microbatch's does: rows leave (their rows of the cache go, and so
do leading columns that were padding for every row left), and groups join (stacked under the rows, the shorter
left-padded with zeros). But each row's KV is only ever appended to, and every change keeps a row's columns in
order. So a decoding stage replicates, per slot, pieces that only grow:
- `group{g}`: the prompt columns of the group whose prefill began at round g, a block per chunk as it runs
  (disaggregated: the KV the prompt pipeline staged for it, at once);
- `segment{s}`: the decode columns of the rows the slot holds from round s on, until its rows change again;
- `base{b}`: the whole cache as it stood when a recovery rewound the slot to round b.
Each write is done before the stage passes its round on, so every round the head has heard of is in every
stage's replica, and a recovery goes on from right after the last of them.

Which column of which piece each position of the cache holds at a round follows from the schedule alone:
`trace` replays the rounds on stand-in caches whose values name their source, with the same `leave` and
`stack` that the stages run, and `gather` fills a cache from the pieces by the index it gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from ...blocks import BlockKey
from ...errors import DejaVuError, ReplicationError
from ...generation.slots import Joining, Round, SlotRows, held_columns, kv_layers, leave, stack
from .replication import Replicator, replica_stream

#: A stand-in cache value is 1 + source * _SOURCE + row * _ROW + column (0: padding), exact in float64.
_SOURCE, _ROW = 1 << 40, 1 << 20


def piece_stream(stage: int, slot: int, piece: str, prefix: str = "") -> str:
    """The stream under which decoding stage `stage` replicates `piece` of slot `slot`."""
    return f"{replica_stream(stage, slot, prefix)}-{piece}"


@attrs.frozen
class Piece:
    """A piece of a slot's replica (`name`: `group{g}`, `segment{s}` or `base{b}`), with its rows and the columns
    a rebuild reads from it (0: none, its rows have all left)."""

    name: str
    rows: int
    columns: int


@attrs.frozen
class JoiningAt:
    """A group part-way through its prompts at a round: its members, prompts' mask, the columns run (`done`) and
    the round its prefill began (its piece is `group{started}`)."""

    members: tuple[int, ...]
    mask: torch.Tensor
    done: int
    started: int

    @property
    def piece(self) -> str:
        return f"group{self.started}"


@attrs.frozen
class SlotBase:
    """Where a slot's replica starts over after a recovery: round `round`, its rows then (their change at that
    round applied), and the group joining then."""

    round: int
    rows: SlotRows
    joining: JoiningAt | None


@attrs.frozen
class SlotTrace:
    """A slot at a round boundary: its rows, for each of their cache positions the piece column it holds
    (`index` `[rows, length]`: 0 for padding, else 1 + source * 2**40 + row * 2**20 + column, the source
    being a position in `pieces`), the pieces read, the group joining then, and the groups whose prefill had
    begun (by members)."""

    rows: SlotRows
    index: torch.Tensor
    pieces: list[Piece]
    joining: JoiningAt | None
    started: set[tuple[int, ...]]


def trace(rounds: Sequence[Round], change: tuple[Sequence[int], Sequence[int] | None],
          mask_of: Callable[[tuple[int, ...]], torch.Tensor], base: SlotBase | None = None) -> SlotTrace:
    """The slot after `rounds` and the row `change` (left, joined) that the next round opens with; `mask_of`
    gives a group's prompts' mask by its members, `base` where the replica started over (rounds before it
    are not read)."""
    pieces: list[list[Any]] = []  # name, rows, columns

    def piece(name: str, rows: int, columns: int = 0) -> int:
        pieces.append([name, rows, columns])
        return len(pieces) - 1

    cache = _stand_in_cache(torch.zeros((0, 1, 0, 1), dtype=torch.float64))
    rows, joining, ready = SlotRows(), None, None
    started: set[tuple[int, ...]] = set()
    segment = -1
    first = 0
    if base is not None:
        first = base.round
        rows = SlotRows(list(base.rows.members), base.rows.mask.clone(), base.rows.positions.clone())
        if rows.members:
            source = piece(f"base{base.round}", len(rows.members), rows.mask.shape[1])
            _set(cache, _stand_in(source, len(rows.members), 0, rows.mask.shape[1]))
        if base.joining is not None:
            joining = (base.joining, piece(base.joining.piece, len(base.joining.members), base.joining.done))
            started.add(base.joining.members)
    for number in range(first, len(rounds)):
        step = rounds[number]
        fresh = base is not None and number == base.round
        if not fresh:
            rows, ready = _change(cache, rows, ready, step.left, step.joined or None)
        if fresh or step.left or step.joined:
            segment = piece(f"segment{number}", len(rows.members))
        if step.decoded:
            if list(step.decoded) != rows.members:
                raise DejaVuError(f"round {number} decodes {list(step.decoded)}; the slot holds {rows.members}")
            layer = kv_layers(cache)[0]
            column = _stand_in(segment, len(rows.members), pieces[segment][2], 1)
            layer.keys = layer.values = torch.cat([layer.keys, column], dim=2)
            pieces[segment][2] += 1
            rows.next_step()
        if step.prefill is not None:
            members, start, stop = step.prefill
            if start == 0:
                joining = (JoiningAt(members, mask_of(members), 0, number), piece(f"group{number}", len(members)))
                started.add(members)
            if joining is None or joining[0].members != members:
                raise DejaVuError(f"round {number} prefills {list(members)}, which no round started")
            at, source = joining
            pieces[source][2] = stop
            joining = (attrs.evolve(at, done=stop), source)
            if stop >= at.mask.shape[1]:
                group = _stand_in_cache(_stand_in(source, len(members), 0, stop))
                ready, joining = (group, Joining(list(members), at.mask, group).rows()), None
    if base is None or len(rounds) > base.round:
        left, joined = change
        rows, ready = _change(cache, rows, ready, left, joined)
    index = kv_layers(cache)[0].keys[:, 0, :, 0].round().long()
    read = set(((index[index > 0] - 1) // _SOURCE).unique().tolist()) | ({joining[1]} if joining else set())
    for source, fields in enumerate(pieces):
        if source not in read:
            fields[2] = 0  # not read: left or joined pieces whose rows have all gone
    return SlotTrace(rows, index, [Piece(*fields) for fields in pieces], None if joining is None else joining[0],
                     started)


def gather(index: torch.Tensor, pieces: Sequence[Piece], blocks: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The slot's cache `[layers, 2, rows, kv heads, length, head dim]` that `index` describes (`trace`), from the
    pieces' blocks `[layers, 2, rows, kv heads, columns, head dim]` by name; None for a slot without rows."""
    if index.numel() == 0:
        return None
    used = {int(source) for source in ((index[index > 0] - 1) // _SOURCE).unique().tolist()}
    sample = blocks[pieces[min(used)].name]
    layers, _, _, heads, _, width = sample.shape
    out = sample.new_zeros((layers, 2, index.shape[0], heads, index.shape[1], width))
    flat = index - 1
    for source in sorted(used):
        at = (index > 0) & (flat // _SOURCE == source)
        row_at, column_at = at.nonzero(as_tuple=True)
        local = flat[row_at, column_at] - source * _SOURCE
        block = blocks[pieces[source].name]
        out[:, :, row_at, :, column_at, :] = block[:, :, local // _ROW, :, local % _ROW, :]
    return out


def kv_block(cache: Any, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of every layer of `cache`, as one block `[layers, 2, rows, kv heads, columns, dim]`
    (zeros where a sliding-window layer has let them go)."""
    return torch.stack([torch.stack(held_columns(layer, start, stop)) for layer in kv_layers(cache)]).contiguous()


@attrs.define
class SlotPieces:
    """What a stage has written of one slot's replica: each piece with the members whose columns it holds, the
    piece that decode columns go to now (`segment`) and how many it has, and the joining group's piece."""

    pieces: dict[str, set[int]] = attrs.field(factory=dict)
    segment: str | None = None
    decodes: int = 0


class SlotReplicas:
    """A decoding stage's writer of its slots' replicas, through the stage's `Replicator` (its holder, stage
    number, layers and prefix); every write is done when it returns."""

    def __init__(self, replicator: Replicator) -> None:
        self.replicator = replicator

    def write(self, slot: int, pieces: SlotPieces, name: str, members: Iterable[int], block: torch.Tensor,
              first: int) -> None:
        """Add `block`'s columns to piece `name` from column `first` on."""
        pieces.pieces.setdefault(name, set()).update(members)
        replicator = self.replicator
        key = BlockKey(piece_stream(replicator.stage, slot, name, replicator.prefix), layers=(0, replicator.layers),
                       tokens=(first, first + block.shape[4]))
        try:
            replicator.holder.flush(key, block)
        except DejaVuError as error:
            raise ReplicationError(f"replicating {key} failed: {error}") from error

    def new_segment(self, pieces: SlotPieces, round_number: int, members: Sequence[int]) -> None:
        """The slot's rows changed at round `round_number`: decode columns go to a new piece from now on."""
        pieces.segment, pieces.decodes = f"segment{round_number}", 0
        pieces.pieces.setdefault(pieces.segment, set()).update(members)

    def decoded(self, slot: int, pieces: SlotPieces, members: Sequence[int], cache: Any) -> None:
        """The column a decode step just added to every row."""
        assert pieces.segment is not None  # a segment begins at the round the slot's first rows join
        length = cache.get_seq_length()
        self.write(slot, pieces, pieces.segment, members, kv_block(cache, length - 1, length), pieces.decodes)
        pieces.decodes += 1

    def collect(self, slot: int, pieces: SlotPieces, present: set[int]) -> None:
        """Delete the pieces that no row the slot holds or takes in reads any more."""
        for name, members in list(pieces.pieces.items()):
            if not members & present and name != pieces.segment:
                self._delete(slot, name)
                del pieces.pieces[name]

    def rebase(self, slot: int, pieces: SlotPieces, round_number: int, cache: Any, rows: SlotRows,
               joining: Joining | None, started: int | None) -> None:
        """Start the slot's replica over from where a recovery left it at round `round_number`: every piece
        written before goes (a replaced stage's included), the cache is written whole, and so is what the joining
        group (whose prefill began at round `started`) has run."""
        replicator = self.replicator
        stem = piece_stream(replicator.stage, slot, "", replicator.prefix)
        try:
            streams = {key.stream_id for key in replicator.holder.keys(None) if key.stream_id.startswith(stem)}
        except DejaVuError as error:
            raise ReplicationError(f"listing the replica of slot {slot} failed: {error}") from error
        for stream in streams:
            self._delete_stream(stream)
        pieces.pieces.clear()
        if rows.members:
            length = rows.mask.shape[1]
            self.write(slot, pieces, f"base{round_number}", rows.members, kv_block(cache, 0, length), 0)
        self.new_segment(pieces, round_number, rows.members)
        if joining is not None and started is not None and joining.done:
            name = f"group{started}"
            self.write(slot, pieces, name, joining.members, kv_block(joining.cache, 0, joining.done), 0)

    def end(self, slot: int, pieces: SlotPieces) -> None:
        """The slot ended (or failed): delete every piece of its replica; a holder gone takes them with it."""
        for name in pieces.pieces:
            with contextlib.suppress(ReplicationError):
                self._delete(slot, name)
        pieces.pieces.clear()

    def _delete(self, slot: int, name: str) -> None:
        replicator = self.replicator
        self._delete_stream(piece_stream(replicator.stage, slot, name, replicator.prefix))

    def _delete_stream(self, stream: str) -> None:
        try:
            self.replicator.holder.delete(stream)
        except DejaVuError as error:
            raise ReplicationError(f"deleting the replica {stream} failed: {error}") from error


def _change(cache: DynamicCache, rows: SlotRows, ready: tuple[DynamicCache, SlotRows] | None, left: Sequence[int],
            joined: Sequence[int] | None) -> tuple[SlotRows, tuple[DynamicCache, SlotRows] | None]:
    """A round's row change on stand-ins, as a stage makes it (`worker.slots.SlotHandlers.change_rows`)."""
    rows = leave(cache, rows, list(left))
    if joined is None:
        return rows, ready
    if not joined or ready is None:
        return rows, None
    group, group_rows = ready
    gone = [member for member in group_rows.members if member not in set(joined)]
    return stack(cache, rows, group, leave(group, group_rows, gone)), None


def _stand_in(source: int, rows: int, first: int, columns: int) -> torch.Tensor:
    """Stand-in KV `[rows, 1, columns, 1]` naming columns [first, first + columns) of each row of `source`."""
    row = torch.arange(rows, dtype=torch.float64)[:, None] * _ROW
    column = torch.arange(first, first + columns, dtype=torch.float64)[None, :]
    return (1 + source * _SOURCE + row + column)[:, None, :, None]


def _stand_in_cache(values: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    cache.update(values, values, 0)
    return cache


def _set(cache: DynamicCache, values: torch.Tensor) -> None:
    layer = kv_layers(cache)[0]
    layer.keys = layer.values = values
