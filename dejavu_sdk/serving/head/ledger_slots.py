"""The head's decisions under continuous batching: which waiting requests enter which slot, and what a round's
report means.

A slot (`SlotBatch`) opens with a group of waiting requests (`OpenSlot` to the first stage), and takes another
group (`Enter`) whenever it has fewer than `microbatch` rows in its cache or on their way and the groups on their
way in have fewer than `QUEUED_ROUNDS` rounds of prompt left (none on its way, without a prefill budget), as many
as the KV budget holds and, with a budget, whose prompts fill at most one round (`max_prefill_tokens`): requests
that arrive together have their first tokens a round apart instead of all at the last one's. Admission counts
rows, a slot reserving each of its rows at its longest row's final length (`admission.row_bytes`), and takes
them in turns between submissions (`turns`); a
submission held back by a larger one gets a slot beside the others (`LedgerState.held_back`). A slot whose
round ran nothing is `idle` (parked on its first stage); one that no group is bound for then ends here (`End`
through every stage), and its room is free once every stage has let its cache go (`Freed`). A slot stops taking
groups after `SLOT_ROUNDS` rounds (its schedule, which every result carries, stays bounded): it drains and ends,
and waiting requests open new slots.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ...errors import RequestFailed
from ...generation.admission import Slot, row_bytes
from ...generation.batching import Request
from ...generation.logprobs import Scores
from ...generation.slot_batch import SlotBatch
from ...generation.slots import Round
from ..wire.messages import Cancel, Drop, End, Enter, Message, OpenSlot, Prefill, Prefilled, RoundDone, Staged
from .ledger_state import Answer, Flight, LedgerState, Outcome, Phase, PromptGroup

#: Rounds after which a slot takes no new rows: it drains, and a new slot takes its place.
SLOT_ROUNDS = 1024
#: Rounds of prompt a joining group may have left before a slot opens beside its own for the requests that
#: would wait for it to join (an 8,000-token prompt has 31 of 256 positions).
LONG_PREFILL_ROUNDS = 16
#: Rounds of prompt positions on their way into a slot under which it takes another group: each group a round's
#: prefill budget (`max_prefill_tokens`), so that requests arriving together have their first tokens one round
#: after another, and the next group is on the first stage before the one ahead of it is in.
QUEUED_ROUNDS = 4


class SlotDecisions:
    """The ledger's decisions over its slots in flight (on its `LedgerState`, under its lock): `Ledger.slots`."""

    def __init__(self, ledger: LedgerState) -> None:
        self.ledger = ledger

    def admissions(self, epoch: int) -> list[tuple[int, Message]]:
        """Groups of waiting requests into slots with room, then new slots while the (token) stages have room for
        one each, and beside them for submissions held back (`held_back`); disaggregated, as many groups at once
        as the prompt pipeline has stages (under the lock)."""
        ledger = self.ledger
        sends = self._fill_slots(epoch, queue=False)
        sends += self._end_idle_slots(epoch)
        slots = ledger.layout_microbatches()
        while ledger.waiting and self._shared_slots() - self._long_prefills() < slots \
                and len(ledger.holding()) < 2 * slots and self._prompt_room():
            if not self._open_slot(epoch, sends, beside=False):
                break
        while ledger.waiting and len(ledger.holding()) < 2 * slots and self._prompt_room() and ledger.held_back():
            if not self._open_slot(epoch, sends, beside=True):
                break
        return sends + self._fill_slots(epoch, queue=True)

    def _fill_slots(self, epoch: int, queue: bool) -> list[tuple[int, Message]]:
        """Groups of waiting requests into the slots with room: a group into each slot that has none on its way in,
        or (`queue`, once the slots that the stages have room for are open, so that each stage has one to run)
        groups behind those on their way, while the slot takes another (`_takes_another_group`), under the lock."""
        ledger = self.ledger
        sends: list[tuple[int, Message]] = []
        for flight in [flight for flight in ledger.flights.values() if flight.phase is Phase.DECODING]:
            batch = flight.batch
            while (ledger.waiting and len(batch.rounds) < SLOT_ROUNDS and self._prompt_room()
                   and batch.policy.admits(batch.held())
                   and (not batch.entering or (queue and self._takes_another_group(batch)))):
                held = batch.held()
                taken = self._take(ledger.microbatch - len(held), held, flight)
                if not taken:
                    break
                sends.append(self.send_group(flight, taken, epoch))
        return sends

    def _takes_another_group(self, batch: SlotBatch) -> bool:
        """Whether a slot with groups on their way in takes another behind them: with a prefill budget, while they
        have fewer than QUEUED_ROUNDS rounds of prompt positions left, so that the next starts on the round after
        the one before it is in, and no request is bound for a slot far ahead of its turn (under the lock)."""
        prefill_tokens = self.ledger.prefill_tokens
        return prefill_tokens is not None and _prefill_left(batch) < QUEUED_ROUNDS * prefill_tokens

    def _shared_slots(self) -> int:
        """The slots whose rows any submission may take (all but those opened beside them)."""
        return sum(1 for flight in self.ledger.holding() if not flight.beside)

    def _open_slot(self, epoch: int, sends: list[tuple[int, Message]], beside: bool) -> bool:
        """Open a slot with a group of waiting requests (`beside`: one beside the others for the submissions held
        back, which only theirs join, so that a large request, which takes turns, does not keep them waiting for
        its rows to end); whether one opened (under the lock)."""
        ledger = self.ledger
        batch = SlotBatch.open(ledger.next_number, ledger.pad, ledger.policy)
        flight = Flight(batch, Phase.DECODING, 0, time.monotonic(), beside=beside)
        taken = self._take(ledger.microbatch, [], flight)
        if not taken:
            return False
        ledger.next_number += 1
        ledger.flights[flight.batch.number] = flight
        sends.append(self.send_group(flight, taken, epoch))
        ledger.most_in_flight = max(ledger.most_in_flight, sum(1 for other in ledger.holding() if other.batch.held()))
        return True

    def _long_prefills(self) -> int:
        """The slots whose joining group has more than `LONG_PREFILL_ROUNDS` rounds of prompt positions left to run
        (disaggregated: whose group in the prompt pipeline is that long), under the lock. A waiting request can join
        none of them before that group does, so each lets another slot open beside it, whose rounds (or prompt
        chunks) take turns with its chunks: a short request is not held back by a long prompt."""
        ledger = self.ledger
        if ledger.prefill_tokens is None:
            return 0
        if ledger.layout.disaggregated:
            return len({group.slot for group in self._long_groups()})
        long = LONG_PREFILL_ROUNDS * ledger.prefill_tokens
        return sum(1 for flight in ledger.flights.values() if flight.phase is Phase.DECODING
                   and _prefill_left(flight.batch) > long)

    def _long_groups(self) -> list[PromptGroup]:
        """Disaggregated: the groups in the prompt pipeline with more than `LONG_PREFILL_ROUNDS` rounds of prompt
        positions (under the lock)."""
        ledger = self.ledger
        if ledger.prefill_tokens is None:
            return []
        long = LONG_PREFILL_ROUNDS * ledger.prefill_tokens
        return [group for group in ledger.prompting.values() if group.mask.numel() > long]

    def _end_idle_slots(self, epoch: int) -> list[tuple[int, Message]]:
        """End the idle slots that no group is bound for: every stage frees its part, the last says `freed`
        (under the lock)."""
        ledger = self.ledger
        ends: list[tuple[int, Message]] = []
        for flight in ledger.flights.values():
            batch = flight.batch
            if (flight.phase is Phase.DECODING and batch.idle
                    and not batch.entering):
                flight.phase, flight.progress = Phase.ENDED, time.monotonic()
                ends.append((ledger.layout.decoding_stages()[0], End(microbatch=batch.number, epoch=epoch)))
        return ends

    def _prompt_room(self) -> bool:
        """Disaggregated: whether the prompt pipeline has a stage free for another group; a long group (its
        chunks take turns with the others') leaves its stage's room to another, up to twice the stages."""
        ledger = self.ledger
        depth = ledger.layout.prompt_depth
        return not ledger.layout.disaggregated or (len(ledger.prompting) - len(self._long_groups()) < depth
                                                 and len(ledger.prompting) < 2 * depth)

    def send_group(self, flight: Flight, taken: list[Request], epoch: int) -> tuple[int, Message]:
        """Send a group of requests into `flight`'s slot: to the first stage (`OpenSlot` opens the slot there,
        `Enter` joins it); disaggregated, to the prompt pipeline first, as a microbatch of its own number."""
        ledger = self.ledger
        batch = flight.batch
        group, ids, mask = batch.enter(taken)
        batch.groups.append((group, ids, mask))
        if not batch.policy.refills:  # a static slot's microbatch: its results carry a number of its own
            number = batch.number if not batch.numbers else ledger.next_number
            ledger.next_number += number != batch.number
            batch.numbers.append(number)
        self.reserve(flight)
        if ledger.layout.disaggregated:
            number = ledger.next_number
            ledger.next_number += 1
            ledger.prompting[number] = PromptGroup(batch.number, group, mask)
            return 0, Prefill(microbatch=number, specs=group.specs, epoch=epoch, inputs=ids, mask=mask)
        entering = Enter if batch.opened else OpenSlot
        batch.opened, batch.idle = True, False
        return 0, entering(microbatch=batch.number, group=group, epoch=epoch, ids=ids, mask=mask,
                           salt=taken[0].cache_salt if len(taken) == 1 else "")

    def on_group_prefilled(self, report: Prefilled) -> Outcome:
        """Disaggregated: the prompt pipeline's first tokens of a group; the group goes to its slot on the token
        pipeline, its KV staged there already (or on its way)."""
        ledger = self.ledger
        outcome = Outcome()
        number = report.microbatch
        with ledger.lock:
            group = ledger.prompting.pop(number, None)
            flight = ledger.flights.get(group.slot) if group is not None else None
            if group is None or flight is None or flight.phase is Phase.ENDED:
                return outcome
            batch = flight.batch
            tokens, ended, rng = report.tokens, report.ended, report.rng
            members = group.group.members
            new = [row for row, member in enumerate(members) if not batch.generated[batch.rows_of[member]]]
            batch.add_tokens([members[row] for row in new], tokens[new, 0].tolist(),  # again after a recovery: kept
                             _by_member(report.scores, members, new))
            if rng.numel():
                batch.states.update((member, rng[row].clone()) for row, member in enumerate(members))
            flight.progress = time.monotonic()
            batch.steps_received += 1  # progress, for the poison bound
            outcome.answers = ledger.failed_rows(batch, {batch.rows_of[members[row]]: failure
                                                        for row, failure in report.failed.items()})
            outcome.calls = batch.unstreamed(ledger.eos)
            batch.prefilled = batch.with_resumed(Round(prefill=(tuple(members), 0, group.mask.shape[1])))
            outcome.answers += ledger.ended_rows(batch)
            batch.prefilled = None
            gone = [member for index, member in enumerate(members)
                    if bool(ended[index]) or batch.rows_of[member] in batch.dropped]
            entering = Enter if batch.opened else OpenSlot
            batch.opened, batch.idle = True, False
            batch.staged[number] = tuple(members)
            staged = Staged(number, tokens[:, 0].tolist(), gone, report.chunk,
                            _by_member(report.scores, members, list(range(len(members)))))
            outcome.sends.append((ledger.layout.prompt_depth, entering(
                microbatch=batch.number, group=group.group, staged=staged, epoch=ledger.epoch(), mask=group.mask,
                rng=rng)))
        return outcome

    def group_failed(self, number: int, error: str) -> list[Answer]:
        """Disaggregated: the prompt pipeline failed on group `number`: its requests fail; a slot it was to open
        is let go (under the lock)."""
        ledger = self.ledger
        group = ledger.prompting.pop(number)
        flight = ledger.flights.get(group.slot)
        if flight is None:
            return []
        batch = flight.batch
        rows = [batch.rows_of[member] for member in group.group.members]
        answers = [(batch.requests[row].future, RequestFailed(error, batch.requests[row].number))
                   for row in rows if row not in batch.settled]
        batch.settled.update(rows)
        batch.entering -= set(rows)
        self.reserve(flight)
        if not batch.opened:
            del ledger.flights[group.slot]
        return answers

    def forget_groups(self, batch: SlotBatch) -> list[int]:
        """A failed slot's groups that have not joined it (disaggregated): those the prompt pipeline still runs
        are forgotten here, and the stages drop what they staged of any (under the lock)."""
        ledger = self.ledger
        prompting = [number for number, group in ledger.prompting.items() if group.slot == batch.number]
        for number in prompting:
            del ledger.prompting[number]
        return [*prompting, *batch.staged]

    def reserve(self, flight: Flight) -> None:
        """Reserve what a slot's rows, in its cache or on their way in, take at their end (under the lock)."""
        flight.reserved = flight.batch.policy.reserve(flight.batch.held(), self.ledger.admission.bytes_per_token)

    def _take(self, room: int, held: list[Request], flight: Flight) -> list[Request]:
        """Up to `room` waiting requests for `flight`'s slot that fit beside `held` (its rows) and every other
        slot's, in turns between submissions, the fewest rows in flight first (in a slot opened for those held
        back, only submissions that hold no row in another)."""
        ledger = self.ledger
        if ledger.prefixes and ledger.policy.refills:
            room = min(room, 1)  # a group of one prompt reads its own prompt prefixes
        others = [self._admitted(other) for other in ledger.holding() if other is not flight]
        return ledger.policy.take(ledger.admission, ledger.waiting, room, held, others, ledger.shares(),
                                  ledger.barred(flight), ledger.prefill_tokens)

    def _admitted(self, flight: Flight) -> Slot:
        """What a flight holds, for admission: its reservation, and the bytes of the rows on their way in."""
        batch = flight.batch
        entering = [batch.requests[row] for row in sorted(batch.entering)]
        return Slot(flight.reserved, row_bytes(entering, self.ledger.admission.bytes_per_token))

    def on_round(self, number: int, done: RoundDone, tokens: list[int], states: torch.Tensor | None = None,
                 epoch: int = 0, scores: Scores | None = None) -> Outcome:
        """A slot's round from the last stage (`done`, sent in `epoch`): its schedule grows, its members' tokens
        stream with their log-probabilities (`scores`), ended rows are answered and failed ones fail; an idle round
        leaves the slot waiting for a group (or to be ended). A round from before a recovery counts until that
        recovery plans where the slot goes on (it was computed, and streamed to the replicas, before the failure);
        `states` are the generators' states of its picks."""
        ledger = self.ledger
        outcome = Outcome()
        with ledger.lock:
            flight = ledger.flights.get(number)
            if flight is None or flight.phase is Phase.ENDED:
                return outcome
            batch = flight.batch
            if epoch < batch.plan_epoch:
                return outcome
            flight.progress = time.monotonic()
            batch.add_round(done.round, done.members, tokens, done.complete, scores)
            batch.idle = done.idle
            left, joined = done.next
            batch.next_change = (list(left), joined)
            if states is not None:
                batch.states.update((member, state.clone()) for member, state in zip(done.members, states, strict=True))
            failures = {batch.rows_of[member]: failure for member, failure in done.failed.items()}
            outcome.answers = ledger.failed_rows(batch, failures)
            outcome.calls = batch.unstreamed(ledger.eos)
            outcome.answers += ledger.ended_rows(batch)
            self.reserve(flight)
        return outcome

    def on_not_entered(self, number: int, members: list[int]) -> None:
        """The first stage took `members` out of a group queued for slot `number` (they were cancelled): no
        longer on their way in; any still unanswered waits again, first in the queue."""
        ledger = self.ledger
        with ledger.lock:
            flight = ledger.flights.get(number)
            if flight is not None:
                back = flight.batch.leave_unentered(members)
                ledger.waiting.extendleft(reversed([request for request in back if not request.future.done()]))
                self.reserve(flight)

    def cancel_member(self, flight: Flight, request: Request) -> list[tuple[int, Message]]:
        """A request of a slot cancelled: the first decoding stage takes it out of a queued group, or the last
        ends its row at the next round (a joining one's as it joins)."""
        ledger = self.ledger
        batch = flight.batch
        row = batch.rows_of[request.number]
        batch.dropped.add(row)
        batch.settled.add(row)
        dropped = self._drop_cancelled_group(flight, request.number)
        if dropped:
            return dropped
        return [(ledger.layout.decoding_stages()[0], Cancel(microbatch=batch.number, rows=[request.number],
                                                          epoch=ledger.epoch()))]

    def _drop_cancelled_group(self, flight: Flight, member: int) -> list[tuple[int, Message]]:
        """Disaggregated: the group in the prompt pipeline that `member` (just cancelled) belongs to, once every
        member of it is cancelled, stops there: every stage drops it (a prompt stage its chunks still to run, a
        token stage the KV it staged, and any that comes later), and its slot no longer waits for it (under the
        lock)."""
        ledger = self.ledger
        batch = flight.batch
        for number, group in ledger.prompting.items():
            members = group.group.members
            if group.slot != batch.number or member not in members:
                continue
            if not all(batch.rows_of[other] in batch.dropped for other in members):
                return []
            del ledger.prompting[number]
            batch.entering -= {batch.rows_of[other] for other in members}
            self.reserve(flight)
            if not batch.opened:  # the slot's first group: nothing else is on its way to it
                del ledger.flights[batch.number]
            return [(stage, Drop(microbatches=[number], failed=True, epoch=ledger.epoch()))
                    for stage in range(len(ledger.layout.stages))]
        return []


def _prefill_left(batch: SlotBatch) -> int:
    """The prompt positions (rows x columns) that the groups on their way into `batch` have yet to run, as the
    rounds reported so far say (0: none on its way, or their prompts are in). Groups join in the order they
    were sent: only the oldest of those on their way may have begun, at the latest round that ran a prefill."""
    on_the_way = batch.entering - batch.completed
    latest = next((step.prefill for step in reversed(batch.rounds) if step.prefill is not None), None)
    left = 0
    for group, _, mask in reversed(batch.groups):
        rows = {batch.rows_of[member] for member in group.members}
        if not rows & on_the_way:
            break
        done = latest[2] if latest is not None and latest[0] and latest[0][0] in group.members else 0
        left += (mask.shape[1] - done) * len(group.members)
    return left


def _by_member(scores: Scores, members: list[int], rows: list[int]) -> Scores:
    """A group's log-probabilities (by its row in the prompt pipeline's microbatch) for `rows` only, by member."""
    kept = {str(row) for row in rows}

    def by_member(entries: dict[str, Any]) -> dict[str, Any]:
        return {str(members[int(row)]): entry for row, entry in entries.items() if row in kept}

    return Scores(by_member(scores.logprobs), by_member(scores.prompt_logprobs))
