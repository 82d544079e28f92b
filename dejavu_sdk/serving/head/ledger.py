"""The head's ledger: every waiting request and every microbatch in flight, one record each, and the decisions.

A microbatch in flight is a slot, one `Flight`: its rows (`SlotBatch`: requests, tokens so far, which rows are
answered, its rounds), its `Phase`, the KV bytes it reserved on each stage, and when it last made progress. Its
policy is the pipeline's batching: continuous batching refills a slot as its rows end; a static slot takes one
group (a microbatch), whose rows stay until the last ends. The ledger decides: what to admit (`admit`), what each
stage report means (`on_round`, `on_group_prefilled`, `on_freed`, `on_microbatch_failed`), what a cancellation
needs (`cancel`), how a recovery's plan resumes (`resume_slots`). Each returns an `Outcome`: the messages to
send (by stage index), the futures to answer and the tokens to stream. It never sends, answers or calls anything
itself, so it is tested without processes; the pipeline carries its outcomes out, outside the lock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import InvalidStateError
from typing import Any

from ...errors import TransportError
from ...generation.batching import Request
from ...generation.slot_batch import SlotBatch
from ..wire.messages import Drop, Message
from .ledger_slot_resumes import SlotResumes
from .ledger_slots import SlotDecisions
from .ledger_state import Answer, LedgerState, Outcome, Phase, _fail_rows

log = logging.getLogger(__name__)


class Ledger(LedgerState):
    """The decisions over every request the pipeline holds (its state is `LedgerState`'s: built with the layout,
    `microbatch`, `token_slots`, `eos`, `pad`, the `admission` rule, the `epoch` and the slots' policy); its
    slots' are its parts': `slots` (admission and the stages' reports) and `resumes` (across a recovery)."""

    @functools.cached_property
    def slots(self) -> SlotDecisions:
        return SlotDecisions(self)

    @functools.cached_property
    def resumes(self) -> SlotResumes:
        return SlotResumes(self, self.slots)

    def in_flight(self) -> list[tuple[int, SlotBatch, str]]:
        """Each microbatch not yet ended, with its phase's name."""
        with self.lock:
            return [(number, flight.batch, flight.phase.value) for number, flight in sorted(self.flights.items())
                    if flight.phase is not Phase.ENDED]

    def holding_numbers(self) -> list[int]:
        with self.lock:
            return sorted(self.flights)

    def batch(self, number: int) -> SlotBatch:
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
        """What may start now: groups of waiting requests into slots with room, and new slots while the stages
        have room for them (`SlotDecisions.admissions`)."""
        with self.lock:
            if self.failure is not None or self.held:
                return []
            return self.slots.admissions(self.epoch())

    def cancel(self, request: Request) -> list[tuple[int, Message]]:
        """A request's caller cancelled it: a waiting one leaves the queue; a running row is ended at its next
        step (the first decoding stage passes the word on to the last; a microbatch not decoding yet carries
        the row as ended when it starts, and so does one that a recovery resumes)."""
        with self.lock:
            if request in self.waiting:
                self.waiting.remove(request)
                return []
            for flight in self.flights.values():  # a request left by one slot may be in another now
                batch = flight.batch
                row = batch.rows_of.get(request.number)
                if row is not None and row not in batch.settled and flight.phase is not Phase.ENDED:
                    return self.slots.cancel_member(flight, request)
        return []

    # ---- reports from the stages -----------------------------------------------------------------------
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
            if number in self.prompting:  # a group bound for a slot (disaggregated)
                outcome.answers = self.slots.group_failed(number, error)
                flight = None
            else:
                flight = self.flights.pop(number, None)
                if flight is None:
                    return outcome
                outcome.answers = _fail_rows(flight.batch, error)
            dropped = [number, *(self.slots.forget_groups(flight.batch) if flight is not None else ())]
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

    def seen_by_recovery(self, number: int) -> None:
        """A recovery resumed microbatch `number` (its messages went out), or sent a slot's group to the prompt
        pipeline again under that number: if the next recovery finds it without a new step since, it fails (the
        poison bound)."""
        with self.lock:
            group = self.prompting.get(number)  # a slot's group in the prompt pipeline counts for its slot
            flight = self.flights.get(number if group is None else group.slot)
            if flight is not None:
                flight.batch.seen_by_recovery = flight.batch.steps_received


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


def _status(number: int, batch: SlotBatch) -> dict[str, Any]:
    return {"microbatch": number, "rows": len(batch.held()), "steps": len(batch.rounds)}
