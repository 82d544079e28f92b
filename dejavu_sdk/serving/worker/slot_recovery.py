"""A stage worker's side of a slot's recovery: the `rewind` of a continuous pipeline's slot.

A recovery goes on with a slot from right after the last round the head heard of, with the row change that its
next round opens with (which rows left, which group joined) already made: the head's `RewindSlot` says which round
that is, the slot's rows then, and what the last stage needs of them. A stage gets there from what it holds:
- a stage that ran exactly those rounds makes the row change (as that next round would have);
- a stage that ran the next round too (its output went no further than the stage that died) takes back what
  that round added: the decode column, and the joining group's columns (a group that began then is dropped,
  and enters again);
- a replacement rebuilds the slot from its replica's pieces, restored to it (`slot_replicas.gather`), its last
  stage taking each row's generator state from the head.
Each checks that it reached the rows the head expects, then writes its replica anew from there (`rebase`), and
answers `Rewound` (with the error, when it cannot: that slot then fails, and the pipeline goes on).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ...errors import DejaVuError
from ...generation.picker import TokenPicker
from ...generation.slots import Joining, SlotRows, take_back
from ..kv.replication import cache_from
from ..kv.slot_replicas import gather
from ..wire.messages import GroupAt, RewindSlot, Rewound, pack
from .slots import SlotHandlers
from .state import SlotState


class SlotRewinds:
    """A stage's side of a slot's recovery (`RewindSlot`): a part of its `StageWorker`, on the worker's state
    and slot steps (`worker`)."""

    def __init__(self, worker: SlotHandlers) -> None:
        self.worker = worker

    def rewind_slot(self, message: RewindSlot) -> None:
        worker = self.worker
        number, error = message.microbatch, None
        try:
            self._rewind_slot_to(message)
        except (DejaVuError, ValueError, RuntimeError, KeyError) as failure:  # that slot fails, not the stage
            worker.forget(number)
            error = f"{worker.role.name} could not rewind slot {number}: {type(failure).__name__}: {failure}"
        worker.head.send_tensor(pack(Rewound(stage=worker.role.name, microbatch=number, epoch=worker.epoch,
                                             error=error)))

    def _rewind_slot_to(self, message: RewindSlot) -> None:
        worker = self.worker
        number, target = message.microbatch, message.round
        rows = SlotRows(list(message.members), message.mask.clone(), message.positions.clone())
        state = worker.slots.get(number)
        pieces = worker.restored_pieces.pop(number, None)
        rebuilt = pieces is not None or state is None
        if rebuilt:
            state, cache = self._rebuild_slot(rows, message, pieces or {})
        else:
            assert state is not None
            cache = worker.caches.acquire(number) if number in worker.caches else None
            if state.joining is not None and state.joining.cache is None:  # a static group held as the slot's cache
                state.joining.cache = cache
            if state.round == target + 1:
                cache = _take_back(state, cache)
            elif state.round == target:
                cache, _ = worker.change_rows(number, state, cache, message.left, message.joined)
            else:
                raise DejaVuError(f"it ran {state.round} rounds of the slot; the recovery goes on after {target}")
            if state.rows.members != rows.members or not torch.equal(state.rows.mask, rows.mask):
                raise DejaVuError(f"its rows {state.rows.members} are not the {rows.members} the head expects")
        if message.joining is not None and state.joining is not None and worker.stage.first:
            state.joining.ids = message.group_ids.clone()  # the first stage runs the rest of its prompts
        state.round, state.last, state.queued = target, None, deque()  # the head sends the groups again
        state.reports = None if rebuilt or state.reports is None else state.reports[:target]
        state.parked = message.parked and worker.stage.first
        state.finals = dict(message.finals)
        if rebuilt and worker.stage.last:
            self._rebuild_choices(state, message)
        elif worker.stage.last:  # cancels lost on their way during the failure
            state.cancelled.update(message.cancelled)
            state.ended |= torch.tensor([member in state.cancelled for member in state.rows.members], dtype=torch.bool)
        worker.slots[number] = state
        worker.caches.remove(number)
        if state.rows.members and cache is not None:
            worker.caches.new_cache(number, cache)
            worker.caches.add(number, worker.slot_capacity(state))
        worker.caches.pin(("group", number), state.joining.cache if state.joining is not None else None)
        if worker.replicator is not None:
            worker.slot_replicas().rebase(number, state.pieces, target, cache, state.rows, state.joining, state.started)

    def _rebuild_slot(self, rows: SlotRows, message: RewindSlot,
                      pieces: dict[str, torch.Tensor]) -> tuple[SlotState, Any]:
        """A replacement's slot, from the pieces of its replica restored to it."""
        worker = self.worker
        state = SlotState(rows=rows)
        block = gather(message.index, message.pieces, pieces)
        cache = None if block is None else cache_from(block, worker.stage.config)
        joining: GroupAt | None = message.joining
        if joining is not None:
            done, name = joining.done, f"group{joining.started}"
            config = worker.stage.config
            group = cache_from(pieces[name][:, :, :, :, :done], config) if done else worker.stage.new_cache()
            state.joining = Joining(list(joining.group.members), message.group_mask.clone(), group, done=done)
            state.started = joining.started
        return state, cache

    def _rebuild_choices(self, state: SlotState, message: RewindSlot) -> None:
        """A replaced last stage's choices of the rows' next tokens: their decodings and generators' states, their
        token counts and limits, and the requests cancelled."""
        worker = self.worker
        config = worker.stage.adapter.model.generation_config
        state.picker = TokenPicker(config, message.decodings)
        if message.states.numel():
            state.picker.set_states(message.states)
        state.cancelled = set(message.cancelled)
        state.ended = torch.tensor([member in state.cancelled for member in state.rows.members], dtype=torch.bool)
        state.counts = dict(message.counts)
        state.limits = dict(message.limits)
        if message.joining is not None:
            decodings = message.joining.group.specs.decoding
            state.joining_picker = TokenPicker(config, decodings)
            state.joining_decodings = list(decodings)  # its later chunks' prompt log-probabilities


def _take_back(state: SlotState, cache: Any) -> Any:
    """Take back what the slot's last round added on this stage (its row change stays): the decode column, and
    the joining group's columns (a group begun then is dropped)."""
    if state.last is None:
        raise DejaVuError("its last round picked tokens that the head never heard of")
    decoded, prefill = state.last
    slot_windows, group_windows = state.windows
    if decoded:
        take_back(cache, state.rows.mask.shape[1] - 1, slot_windows)
        state.rows = SlotRows(state.rows.members, state.rows.mask[:, :-1], state.rows.positions - 1)
    if prefill is not None:
        members, start, _ = prefill
        group = state.joining if state.joining is not None else None
        held = state.ready is not None and state.ready[0] is None  # a static group held as the slot's cache
        group_cache, group_mask = ((group.cache, group.mask) if group is not None else
                                   (cache if held else state.ready[0], state.ready[1].mask) if state.ready is not None
                                   else (None, None))
        state.ready, state.joining, state.joining_picker = None, None, state.joining_picker if start else None
        if start == 0:
            state.started = None
        else:
            assert group_cache is not None  # the group whose columns the round ran
            assert group_mask is not None
            take_back(group_cache, start, group_windows)
            state.joining = Joining(list(members), group_mask, group_cache, done=start)
    return cache
