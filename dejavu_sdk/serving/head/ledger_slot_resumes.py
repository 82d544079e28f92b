"""The head's decisions over continuous batching's slots across a recovery: which slots the recovery plans from,
and how each goes on after it (`resume_slots`): from the round the stages went back to, with the groups whose
prefill had not begun sent again, or, lost, its requests waiting again (or failing, if it is poison).
"""

from __future__ import annotations

import time

import torch

from ...generation.batching import Microbatch
from ...generation.row_specs import group_rows
from ...generation.slot_batch import SlotBatch
from ..wire.messages import Cancel, Enter, Message, Prefill, SlotRound
from .ledger_slots import SlotDecisions
from .ledger_state import POISON, Answer, Outcome, Phase, PromptGroup, _fail_rows


class SlotResumes(SlotDecisions):
    """The ledger's decisions over its slots at a recovery (on `LedgerState`, under its lock); `Ledger` inherits
    them."""

    def slots_to_recover(self, epoch: int) -> list[tuple[int, SlotBatch]]:
        """The slots in flight, whose rounds reported before the recovery of `epoch` count, and no later ones
        from before it (the recovery plans from these)."""
        with self.lock:
            slots = [(number, flight.batch) for number, flight in sorted(self.flights.items())
                     if isinstance(flight.batch, SlotBatch) and flight.phase is Phase.DECODING]
            for _, batch in slots:
                batch.plan_epoch = epoch
            return slots

    def resume_slots(self, rounds: dict[int, int], lost: dict[int, str]) -> Outcome:
        """After a recovery: each slot in `rounds` goes on from its round there, as the stages now hold it
        (`SlotBatch.resuming`; a disaggregated slot not opened yet, from its start): the groups whose prefill had
        not begun are sent again (disaggregated: to the prompt pipeline, whose first tokens are the same ones),
        and its next round starts unless it was parked; the slots `lost` requeue or fail their requests."""
        outcome = Outcome()
        now = time.monotonic()
        with self.lock:
            epoch = self.epoch()
            for number, reason in lost.items():
                flight = self.flights.pop(number, None)
                if flight is not None:
                    outcome.answers += self._lose_slot(flight.batch, reason)
            for number in rounds:
                flight = self.flights[number]
                batch = flight.batch
                assert isinstance(batch, SlotBatch)
                flight.phase, flight.progress, flight.freed = Phase.DECODING, now, False
                if not batch.opened:  # its first group had not reached the token stages: it goes again
                    outcome.sends += self._send_again(batch, set(), epoch)
                    continue
                assert batch.resuming is not None  # set as its rewind succeeded
                found, batch.resuming = batch.resuming, None
                outcome.sends += self._send_again(batch, found.started, epoch)
                if not batch.idle:
                    left, joined = batch.next_change
                    last = [batch.generated[batch.rows_of[member]][-1] for member in found.rows.members]
                    tokens = torch.tensor(last, dtype=torch.long).reshape(-1, 1)
                    outcome.sends.append((self.layout.decoding_stages()[0], SlotRound(
                        microbatch=number, left=left, joined=joined, applied=True, epoch=epoch, inputs=tokens)))
                cancelled = [batch.requests[row].number for row in sorted(batch.dropped & batch.present)]
                if cancelled:  # cancelled during the recovery, maybe after the rewind that named the others
                    outcome.sends.append((self.layout.decoding_stages()[0], Cancel(microbatch=number, rows=cancelled,
                                                                                   epoch=epoch)))
        return outcome

    def _lose_slot(self, batch: Microbatch, reason: str) -> list[Answer]:
        """A slot that cannot go on from where it was: its requests wait again, first in the queue, those without
        a token as they came, the others from their prompts followed by the tokens they have (`going_on`: the
        tokens streamed stay theirs, and what they have left is computed again), unless the slot is poison (one
        of them may be what kills the stages): then they fail with `reason` (under the lock)."""
        self._slot_groups(batch)
        assert isinstance(batch, SlotBatch)
        again = [] if reason == POISON else [row for row in range(len(batch.requests)) if row not in batch.settled
                                             and not batch.requests[row].future.done()]
        ended = [row for row in again if batch.row_ended(row, self.eos)]  # its last token came with the loss
        answers = [(batch.requests[row].future, batch.result(row, self.eos)) for row in ended]
        had = {row: len(batch.generated[row]) + len(getattr(batch.requests[row].earlier, "tokens", ()))
               for row in again}
        poison = [row for row in again if row not in ended and batch.requests[row].lost_with == had[row]]
        answers += _fail_rows(batch, POISON, poison)  # lost twice in a row without a token between
        again = [row for row in again if row not in ended and row not in poison]
        batch.settled.update([*ended, *again])
        requeued = [batch.going_on(row) if batch.generated[row] else batch.requests[row] for row in again]
        for row, request in zip(again, requeued, strict=True):
            request.lost_with = had[row]
        self.waiting.extendleft(reversed(requeued))
        return answers + _fail_rows(batch, f"slot {batch.number} could not be recovered: {reason}")

    def _send_again(self, batch: SlotBatch, started: set[tuple[int, ...]], epoch: int) -> list[tuple[int, Message]]:
        """The groups of `batch` whose prefill had not begun (none of their members in a `started` group), sent
        again in their order, less their members no longer on their way in (under the lock)."""
        begun = {member for group in started for member in group}
        for number in [number for number, group in self.prompting.items() if group.slot == batch.number]:
            del self.prompting[number]
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
            if self.layout.disaggregated:
                number = self._numbers
                self._numbers += 1
                self.prompting[number] = PromptGroup(batch.number, again, group_mask)
                sends.append((0, Prefill(microbatch=number, specs=again.specs, epoch=epoch, inputs=group_ids,
                                         mask=group_mask)))
            else:
                sends.append((0, Enter(microbatch=batch.number, group=again, epoch=epoch, ids=group_ids,
                                       mask=group_mask)))
        return sends
