"""A stage's prompt prefixes in its slots (`worker.slots`): a group of one prompt starts from the chunks of its
layers that every stage holds, and once its prompt is in each stage keeps its own layers' chunks.

The first stage names the prompt's whole chunks (`PrefixIdentity.digests`, under the group's tenant salt), reads
its own layers' chunks, and starts the group's columns after them, telling the others the names and how many
positions it read (`GroupStart.digests`, `GroupStart.cached`). Each stage after it reads as many of its own. One
that finds fewer cannot compute the positions the stages before it read (they computed no hidden states for
them): it marks the round `missed` with the positions it found, the stages after it skip the group, and the last
stage tells the first (`SlotRound.restart`), where the group starts again from at most that many while every
stage drops what it ran of it. A chunk read is this stage's own KV of exactly those tokens after exactly those, as
computing them a chunk at a time made it, so the round records the group's prefill from column 0 with the chunk
as its step (`slots.Round`), and `replay` computes them so.

A group reads nothing when it has several rows (left-padded: its chunk boundaries are not its rows' positions),
was prefilled by a prompt pipeline, or asks for its prompt's log-probabilities (positions read have no logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...generation.row_specs import RowSpecs
from ...generation.slots import Joining
from ...prefix.reuse import PrefixReuse, fill
from ..wire.messages import Enter, GroupStart
from .state import SlotState, WorkerState


class SlotPrefixes:
    """A stage's prompt prefixes in its slots: a part of its `StageWorker`, on the worker's state (`worker`)."""

    def __init__(self, worker: WorkerState) -> None:
        self.worker = worker

    def start_first(self, state: SlotState, enter: Enter, joining: Joining) -> GroupStart | None:
        """The first stage starts `enter`'s group (`joining`): from the chunks it finds, when it reads them; what the
        other stages need of it then (None: it reads nothing)."""
        prefixes, worker = self.worker.prefixes, self.worker
        state.digests, state.starting, cap, state.read_cap = (), enter, state.read_cap, None
        if prefixes is None or not worker.policy.refills or not reads(prefixes, joining.members, enter.group.specs):
            return None
        state.digests = start_first(prefixes, joining, enter.salt, cap)
        return GroupStart(enter.group.specs, None, state.digests, joining.cached)

    def start_other(self, state: SlotState, members: Sequence[int], starting: GroupStart,
                    mask: torch.Tensor) -> int | None:
        """A stage after the first starts the group (its `mask` came with its first columns) from the chunks the
        stages before it read; the positions it found where it found fewer (the group is not started here)."""
        prefixes, worker = self.worker.prefixes, self.worker
        state.joining = Joining(list(members), mask.clone(), worker.stage.new_cache())
        state.digests = starting.digests
        found = start_other(prefixes, state.joining, starting.digests, starting.cached) \
            if prefixes is not None and starting.cached else 0
        if found >= starting.cached:
            return None
        state.joining, state.digests = None, ()
        return found

    def keep(self, state: SlotState, joining: Joining) -> None:
        """The group's prompt is in: keep this stage's chunks of it that it did not read."""
        if state.digests and self.worker.prefixes is not None:
            keep(self.worker.prefixes, joining, state.digests)
        state.digests = ()

    def start_again(self, number: int, state: SlotState, most: int) -> None:
        """A stage found fewer of the chunks of the group that started last round than the stages before it read:
        every stage drops what it ran of the group, and the first queues it again first, to read at most `most`
        positions."""
        if state.ready is not None and state.ready[0] is not None:  # its prompt was in here already
            state.ready = None
        state.joining, state.digests = None, ()
        self.worker.caches.pin(("group", number), None)
        if self.worker.stage.first and state.starting is not None:
            state.queued.appendleft(state.starting)
            state.read_cap = most


def reads(prefixes: PrefixReuse | None, members: Sequence[int], specs: RowSpecs) -> bool:
    """Whether a group of `members` with `specs` reads and keeps prompt prefixes here."""
    return prefixes is not None and len(members) == 1 and \
        not any(decoding.get("prompt_logprobs") is not None for decoding in specs.decoding)


def start_first(prefixes: PrefixReuse, joining: Joining, salt: str, cap: int | None) -> tuple[str, ...]:
    """The first stage: name the group's prompt chunks, and start `joining` from those of its own it finds (at most
    `cap` positions, after a stage found fewer); the names."""
    assert joining.ids is not None  # the first stage keeps them
    digests = tuple(prefixes.identity.digests(joining.ids[0].tolist(), salt))
    most = prefixes.most_read(joining.mask.shape[1])
    if cap is not None:
        most = min(most, cap // prefixes.chunk)
    _start(prefixes, joining, digests[:most])
    return digests


def start_other(prefixes: PrefixReuse, joining: Joining, digests: Sequence[str], cached: int) -> int:
    """A stage after the first: start `joining` from its own chunks of the `cached` positions the stages before it
    read; the positions it found (fewer than `cached`: a miss, and `joining` is not to run)."""
    return _start(prefixes, joining, digests[:cached // prefixes.chunk])


def keep(prefixes: PrefixReuse, joining: Joining, digests: Sequence[str]) -> None:
    """The group's prompt is in: keep this stage's chunks of it past those it read (on the writer thread)."""
    assert joining.cache is not None  # it ran its last columns
    prefixes.keep_row(digests, joining.cache, 0, joining.cached)


def _start(prefixes: PrefixReuse, joining: Joining, digests: Sequence[str]) -> int:
    """Fill the group's empty cache with the leading chunks of `digests` found, and start its columns after them."""
    blocks = prefixes.read(digests) if digests else []
    if blocks:
        assert joining.cache is not None  # a new group's own
        joining.done = joining.cached = fill(joining.cache, [blocks], joining.mask.device)
    return joining.cached

