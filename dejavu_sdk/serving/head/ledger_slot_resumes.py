"""The head's decisions over continuous batching's slots across a recovery: which slots the recovery plans from,
and how each goes on after it (`resume_slots`): from the round the stages went back to, with the groups whose
prefill had not begun sent again, or, lost, its requests waiting again (or failing, if it is poison).
"""

from __future__ import annotations

import time

import torch

from ...generation.row_specs import group_rows
from ...generation.slot_batch import SlotBatch
from ...generation.slot_policy import STATIC
from ..wire.messages import Cancel, Enter, Message, Prefill, SlotRound
from .ledger_slots import SlotDecisions
from .ledger_state import POISON, Flight, LedgerState, Outcome, Phase, PromptGroup, _fail_rows


class SlotResumes:
    """The ledger's decisions over its slots at a recovery (on its state, under its lock, with its `slots`'
    decisions): `Ledger.resumes`."""

    def __init__(self, ledger: LedgerState, slots: SlotDecisions) -> None:
        self.ledger, self.slots = ledger, slots

    def slots_to_recover(self, epoch: int) -> list[tuple[int, SlotBatch]]:
        """The slots in flight, whose rounds reported before the recovery of `epoch` count, and no later ones
        from before it (the recovery plans from these)."""
        ledger = self.ledger
        with ledger.lock:
            slots = [(number, flight.batch) for number, flight in sorted(ledger.flights.items())
                     if flight.phase is Phase.DECODING]
            for _, batch in slots:
                batch.plan_epoch = epoch
            return slots

    def resume_slots(self, rounds: dict[int, int], lost: dict[int, str]) -> Outcome:
        """After a recovery: each slot in `rounds` goes on from its round there, as the stages now hold it
        (`SlotBatch.resuming`; a disaggregated slot not opened yet, from its start): the groups whose prefill had
        not begun are sent again (disaggregated: to the prompt pipeline, whose first tokens are the same ones),
        and its next round starts unless it was parked; the slots `lost` requeue or fail their requests (a static
        one's microbatch starts over). Then new work may start."""
        ledger = self.ledger
        outcome = Outcome()
        now = time.monotonic()
        with ledger.lock:
            epoch = ledger.epoch()
            for number, reason in lost.items():
                flight = ledger.flights.pop(number, None)
                if flight is not None:
                    self._lose_slot(flight.batch, reason, outcome)
            for number in rounds:
                flight = ledger.flights[number]
                batch = flight.batch
                flight.phase, flight.progress, flight.freed = Phase.DECODING, now, False
                if not batch.opened:  # its first group had not reached the token stages: it goes again
                    outcome.sends += self._send_again(batch, set(), epoch)
                    continue
                assert batch.resuming is not None  # set as its rewind succeeded
                found, batch.resuming = batch.resuming, None
                outcome.sends += self._send_again(batch, found.started, epoch)
                if not batch.idle:
                    left, joined = batch.next_change
                    last = [self._next_input(batch, batch.rows_of[member]) for member in found.rows.members]
                    tokens = torch.tensor(last, dtype=torch.long).reshape(-1, 1)
                    outcome.sends.append((ledger.layout.decoding_stages()[0], SlotRound(
                        microbatch=number, left=left, joined=joined, applied=True, epoch=epoch, inputs=tokens)))
                cancelled = [batch.requests[row].number for row in sorted(batch.dropped & batch.present)]
                if cancelled:  # cancelled during the recovery, maybe after the rewind that named the others
                    outcome.sends.append((ledger.layout.decoding_stages()[0], Cancel(microbatch=number, rows=cancelled,
                                                                                   epoch=epoch)))
            ledger.held = False  # new work may start
        return outcome

    def _next_input(self, batch: SlotBatch, row: int) -> int:
        """What row `row` of `batch` is fed at the slot's next round: its latest token, or (a static slot's row that
        ended before the latest round, kept as padding) the padding id, as `model.generate` feeds it."""
        generated = batch.generated[row]
        if not batch.policy.refills and len(generated) < max(len(tokens) for tokens in batch.generated):
            return self.ledger.pad
        return generated[-1]

    def _lose_slot(self, batch: SlotBatch, reason: str, outcome: Outcome) -> None:
        """A slot that cannot go on from where it was: its requests wait again, first in the queue, those without
        a token as they came, the others from their prompts followed by the tokens they have (`going_on`: the
        tokens streamed stay theirs, and what they have left is computed again; a static slot's microbatch starts
        over, `_restart`), unless the slot is poison (one of them may be what kills the stages): then they fail
        with `reason` (under the lock)."""
        ledger = self.ledger
        self.slots.forget_groups(batch)
        again = [] if reason == POISON else [row for row in range(len(batch.requests)) if row not in batch.settled
                                             and not batch.requests[row].future.done()]
        ended = [row for row in again if batch.row_ended(row, ledger.eos)]  # its last token came with the loss
        answers = outcome.answers
        answers += [(batch.requests[row].future, batch.result(row, ledger.eos)) for row in ended]
        had = {row: len(batch.generated[row]) + len(getattr(batch.requests[row].earlier, "tokens", ()))
               for row in again}
        poison = [row for row in again if row not in ended and _no_progress(batch.requests[row].lost_with, had[row])]
        answers += _fail_rows(batch, POISON, poison)  # lost twice in a row without a token between
        again = [row for row in again if row not in ended and row not in poison]
        batch.settled.update([*ended, *again])
        if batch.policy.refills:
            requeued = [batch.going_on(row) if batch.generated[row] else batch.requests[row] for row in again]
            for row, request in zip(again, requeued, strict=True):
                request.lost_with = had[row]
            ledger.waiting.extendleft(reversed(requeued))
        else:
            for row in again:
                batch.requests[row].lost_with = had[row]
            outcome.sends += self._restart(batch, again)
        answers += _fail_rows(batch, f"slot {batch.number} could not be recovered: {reason}")

    def _restart(self, batch: SlotBatch, again: list[int]) -> list[tuple[int, Message]]:
        """A static slot lost: its microbatch starts over in a new slot, each row where it sat (those answered
        already, and those not `again`, as padding), so that every row's tokens are again `model.generate`'s on
        that microbatch; the tokens its requests streamed are not streamed twice (under the lock)."""
        ledger = self.ledger
        if not again:
            return []
        sends = []
        flight = Flight(SlotBatch.open(ledger.next_number, ledger.pad, STATIC), Phase.DECODING, 0, time.monotonic())
        ledger.next_number += 1
        ledger.flights[flight.batch.number] = flight
        sends.append(self.slots.send_group(flight, batch.requests, ledger.epoch()))
        restarted = flight.batch
        padding = [row for row in range(len(batch.requests)) if row not in again]
        restarted.settled.update(padding)
        restarted.dropped.update(padding)
        if padding:
            rows = [batch.requests[row].number for row in padding]
            sends.append((ledger.layout.decoding_stages()[0], Cancel(microbatch=restarted.number, rows=rows,
                                                                     epoch=ledger.epoch())))
        return sends

    def _send_again(self, batch: SlotBatch, started: set[tuple[int, ...]], epoch: int) -> list[tuple[int, Message]]:
        """The groups of `batch` whose prefill had not begun (none of their members in a `started` group), sent
        again in their order, less their members no longer on their way in (under the lock)."""
        ledger = self.ledger
        begun = {member for group in started for member in group}
        for number in [number for number, group in ledger.prompting.items() if group.slot == batch.number]:
            del ledger.prompting[number]
        batch.staged.clear()
        sends: list[tuple[int, Message]] = []
        for group, ids, mask in batch.groups:
            members = group.members
            if begun & set(members):
                continue
            rows = [row for row, member in enumerate(members) if batch.rows_of[member] in batch.entering
                    and batch.rows_of[member] not in batch.dropped]
            batch.leave_unentered([member for row, member in enumerate(members) if row not in rows
                                   and batch.rows_of[member] in batch.entering])
            if not rows:
                continue
            again, group_ids, group_mask = group_rows(group, ids, mask, rows)
            if ledger.layout.disaggregated:
                number = ledger.next_number
                ledger.next_number += 1
                ledger.prompting[number] = PromptGroup(batch.number, again, group_mask)
                sends.append((0, Prefill(microbatch=number, specs=again.specs, epoch=epoch, inputs=group_ids,
                                         mask=group_mask)))
            else:
                sends.append((0, Enter(microbatch=batch.number, group=again, epoch=epoch, ids=group_ids,
                                       mask=group_mask)))
        return sends


def _no_progress(lost_with: int | None, had: int) -> bool:
    """Whether a request lost again had no more tokens than when it was lost before (a static microbatch that
    starts over counts its tokens anew)."""
    return lost_with is not None and lost_with >= had
