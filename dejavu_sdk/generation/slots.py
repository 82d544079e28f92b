"""Continuous batching's slot: a microbatch whose rows come and go between steps.

A slot's rows share one KV cache, left-padded: each row's positions sit at the right of the cache and its
mask is 0 over its padding. A sliding-window layer holds only the cache's last positions (its window), and
counts every column: since every row ends at the cache's right edge, its last columns are each row's last
positions, and its window is each row's own. A slot lives in rounds, and each round runs, in this order:
1. `left`: rows that ended at the round before leave; their rows of the cache, mask and positions go, and so
   do the leading columns that are padding for every row still there (the cache is compacted);
2. `joined`: a group of requests whose prompts were prefilled together (left-padded to each other) and
   whose first tokens were picked at the round before is stacked under the slot's rows, the shorter of the
   two caches left-padded to the longer;
3. `decoded`: every row takes one decode step;
4. `prefill`: columns [start, stop) of a joining group's prompts run into the group's own cache, at most
   `max_prefill_tokens` positions (rows x columns) a round, whether rows decode beside it or not (a long prompt
   holds its stage for one chunk at a time); after its last columns the group's first tokens are picked, and it
   joins at the next round.

The rounds of a slot are its `Round`s, the schedule: replaying them through the model in one process
(`replay.replay`) gives every row's tokens exactly, since the stages of a pipeline compute what the whole model
computes on the same inputs. A row alone in its slot all its life, its prompt run in one round, is
`model.generate` on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from ..errors import ConfigError
from .stage import position_ids


@attrs.frozen
class Round:
    """One round of a slot (the module's order): the requests whose rows `left`, the group that `joined`, the
    requests `decoded` (the slot's rows, in order), and the joining group's `prefill`: its requests and the
    columns [start, stop) of their left-padded prompts run this round. A group that a prompt pipeline prefilled
    joins with all its columns in one round, which that pipeline ran `chunk` columns a step (0: in one step); a
    group whose first `cached` columns were read from a prefix cache of `chunk`-position chunks has them in its first
    round's prefill (from column 0), as they were computed: `chunk` columns a step.

    Members of a prefill that go on from a slot lost before their end (recovery without a replica of it) are
    `resumed` with the tokens they had: their prompts are their own followed by those. A result's schedule holds
    the rounds of every slot its request ran in, each lost one closed by a round that is only `lost`: there the
    slot's rows and cache are gone, and the rounds after it are another slot's from its start."""

    left: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    decoded: tuple[int, ...] = ()
    prefill: tuple[tuple[int, ...], int, int] | None = None
    chunk: int = 0
    resumed: tuple[tuple[int, tuple[int, ...]], ...] = ()
    lost: bool = False
    cached: int = 0

    def prefill_steps(self) -> list[tuple[int, int]]:
        """The columns [start, stop) of `prefill` that ran in a step each."""
        if self.prefill is None:
            return []
        _, start, stop = self.prefill
        width = self.chunk or stop - start
        return [(column, min(stop, column + width)) for column in range(start, stop, max(1, width))]


@attrs.define
class SlotRows:
    """What a stage keeps of a slot's rows beside its cache: each row's request number (`members`), the mask over
    the cache's positions `[rows, length]` (0 at padding) and each row's last position `[rows, 1]`."""

    members: list[int] = attrs.field(factory=list)
    mask: torch.Tensor = attrs.field(factory=lambda: torch.zeros((0, 0), dtype=torch.long))
    positions: torch.Tensor = attrs.field(factory=lambda: torch.zeros((0, 1), dtype=torch.long))

    def next_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask and positions of a decode step (one more position per row), now kept."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.mask), 1)], dim=1)
        self.positions = self.positions + 1
        return self.mask, self.positions


def leave(cache: DynamicCache, rows: SlotRows, leaving: Sequence[int]) -> SlotRows:
    """Drop the rows of the requests `leaving` from the cache (in place) and the rows, then the leading columns
    that are padding for every row kept."""
    if not leaving:
        return rows
    gone = set(leaving)
    keep = [row for row, member in enumerate(rows.members) if member not in gone]
    mask = rows.mask[keep]
    trim = int((mask == 0).all(0).long().cumprod(0).sum()) if keep else mask.shape[1]
    index = torch.tensor(keep, dtype=torch.long)
    for layer in kv_layers(cache):
        start = trim
        if getattr(layer, "is_sliding", False):  # it holds the last positions only, and counts them all
            layer.cumulative_length -= trim
            start = max(0, layer.keys.shape[2] - layer.cumulative_length)
        layer.keys = layer.keys[index.to(layer.keys.device), :, start:].contiguous()
        layer.values = layer.values[index.to(layer.values.device), :, start:].contiguous()
    return SlotRows([rows.members[row] for row in keep], mask[:, trim:].contiguous(), rows.positions[keep])


def stack(cache: DynamicCache, rows: SlotRows, group: DynamicCache, group_rows: SlotRows) -> SlotRows:
    """Stack a prefilled group's cache under the slot's rows (in place), the shorter left-padded to the longer
    with zeros (masked out)."""
    if not rows.members:
        for layer, joining in zip(kv_layers(cache), kv_layers(group), strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(joining.keys, joining.values)
            layer.keys, layer.values = joining.keys, joining.values
            if getattr(layer, "is_sliding", False):
                layer.cumulative_length = joining.cumulative_length
        return SlotRows(list(group_rows.members), group_rows.mask, group_rows.positions)
    length = max(rows.mask.shape[1], group_rows.mask.shape[1])
    for layer, joining in zip(kv_layers(cache), kv_layers(group), strict=True):
        # A sliding-window layer holds each side's last positions (at most its window): both are right-aligned
        # with the mask's columns, so left-padding them to the longer keeps every row's window exact.
        held = max(layer.keys.shape[2], joining.keys.shape[2]) if getattr(layer, "is_sliding", False) else length
        layer.keys = torch.cat([_left_pad(layer.keys, held), _left_pad(joining.keys, held)])
        layer.values = torch.cat([_left_pad(layer.values, held), _left_pad(joining.values, held)])
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = length
    mask = torch.cat([_left_pad(rows.mask, length), _left_pad(group_rows.mask, length)])
    return SlotRows([*rows.members, *group_rows.members], mask, torch.cat([rows.positions, group_rows.positions]))


@attrs.define
class Joining:
    """A group of requests prefilled together, a chunk of columns per round, before it joins a slot: its
    requests (`members`), their prompts' mask `[rows, P]` (left-padded to each other), its own cache, and the
    columns run so far (`done`). The first stage also keeps the prompts' ids (`ids`). A static slot's group has
    the slot's cache as its own: between rounds that cache is the slot's to swap, and the group keeps none
    (`cache` None: a reference would keep a swapped-out cache on the device). `cached`: the leading columns read
    from a prefix cache into its cache before its first round (its `done` then starts there)."""

    members: list[int]
    mask: torch.Tensor
    cache: DynamicCache | None
    ids: torch.Tensor | None = None
    done: int = 0
    cached: int = 0

    @property
    def complete(self) -> bool:
        return self.done >= self.mask.shape[1]

    def columns(self, max_prefill_tokens: int | None) -> tuple[int, int]:
        """The columns to run next: as many as `max_prefill_tokens` positions allow (one at least), whether rows
        decode beside them or not, so that no round holds a stage for long; all that are left without a budget."""
        width = self.mask.shape[1]
        if max_prefill_tokens is None:
            return self.done, width
        return self.done, min(width, self.done + max(1, max_prefill_tokens // len(self.members)))

    def run(self, forward: Callable[..., torch.Tensor], inputs: torch.Tensor, start: int,
            stop: int) -> torch.Tensor:
        """Run columns [start, stop) through `forward(inputs, mask, positions, cache)` (a stage's, or the whole
        model's); `inputs` are those columns' ids or hidden states."""
        if start != self.done:
            raise ConfigError(f"a joining group has run {self.done} columns; columns from {start} were asked for")
        positions = position_ids(self.mask)[:, start:stop]
        if self.cache is None:
            raise ConfigError("a held group's columns ran without its slot's cache")
        output = forward(inputs, self.mask[:, :stop], positions, self.cache)
        self.done = stop
        return output

    def rows(self) -> SlotRows:
        """The group's rows once its prompts are in: to be stacked under a slot's."""
        return SlotRows(list(self.members), self.mask, position_ids(self.mask)[:, -1:])


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """`tensor` (rows first; positions along dim 2 for KV `[B, H, L, D]`, dim 1 for a mask `[B, L]`) with zeros
    before its positions up to `length`."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def kv_layers(cache: DynamicCache) -> list[Any]:
    """A cache's layers, each with its `keys` and `values` (continuous batching takes only such caches)."""
    return list(cache.layers)


#: A sliding-window layer's keys, values and position count, as they stood before a round (`windows`).
WindowState = tuple[torch.Tensor, torch.Tensor, int] | None


def windows(cache: DynamicCache | None) -> list[WindowState]:
    """Each sliding-window layer's state now (None for the other layers): what `take_back` restores. A round's
    update lets go of the positions its new ones push out of the window, so taking the round back needs the
    tensors as they were; the update makes new ones, so keeping these references copies nothing."""
    if cache is None:
        return []
    return [(layer.keys, layer.values, layer.cumulative_length) if getattr(layer, "is_sliding", False) else None
            for layer in kv_layers(cache)]


def take_back(cache: DynamicCache, keep: int, before: Sequence[WindowState]) -> None:
    """Take the cache back to its first `keep` positions (in place), those of a round ago: a full-attention layer
    drops the later ones, a sliding-window layer returns to its state `before` the round (`windows`)."""
    for index, layer in enumerate(kv_layers(cache)):
        if getattr(layer, "is_sliding", False):
            state = before[index] if index < len(before) else None
            if state is None:
                raise ConfigError("a sliding-window layer cannot be taken back without its state before the round")
            layer.keys, layer.values, layer.cumulative_length = state
        else:
            layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]


def held_columns(layer: Any, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns [start, stop) of a cache layer's keys and values; a sliding-window layer holds only its last
    positions, and gives zeros for those it has let go (nothing reads them: a window that needs them again
    never comes back)."""
    if not getattr(layer, "is_sliding", False):
        return layer.keys[:, :, start:stop], layer.values[:, :, start:stop]
    offset = layer.cumulative_length - layer.keys.shape[2]  # the column its first held position is
    first = max(start, offset)
    keys, values = layer.keys[:, :, first - offset:stop - offset], layer.values[:, :, first - offset:stop - offset]
    return _left_pad(keys, stop - start), _left_pad(values, stop - start)
