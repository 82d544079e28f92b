"""The head's ledger: every waiting request and every microbatch in flight, one record each, and the decisions.

A microbatch in flight is one `Flight`: its rows (`Microbatch`: requests, tokens so far, which rows are
answered), its `Phase`, the KV bytes it reserved on each stage, and when it last made progress. The ledger
decides: what to admit (`admit`), what each stage report means (`on_tokens`, `on_prefilled`, `on_ended`,
`on_freed`, `on_microbatch_failed`), what a cancellation needs (`cancel`), how a recovery's plan resumes
(`resume`). Each returns an `Outcome`: the messages to send (by stage index), the futures to answer and the
tokens to stream. It never sends, answers or calls anything itself, so it is tested without processes; the
pipeline carries its outcomes out, outside the lock.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import InvalidStateError
from typing import Any

import attrs
import torch

from ...errors import TransportError
from ...generation.batching import Microbatch, Request
from ...generation.decoding import RowFailure
from ...generation.logprobs import Scores
from ...generation.slot_batch import SlotBatch
from ..wire.messages import Cancel, Decode, Drop, Message, Prefill, Prefilled, Start
from .ledger_slot_resumes import SlotResumes
from .ledger_state import POISON, Answer, Flight, Outcome, Phase, _fail_rows

log = logging.getLogger(__name__)

#: Sampling with recovery: the last steps whose generator states the ledger keeps (a microbatch whose replicas
#: lag further behind starts over).
RNG_STEPS_KEPT = 64


class Ledger(SlotResumes):
    """The decisions over every request the pipeline holds (its state is `LedgerState`'s: built with the layout,
    `microbatch`, `token_slots`, `eos`, `pad`, the `admission` rule and the `epoch`); continuous batching's
    are `SlotDecisions`', and `SlotResumes`' across a recovery."""

    def in_flight(self) -> list[tuple[int, Microbatch, str]]:
        """Each microbatch not yet ended, with its phase's name."""
        with self.lock:
            return [(number, flight.batch, flight.phase.value) for number, flight in sorted(self.flights.items())
                    if flight.phase is not Phase.ENDED]

    def holding_numbers(self) -> list[int]:
        with self.lock:
            return sorted(self.flights)

    def batch(self, number: int) -> Microbatch:
        return self.flights[number].batch

    def stalled_since(self) -> float | None:
        """The oldest last progress of a watched microbatch."""
        with self.lock:
            return min((flight.progress for flight in self.flights.values() if flight.progress is not None),
                       default=None)

    def status(self) -> dict[str, Any]:
        """Each microbatch in flight with its rows and steps (a slot: the rows it holds or takes in, its
        rounds), and the requests waiting."""
        with self.lock:
            return {"microbatches": [_status(number, flight.batch) for number, flight in sorted(self.flights.items())
                                     if flight.phase is not Phase.ENDED],
                    "waiting": len(self.waiting)}

    # ---- requests in -------------------------------------------------------------------------------
    def queue(self, requests: Sequence[Request]) -> None:
        with self.lock:
            if self.failure is not None:
                raise self.failure
            self.waiting.extend(requests)

    def admit(self) -> list[tuple[int, Message]]:
        """What may start now: staged microbatches on free token stages, and waiting requests as new microbatches
        while the first stage's pipeline has room (disaggregated: and the token side a free slot)."""
        sends: list[tuple[int, Message]] = []
        with self.lock:
            epoch = self.epoch()
            if self.continuous:
                return self._slot_admissions(epoch) if self.failure is None and not self.held else []
            while self.failure is None and not self.held:
                staged = sorted((flight for flight in self.flights.values() if flight.phase is Phase.STAGED
                                 and self._room_to_decode(flight.beside)), key=lambda flight: flight.staged_at)
                if staged:
                    flight = staged[0]
                    flight.phase, flight.progress = Phase.DECODING, time.monotonic()
                    assert flight.start is not None  # kept from its `prefilled`
                    sends.append((self.layout.prompt_depth,
                                  attrs.evolve(_with_ended(flight.start, flight.batch.dropped), epoch=epoch)))
                    flight.start = None
                elif self.waiting and self._room_for_a_prefill(beside=False):
                    if not self._start(epoch, sends, beside=False):  # the budget is full: wait for one to end
                        break
                elif self.waiting and self._room_for_a_prefill(beside=True) and self._held_back():
                    if not self._start(epoch, sends, beside=True):
                        break
                else:
                    break
        return sends

    def _start(self, epoch: int, sends: list[tuple[int, Message]], beside: bool) -> bool:
        """Start a microbatch of waiting requests that fits the budget (`beside`: one beside the layout's for the
        submissions held back, of their requests alone, so that a large request, which takes turns, does not keep
        them waiting for its microbatch to end); whether one started (under the lock)."""
        shares = self._shares()
        taken = self.admission.take(self.waiting, self.microbatch, [flight.reserved for flight in self.holding()],
                                    shares, set(shares) if beside else set())
        if not taken:
            return False
        batch = Microbatch.of(self._numbers, taken, self.pad)
        self._numbers += 1
        phase = Phase.PROMPTING if self.layout.disaggregated else Phase.DECODING
        self.flights[batch.number] = Flight(batch, phase, self.admission.reserve(taken), time.monotonic(),
                                            beside=beside)
        self.most_in_flight = max(self.most_in_flight, len(self.holding()))
        sends.append((0, Prefill(microbatch=batch.number, specs=batch.row_specs(), epoch=epoch, inputs=batch.ids,
                                 mask=batch.mask)))
        return True

    def cancel(self, request: Request) -> list[tuple[int, Message]]:
        """A request's caller cancelled it: a waiting one leaves the queue; a running row is ended at its next
        step (the first decoding stage passes the word on to the last; a microbatch not decoding yet carries
        the row as ended when it starts, and so does one that a recovery resumes)."""
        with self.lock:
            if request in self.waiting:
                self.waiting.remove(request)
                return []
            for number, flight in self.flights.items():
                if isinstance(flight.batch, SlotBatch):  # a request left by one slot may be in another now
                    row = flight.batch.rows_of.get(request.number)
                    if row is not None and row not in flight.batch.settled and flight.phase is not Phase.ENDED:
                        return self._cancel_member(flight, request)
                    continue
                rows = [row for row, member in enumerate(flight.batch.requests) if member is request]
                if rows and flight.phase is not Phase.ENDED:
                    flight.batch.dropped.update(rows)
                    flight.batch.settled.update(rows)
                    if flight.phase is Phase.DECODING and not self.held:
                        return [self._cancel(number, rows)]
        return []

    def _cancel(self, number: int, rows: Collection[int]) -> tuple[int, Message]:
        return self.layout.decoding_stages()[0], Cancel(microbatch=number, rows=sorted(rows), epoch=self.epoch())

    # ---- reports from the stages -----------------------------------------------------------------------
    def on_tokens(self, number: int, tokens: list[int], states: torch.Tensor | None,
                  failures: dict[int, RowFailure], scores: Scores | None = None) -> Outcome:
        """A step's tokens (a row each) from the last stage, with the generators' states after it (sampling
        with recovery), the rows that failed, and the report's log-probabilities."""
        outcome = Outcome()
        with self.lock:
            flight = self.flights.get(number)
            if flight is None or flight.phase is Phase.ENDED:
                return outcome
            flight.progress = time.monotonic()
            batch = flight.batch
            batch.add_step(tokens, scores)
            if states is not None:
                step = len(batch.arrived)
                batch.rng_states[step] = states.clone()
                batch.rng_states.pop(step - RNG_STEPS_KEPT, None)  # replicas are never that far behind
            outcome.answers = self._failed_rows(batch, failures)  # before streaming: a failed row's token is none
            outcome.calls = batch.unstreamed(self.eos)
            outcome.answers += self._ended_rows(batch)
        return outcome

    def on_prefilled(self, report: Prefilled, keep_states: bool) -> Outcome:
        """Disaggregated: the prompt pipeline's first tokens; the microbatch waits for a token stage (`keep_states`:
        the generators' states after them, for a recovery)."""
        outcome = Outcome()
        with self.lock:
            flight = self.flights.get(report.microbatch)
            if flight is None or flight.phase is not Phase.PROMPTING:
                return outcome
            tokens, mask, ended, rng = report.tokens, report.mask, report.ended, report.rng
            flight.batch.add_step(tokens[:, 0].tolist(), report.scores)
            if rng.numel() and keep_states:
                flight.batch.rng_states[1] = rng.clone()
            outcome.answers = self._failed_rows(flight.batch, report.failed)
            outcome.calls = flight.batch.unstreamed(self.eos)
            outcome.answers += self._ended_rows(flight.batch)
            self._staging += 1
            flight.phase, flight.progress, flight.staged_at = Phase.STAGED, None, self._staging
            flight.start = Start(microbatch=report.microbatch, specs=flight.batch.row_specs(),
                                 first=tokens[:, 0].tolist(), inputs=tokens, mask=mask, ended=ended, rng=rng)
        return outcome

    def on_ended(self, number: int, freed: bool) -> Outcome:
        """Every row of a microbatch ended at the last stage (`freed`: no other stage holds its cache)."""
        outcome = Outcome()
        with self.lock:
            flight = self.flights.get(number)
            if flight is None:
                return outcome
            batch = flight.batch
            outcome.answers = [(batch.requests[row].future, batch.result(row, self.eos))
                               for row in range(len(batch.requests)) if row not in batch.settled]
            batch.settled.update(range(len(batch.requests)))
            flight.freed = flight.freed or freed
            if flight.freed:
                del self.flights[number]
            else:  # watched until `freed` comes: a stage that never frees it fails
                flight.phase, flight.progress = Phase.ENDED, time.monotonic()
        return outcome

    def on_freed(self, number: int) -> None:
        """Every decoding stage let a microbatch's cache go: its room is free (its `ended` may still be coming)."""
        with self.lock:
            flight = self.flights.get(number)
            if flight is None:
                return
            flight.freed = True
            if flight.phase is Phase.ENDED:
                del self.flights[number]

    def on_microbatch_failed(self, number: int, error: str) -> Outcome:
        """A stage's computation failed on a microbatch: its unanswered requests fail with that error, every stage
        drops it, and its room is free. The other microbatches go on."""
        outcome = Outcome()
        with self.lock:
            epoch = self.epoch()
            if number in self.prompting:  # a group bound for a slot (continuous, disaggregated)
                outcome.answers = self._group_failed(number, error)
                flight = None
            else:
                flight = self.flights.pop(number, None)
                if flight is None:
                    return outcome
                outcome.answers = _fail_rows(flight.batch, error)
            dropped = [number, *(self._slot_groups(flight.batch) if flight is not None else ())]
        outcome.sends = [(stage, Drop(microbatches=dropped, failed=True, epoch=epoch))
                         for stage in range(len(self.layout.stages))]  # prompt stages too: chunks left to run
        return outcome

    # ---- failures and recoveries ---------------------------------------------------------------------------
    def fail_all(self, error: TransportError) -> list[Answer]:
        """Fail every request in flight or waiting with `error`; later submissions raise it too."""
        with self.lock:
            if self.failure is None:
                self.failure = error
            self.held = False
            flights, self.flights = list(self.flights.values()), {}
            waiting, self.waiting = list(self.waiting), deque()
        return [(request.future, error) for request in
                [request for flight in flights for request in flight.batch.requests] + waiting]

    def resume(self, resumed: dict[int, int], recomputed: list[int], finished: list[int],
               failed: Sequence[int]) -> Outcome:
        """After a recovery: feed each resumed microbatch the token of the step it resumes at, start the
        recomputed ones over from their prompts, settle the finished ones, fail the `failed` ones (poison), forget
        those that ended (every stage dropped them); then let new work in."""
        outcome = Outcome()
        first = self.layout.decoding_stages()[0]
        now = time.monotonic()
        with self.lock:
            epoch = self.epoch()
            for number in failed:
                outcome.answers += _fail_rows(self.flights.pop(number).batch, POISON)
            for number in finished:
                batch = self.flights.pop(number).batch
                outcome.answers += [(batch.requests[row].future, batch.result(row, self.eos))
                                    for row in range(len(batch.requests)) if row not in batch.settled]
            for number in [number for number, flight in self.flights.items() if flight.phase is Phase.ENDED]:
                del self.flights[number]
            for number, step in resumed.items():
                flight = self.flights[number]
                flight.batch.rewind(step)
                tokens = torch.tensor([[row[-1]] for row in flight.batch.generated], dtype=torch.long)
                flight.phase, flight.progress, flight.start, flight.freed = Phase.DECODING, now, None, False
                outcome.sends.append((first, Decode(microbatch=number, epoch=epoch, inputs=tokens)))
                if flight.batch.dropped:  # rows cancelled during the recovery, maybe after their rewind was sent
                    outcome.sends.append(self._cancel(number, flight.batch.dropped))
            for number in recomputed:
                flight = self.flights[number]
                flight.batch.rewind(0)
                flight.phase = Phase.PROMPTING if self.layout.disaggregated else Phase.DECODING
                flight.progress, flight.start, flight.freed = now, None, False
                flight.reserved = self.admission.reserve(flight.batch.requests)  # freed, taken again
                outcome.sends.append((0, Prefill(microbatch=number, specs=flight.batch.row_specs(), epoch=epoch,
                                                 ended=sorted(flight.batch.dropped),  # cancelled
                                                 inputs=flight.batch.ids, mask=flight.batch.mask)))
            self.held = False
        return outcome

    def seen_by_recovery(self, number: int) -> None:
        """A recovery resumed microbatch `number` (its messages went out), or sent a slot's group to the prompt
        pipeline again under that number: if the next recovery finds it without a new step since, it fails (the
        poison bound)."""
        with self.lock:
            group = self.prompting.get(number)  # a slot's group in the prompt pipeline counts for its slot
            flight = self.flights.get(number if group is None else group.slot)
            if flight is not None:
                flight.batch.seen_by_recovery = flight.batch.steps_received

    # ---- under the lock ---------------------------------------------------------------------------------
    def _count(self, phase: Phase) -> int:
        return sum(1 for flight in self.flights.values() if flight.phase is phase)

    def _room_to_decode(self, beside: bool) -> bool:
        """Disaggregated: whether a staged microbatch may start on the token stages: one per token stage, and as
        many again `beside` them for submissions held back."""
        decoding = [flight for flight in self.flights.values() if flight.phase is Phase.DECODING]
        counted = len(decoding) if beside else sum(1 for flight in decoding if not flight.beside)
        return counted < (2 if beside else 1) * self.layout.token_depth

    def _room_for_a_prefill(self, beside: bool) -> bool:
        """Whether another microbatch may start: one per stage (per token slot, disaggregated, while the prompt
        pipeline has a stage free), and as many again `beside` them for submissions held back."""
        holding = self.holding()
        counted = len(holding) if beside else sum(1 for flight in holding if not flight.beside)
        limit = (2 if beside else 1) * self._layout_microbatches()
        if not self.layout.disaggregated:
            return counted < limit
        return self._count(Phase.PROMPTING) < self.layout.prompt_depth and counted < limit


def answer(answers: list[Answer]) -> None:
    """Give each future its result or error (outside the ledger's lock), unless its caller cancelled it or it is
    answered already."""
    for future, result in answers:
        with contextlib.suppress(InvalidStateError):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


def stream(calls: list[tuple[Callable[[Any], None], Any]]) -> None:
    """Give requests their new tokens and log-probabilities (outside the ledger's lock); a failing callback stops
    none of the others."""
    for callback, value in calls:
        try:
            callback(value)
        except Exception:  # noqa: PERF203 - one callback's failure must not keep tokens from the others
            log.exception("a request's on_token or on_logprobs callback failed")


def _status(number: int, batch: Microbatch) -> dict[str, Any]:
    if isinstance(batch, SlotBatch):
        return {"microbatch": number, "rows": len(batch.held()), "steps": len(batch.rounds)}
    return {"microbatch": number, "rows": len(batch.requests), "steps": len(batch.arrived)}


def _with_ended(start: Start, rows: set[int]) -> Start:
    """A `Start` whose `ended` rows include `rows` (failed or cancelled since it was made)."""
    if not rows:
        return start
    ended = start.ended.clone()
    ended[sorted(rows)] = 1
    return attrs.evolve(start, ended=ended)

