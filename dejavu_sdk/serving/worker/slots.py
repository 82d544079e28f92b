"""A stage worker's side of continuous batching: slots whose rows come and go between rounds.

Under `batching="continuous"` a microbatch is a slot (`generation.slots`), and every stage runs its rounds in
the same order, so that each stage's part of the slot's cache changes as every other stage's does:
- `OpenSlot` from the head opens a slot on the first stage with its first group of requests; `Enter` adds a
  group to a slot the first stage holds (queued until the group before it has joined);
- a round's message (`SlotRound`) carries what changes before it (`left`: requests whose rows ended, `joined`:
  the group prefilled at the round before, less its rows that ended with their first token), the slot's
  next tokens, and the part of a joining group's prompts that the first stage chose to run (`prefill`,
  `max_prefill_tokens` positions while rows decode beside it, with the group's mask and settings at its
  first columns). Each stage drops, stacks, decodes and prefills, and passes the outputs on;
- the last stage picks each row's token and a finished group's first tokens, reports the round to the
  head (`RoundReport`, with the round's `Round`: the schedule, and the members of a group whose prompts
  are now in: `complete`), and sends the next round to the first stage;
- a round with nothing to run (no row decodes, no prompt to prefill) parks the slot on the first stage: it
  goes through the other stages (the rows that left are dropped there too) and the last stage reports it
  `idle` instead of starting another. The next group that enters the slot wakes it; the head, which alone
  knows whether a group is still on its way to the slot (from the waiting queue, or from the prompt
  pipeline), ends an idle slot that none is bound for (`End` through every stage, the last answering
  `Freed`). So a slot never ends under a group sent to it, whose prompt KV may be staged already.

Disaggregated, the prompt pipeline prefills each group as a microbatch of its own (as under static batching)
and its KV is staged on the token stages; the group's `Enter` (or the `OpenSlot`) carries its first tokens and
generators' states (`Staged`), and the first token stage takes it in whole at the first round after its KV is
all there (`_waits_for_kv`): every token stage builds its part of the group's cache from the staged KV instead
of computing it, and the last stage takes the first tokens as given.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import attrs
import torch

from ...generation.picker import TokenPicker
from ...generation.row_specs import RowSpecs
from ...generation.slots import Joining, SlotRows, leave, stack, windows
from ...generation.stage import position_ids
from ..kv.slot_replicas import kv_block
from ..wire.messages import Columns, End, Enter, Freed, GroupStart, OpenSlot, SlotRound
from .slot_cancels import SlotCancels
from .slot_picks import SlotPicks
from .slot_prefixes import SlotPrefixes
from .state import SlotState, WorkerState

log = logging.getLogger(__name__)

_EMPTY = torch.zeros(0)


class SlotHandlers(WorkerState):
    """The handlers of the slots' step messages; `StageWorker` inherits them. Its parts: the last stage's picks of
    a round (`picks`), the prompt prefixes a joining prompt reads and keeps (`prefix_reads`) and cancelled rows
    (`cancels`)."""

    @functools.cached_property
    def picks(self) -> SlotPicks:
        return SlotPicks(self)

    @functools.cached_property
    def prefix_reads(self) -> SlotPrefixes:
        return SlotPrefixes(self)

    @functools.cached_property
    def cancels(self) -> SlotCancels:
        return SlotCancels(self)

    def _open_slot(self, message: OpenSlot) -> None:
        """The first stage: a new slot, its first group entering at once (a round with nothing else in it)."""
        if not self._first_of_slots():
            self._unexpected(message)
        self.slots[message.microbatch] = SlotState(parked=True)
        self._enter(message)

    def _enter_group(self, message: Enter) -> None:
        if not self._first_of_slots():
            self._unexpected(message)
        self._enter(message)

    def _first_of_slots(self) -> bool:
        """Whether this stage is a continuous pipeline's first decoding stage, where groups enter slots."""
        return self.role.decodes and self.stage.first

    def _enter(self, message: Enter) -> None:
        """The first stage: a group for slot `microbatch`, run from its next round on (after any group before it); a
        parked slot starts that round now."""
        number = message.microbatch
        state = self.slots.get(number)
        if state is None:  # the slot failed meanwhile (the head fails its requests): nothing to enter
            log.warning("%s dropped a group for slot %d, which it does not hold", self.role.name, number)
            return
        state.queued.append(attrs.evolve(message, ids=message.ids.clone(), mask=message.mask.clone(),
                                         rng=message.rng.clone()))
        if state.parked:
            state.parked = False
            self._round(SlotRound(microbatch=number, left=[], joined=None, inputs=_EMPTY))

    def _end_slot(self, message: End) -> None:
        """The head ended the slot (idle, with no group bound for it): free it here and pass the word on; the
        last stage tells the head that every stage has."""
        number = message.microbatch
        state = self.slots.pop(number, None)
        self.caches.remove(number)
        self.caches.pin(("group", number), None)
        if state is not None and self.replicator is not None:
            self.slot_replicas().end(number, state.pieces)
        if self.stage.last:
            self.post(self.head, Freed(microbatch=number))
        else:
            self.post(self.following, message)

    # ---- a round --------------------------------------------------------------------------------------------
    def _round(self, message: SlotRound) -> None:
        """Run a round of slot `microbatch` on this stage: rows leave, a group joins, the rows decode, a group's
        prompts run; then pass it on (or, on the last stage, pick the tokens and start the next)."""
        number = message.microbatch
        state = self.slots.get(number)
        if state is None and not self.stage.first and message.starting is not None:
            state = self.slots[number] = SlotState()  # the slot's first round reaches this stage
        if state is None:
            return  # ended or dropped meanwhile
        if self._waits_for_kv(number, state, message):
            return
        index, state.round = state.round, state.round + 1
        if message.restart is not None:
            self.prefix_reads.start_again(number, state, message.restart)
        prefill, starting, missed = message.prefill, message.starting, message.missed
        prefill_in, group_mask, rng = message.prefill_inputs, message.group_mask, message.rng
        cache = self.caches.acquire(number) if number in self.caches else None
        if state.joining is not None and state.joining.cache is None:  # a static group: the slot's cache is its own
            state.joining.cache = cache
        if message.applied:  # a recovery made this round's row change already
            changed = False
        else:
            cache, changed = self.change_rows(number, state, cache, message.left, message.joined)
        decoded = list(state.rows.members)
        if self.stage.first:
            prefill, starting, prefill_in, group_mask, rng = self._next_columns(state)
        state.windows = (windows(cache), windows(state.joining.cache if state.joining is not None else None))
        decode_out = self._decode_rows(state, message.inputs, cache) if decoded else _EMPTY
        if self.stage.first and not decoded and prefill is None:
            state.parked = True  # nothing to run: the next group to enter wakes it
        ran = prefill if missed is None else None  # a stage before this one missed the group's chunks: skipped
        if ran is not None:
            if starting is not None:
                state.started = index
            prefill_out, missed = self._prefill_columns(number, state, ran, starting, prefill_in, group_mask, rng)
            group = state.joining if state.joining is not None else state.ready
            if self.policy.refills:  # on the device until it joins (static: its cache is the slot's, `_hold_group`)
                self.caches.pin(("group", number), None if group is None else group.cache
                                if isinstance(group, Joining) else group[0])
        else:
            prefill_out = _EMPTY
        state.last = (bool(decoded), ran if missed is None else None)
        if cache is not None:
            self._put_slot_back(number, state, cache, changed)
        if self.replicator is not None:  # before the round goes on: the head hears of no round not replicated
            self._replicate_round(number, state, index, message, cache)
        if not self.policy.refills:
            self._hold_group(number, state)
        onward = attrs.evolve(message, prefill=prefill, starting=starting, inputs=decode_out,
                              prefill_inputs=prefill_out, group_mask=group_mask, rng=rng, missed=missed)
        if not self.stage.last:
            self.post(self.following, onward)
            return
        self.picks.pick_round(number, state, onward, decoded, decode_out, prefill_out)

    def _replicate_round(self, number: int, state: SlotState, index: int, message: SlotRound, cache: Any) -> None:
        """Write what round `index` added to the slot's replica: a new segment when its rows changed, the decode
        column, the joining group's prompt columns; and delete the pieces no row reads any more."""
        writer, pieces = self.slot_replicas(), state.pieces
        if message.left or message.joined:
            writer.new_segment(pieces, index, state.rows.members)
        decoded, prefill = state.last or (False, None)
        if decoded:
            writer.decoded(number, pieces, state.rows.members, cache)
        if prefill is not None:
            members, start, stop = prefill
            group = state.joining.cache if state.joining is not None else state.ready[0] if state.ready else None
            assert group is not None  # the group whose columns just ran
            assert state.started is not None
            writer.write(number, pieces, f"group{state.started}", members, kv_block(group, start, stop), start)
        if message.left or message.joined is not None:  # rows left, or a group's rows ended with their first token
            present = {*state.rows.members, *(state.joining.members if state.joining is not None else ()),
                       *(state.ready[1].members if state.ready is not None else ())}
            writer.collect(number, pieces, present)

    def _hold_group(self, number: int, state: SlotState) -> None:
        """A static slot is empty while its group's prompts run, so the group's cache is the slot's from its first
        columns on (or from its arrival, prefilled by the prompt pipeline): held, and swapped, as every slot's is,
        so that a group prefilled over several rounds does not wait on the device beside the slots that step
        meanwhile. Between rounds the group keeps no reference to it (one would keep a swapped-out cache on the
        device); the next round gives it back."""
        group, ready = state.joining, state.ready
        if number not in self.caches:
            cache = group.cache if group is not None else ready[0] if ready is not None else None
            if cache is None:
                return
            self.caches.pin(("group", number), None)
            self.caches.new_cache(number, cache)
            self.caches.add(number, self.slot_capacity(state))
        if group is not None:
            group.cache = None
        if ready is not None:
            state.ready = (None, ready[1])

    def _waits_for_kv(self, number: int, state: SlotState, message: SlotRound) -> bool:
        """Disaggregated: whether this round must wait for a group's prompt KV still on its way from the prompt
        pipeline (it is kept, and run when the last piece comes). The first token stage starts a group only once
        its KV is here, unless the slot has nothing else to do; the others wait for the group it started."""
        if self.stage.first:
            head = state.queued[0] if state.queued and state.joining is None else None
            staged = head.staged if head is not None else None
            staying = set(state.rows.members) - set(message.left) or message.joined
            if staged is None or staying or self._staged(staged.number).complete:
                return False
        else:
            staged = message.starting.staged if message.starting is not None else None
            if staged is None or self._staged(staged.number).complete:
                return False
        self._staged(staged.number).start = message
        return True

    def change_rows(self, number: int, state: SlotState, cache: Any, left: list[int],
                joined: list[int] | None) -> tuple[Any, bool]:
        """Rows that ended leave; a prefilled group joins (its rows that ended with their first token left out).
        The slot's cache (made here for its first rows), and whether its rows changed."""
        if left and cache is not None:
            keep = [row for row, member in enumerate(state.rows.members) if member not in set(left)]
            state.rows = leave(cache, state.rows, left)
            if self.stage.last:
                assert state.picker is not None  # rows have decoded
                state.picker.keep(keep)
                state.ended = state.ended[keep]
            for member in left:
                state.finals.pop(member, None)
        ready, state.ready = (state.ready, None) if joined is not None else (None, state.ready)
        if joined is not None:
            self.caches.pin(("group", number), None)
        if not joined or ready is None:
            return cache, bool(left)
        group_cache, group_rows = ready
        if group_cache is None:  # a static group held as the slot's cache already (`_hold_ready_group`)
            group_cache = cache
        gone = [member for member in group_rows.members if member not in set(joined)]
        group_rows = leave(group_cache, group_rows, gone)
        for member in gone:
            state.finals.pop(member, None)
        if cache is None:  # the slot's first rows: its cache starts as theirs
            cache = self.stage.new_cache()
            state.rows = stack(cache, state.rows, group_cache, group_rows)
            self.caches.new_cache(number, cache)
            self.caches.add(number, self.slot_capacity(state))
            cache = self.caches.acquire(number)
        else:
            state.rows = stack(cache, state.rows, group_cache, group_rows)
        if self.stage.last:
            assert state.ready_picker is not None
            if state.picker is None or not len(state.ended):
                state.picker = state.ready_picker
            else:
                state.picker.extend(state.ready_picker)
            cancelled = torch.tensor([member in state.cancelled for member in joined], dtype=torch.bool)
            ended = cancelled if state.ready_ended is None else cancelled | state.ready_ended
            state.ended = torch.cat([state.ended, ended])
            state.ready_picker, state.ready_tokens, state.ready_ended = None, None, None
        return cache, True

    def _next_columns(self, state: SlotState) -> tuple[Columns | None, GroupStart | None, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
        """The first stage: which columns of which group run this round (starting the next queued group when none
        is joining), what the stages need of a group that starts, its ids, and at a group's start its mask (and,
        disaggregated, its generators' states)."""
        mask = rng = _EMPTY
        starting = None
        if state.joining is None and state.queued:
            enter = state.queued[0]
            staged = enter.staged
            if staged is not None and not self._staged(staged.number).complete:
                return None, None, _EMPTY, _EMPTY, _EMPTY  # its KV is on its way: a later round starts it
            state.queued.popleft()
            starting = GroupStart(enter.group.specs, staged)
            members = tuple(enter.group.members)
            if staged is not None:  # prefilled by the prompt pipeline: all its columns at once, computing nothing
                mask, rng = enter.mask.clone(), enter.rng.clone()
                return (members, 0, mask.shape[1]), starting, _EMPTY, mask, rng
            ids, mask = enter.ids.clone(), enter.mask.clone()
            state.joining = Joining(list(members), mask, self.stage.new_cache(), ids)
            starting = self.prefix_reads.start_first(state, enter, state.joining) or starting
        if state.joining is None:
            return None, None, _EMPTY, _EMPTY, _EMPTY
        start, stop = state.joining.columns(self.max_prefill_tokens)
        assert state.joining.ids is not None  # the first stage keeps them
        return (tuple(state.joining.members), start, stop), starting, state.joining.ids[:, start:stop], mask, rng

    def _decode_rows(self, state: SlotState, inputs: torch.Tensor, cache: Any) -> torch.Tensor:
        mask, positions = state.rows.next_step()
        return self.stage.forward(inputs, mask, positions, cache)

    def _prefill_columns(self, number: int, state: SlotState, prefill: Columns, starting: GroupStart | None,
                         inputs: torch.Tensor, group_mask: torch.Tensor,
                         rng: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """Run the round's `prefill` columns of the joining group's prompts (its first columns start it here, as
        `starting` says, from the prompt-prefix chunks the stages before read; a group the prompt pipeline
        prefilled takes the KV staged here instead), and keep the group ready once they are in. The output, and
        the positions found where this stage found fewer of those chunks (then nothing ran: `slot_prefixes`)."""
        members, start, stop = prefill
        if starting is not None:
            if not self.stage.first and starting.staged is None:  # its mask came with its first columns
                missed = self.prefix_reads.start_other(state, members, starting, group_mask)
                if missed is not None:
                    return _EMPTY, missed
            self._start_group(number, state, list(members), starting.specs, group_mask, rng)
            if starting.staged is not None:
                staged = self.staged.pop(starting.staged.number)
                rows = SlotRows(list(members), group_mask.clone(), position_ids(group_mask)[:, -1:])
                state.ready = (staged.cache(self.stage.config, group_mask.shape[1]), rows)
                return _EMPTY, None
        joining = state.joining
        assert joining is not None
        assert joining.members == list(members)
        forward = self.stage.forward
        scorer = self.prompt_scorer(state.joining_decodings, start, joining.mask.shape[1], state.prompt_logprobs,
                                    list(members)) if self.stage.last else None
        if scorer is not None:
            forward = functools.partial(forward, on_hidden=scorer)
        output = joining.run(forward, inputs, start, stop)
        if joining.complete:
            self.prefix_reads.keep(state, joining)
            state.ready, state.joining = (joining.cache, joining.rows()), None
        return output, None

    def _start_group(self, number: int, state: SlotState, members: list[int], specs: RowSpecs, mask: torch.Tensor,
                     rng: torch.Tensor) -> None:
        """What a stage keeps of a group as it starts: each member's final cache length; the last stage also
        its limits and a picker (disaggregated: its generators as the prompt pipeline left them)."""
        state.finals.update(zip(members, self.policy.finals(mask.sum(1).tolist(), specs.max_new_tokens), strict=True))
        if self.stage.last:
            state.limits.update(zip(members, specs.max_new_tokens, strict=True))
            state.cancelled.update(self.kept_cancels(number))  # cancels that overtook the slot's opening
            state.joining_picker = TokenPicker(self.stage.adapter.model.generation_config, specs.decoding)
            state.joining_decodings, state.prompt_logprobs = list(specs.decoding), {}
            if rng.numel():
                state.joining_picker.set_states(rng)

    def _put_slot_back(self, number: int, state: SlotState, cache: Any, changed: bool) -> None:
        if not state.rows.members and not _holds_its_group(state, cache):
            self.caches.remove(number)
        elif changed:
            self.caches.remove(number)
            self.caches.new_cache(number, cache)
            self.caches.add(number, self.slot_capacity(state))
        else:
            self.caches.release(number)

    @staticmethod
    def slot_capacity(state: SlotState) -> int:
        """The positions the slot's cache may reach: its rows' longest final length (a static slot holding its
        group before the rows join: the group's)."""
        group = (state.joining.members if state.joining is not None else
                 state.ready[1].members if state.ready is not None else [])
        return max((state.finals.get(member, 0) for member in state.rows.members or group), default=0)


def _holds_its_group(state: SlotState, cache: Any) -> bool:
    """Whether `cache`, a slot's, is its group's too (a static slot holds its group's cache as its own)."""
    if state.joining is not None:
        return state.joining.cache is cache
    return state.ready is not None and (state.ready[0] is None or state.ready[0] is cache)
