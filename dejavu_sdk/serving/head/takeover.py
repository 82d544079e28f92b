"""A successor head takes over the slots that its predecessor's stage workers still hold.

A head (a controller with a journal) that dies leaves its stage workers running: they keep their stage, each
slot's cache, and, on the last stage, the pickers (the generators of sampled rows) and every round's report, and
rejoin the head started at the same address (`bootstrap`). The successor knows from its journal which groups each
slot was sent (with the request numbers the stages know them by), and its adopted requests wait in its ledger under
the same names (`Request.tag`). `take_over`:

1. a new epoch: every stage pauses, reporting the slots it holds (rounds run), and the last stage each slot's round
   reports;
2. a slot is rebuilt as its predecessor built it (its policy the pipeline's batching): its groups entered in order
   (its requests under their former numbers; a row whose choice ended stands in, dropped), then every round the
   last stage reported taken in as the ledger takes a round; it then goes on as after a recovery
   (`recovery_slots`: a stage that no worker took back, which died with the head, gets its part from the replicas
   its neighbour holds; every stage goes back to right after that round; the groups whose prefill had not begun
   are sent again);
3. everything else the stages hold is dropped, and its requests, still waiting, are computed again from their
   prompts; the ledger starts each slot's next round, and admission starts.

A request's tokens come to its callback again from the first (the controller's run checks them against what the
journal held, and streams the rest; under disaggregation a group's first tokens, which the prompt pipeline picked,
are in the last token stage's reports too); nothing here is a guess: what any stage cannot continue exactly starts
over (as do groups still in the prompt pipeline, and rows that asked for log-probabilities).
"""

from __future__ import annotations

import collections
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ...errors import TransportError
from ...generation.batching import Request, new_request_number, number_requests_from
from ...generation.logprobs import Scores
from ...generation.slot_batch import SlotBatch
from ..wire.messages import Drop, Message, Paused, RoundDone
from .ledger import Ledger
from .ledger_state import POISON, Flight, Outcome, Phase
from .recovery import Recovery
from .recovery_slots import SlotRecovery

log = logging.getLogger(__name__)


@attrs.frozen
class TakeoverReport:
    """What a successor took over: each microbatch (slot) that went on from its stages' caches, with the round it
    went on with (`resumed`), the names (tags) of the requests in them, those left to their prompts (`dropped`:
    every microbatch a stage held that did not go on, with why), and what their rounds so far give their requests
    (`outcome`: their tokens, and the answers of rows that ended).
    """

    resumed: dict[int, int] = attrs.field(factory=dict)
    tags: list[Any] = attrs.field(factory=list)
    dropped: dict[int, str] = attrs.field(factory=dict)
    outcome: Outcome = attrs.field(factory=Outcome)
    #: What stopped it before the end (a stage that died or did not answer), for a recovery to mend; None if nothing.
    failure: str | None = None


class Takeover:
    """One takeover, on the caller's thread, through a `Recovery`'s bounded sends and waits (a stage that fails or
    does not answer ends it: what was not taken over yet is computed again)."""

    def __init__(self, ledger: Ledger, steps: Recovery, groups: Mapping[int, Sequence[tuple[Sequence[int],
                                                                                         Sequence[Any]]]],
                 stand_in: Callable[[Any], Request | None]) -> None:
        self.ledger, self.steps, self.layout = ledger, steps, steps.layout
        self.groups, self.stand_in = groups, stand_in
        self.report = TakeoverReport()
        named = [_key(tag) for slot in groups.values() for _, tags in slot for tag in tags if tag is not None]
        #: Names in more than one row (a request taken out of a slot's queue and sent elsewhere): not taken over.
        self.twice = {key for key, count in collections.Counter(named).items() if count > 1}
        self._replays: dict[int, Outcome] = {}

    def run(self) -> TakeoverReport:
        ledger, layout = self.ledger, self.layout
        while not self.steps.replies.empty():  # what came before this epoch answers nothing of it
            self.steps.replies.get_nowait()
        with ledger.lock:
            self.steps.epoch = self.steps.fleet.new_epoch()
        # the stages no worker took back hold nothing: as in a recovery, their caches come from the replicas
        self.steps.dead = {index for index, stage in enumerate(layout.stages) if stage.name not in
                           self.steps.fleet.rejoined}
        held: set[int] = set()
        try:
            paused = self.steps.pause(list(range(len(layout.stages))), takeover=True)
            held = {number for reply in paused.values() for number in reply.slots}
            self._take_slots(paused)
        except TransportError as error:  # a stage died or did not answer: a recovery's to mend, after this
            log.warning("taking over the stages' microbatches stopped: %s", error)
            for number in [number for number in self._replays if number not in self.report.resumed]:
                self._give_back(number, str(error))
            self.report = attrs.evolve(self.report, failure=f"while taking over: {error}")
        self._renumber_requests()
        gone = sorted((held | set(self.groups)) - set(self.report.resumed))
        for number in gone:
            self.report.dropped.setdefault(number, "not taken over")
        with ledger.lock:  # the numbers of microbatches the stages held are not given again
            ledger.renumber_from(max([*held, *self.groups, -1]) + 1)
        kept = sorted(self.report.resumed)
        for index in layout.decoding_stages():  # all else they hold goes, even what they did not report
            self._send_quietly(index, Drop(epoch=self.steps.epoch, microbatches=gone, all_but=kept))
        return self.report

    def _renumber_requests(self) -> None:
        """Number new requests past the slots' members (their former numbers, which the stages know), and give
        the waiting requests that hold one of those a new number."""
        members = {int(member) for slot in self.groups.values() for numbers, _ in slot for member in numbers}
        if not members:
            return
        number_requests_from(max(members) + 1)
        with self.ledger.lock:
            for request in self.ledger.waiting:
                if request.number in members:
                    request.number = new_request_number()


    def _row(self, tag: Any, waiting: dict[str, Request], live: list[Request]) -> Request | str:
        """The request of a row named `tag`: the one waiting under that name (added to `live`), or a stand-in for
        one that ended; or why there is none."""
        if tag is not None and _key(tag) in self.twice:
            return f"its row {tag} was sent into more than one microbatch"
        request = waiting.get(_key(tag)) if tag is not None else None
        if request is not None:
            live.append(request)
            return request
        request = self.stand_in(tag) if tag is not None else None
        return request if request is not None else f"its row {tag} is not in the journal"

    def _take_slots(self, paused: dict[str, Paused]) -> None:
        """Rebuild each slot from the groups sent into it and the last stage's reports of its rounds (the ledger
        takes them in as it took them from the stages), then go on as a recovery with no stage lost does: from
        right after the last round, every stage rewinding there (`recovery_slots`)."""
        if not self.groups:
            return
        last = self.layout.stages[self.layout.decoding_stages()[-1]].name
        reports = paused[last].reports
        for number in sorted(self.groups):
            why = self._rebuild_slot(number, reports.get(number))
            if why is not None:
                self._cannot(number, why)
        if not self._replays:
            return
        slots = SlotRecovery(self.steps)
        slots.plan(paused, POISON)
        for number, why in slots.lost.items():
            self._give_back(number, why)
        slots.transfer()  # a stage that died with the head: its pieces, from the replicas its neighbour holds
        slots.rewind(self.layout.decoding_stages())
        for number, why in slots.lost.items():
            if number in self._replays:
                self._give_back(number, why)
        for number, (batch, _) in slots.resumed.items():
            self.report.resumed[number] = len(batch.rounds)
            outcome = self._replays.pop(number)
            self.report.outcome.calls.extend(outcome.calls)
            self.report.outcome.answers.extend(outcome.answers)
            self.report.tags.extend(request.tag for row, request in enumerate(batch.requests)
                                    if row not in batch.dropped)

    def _rebuild_slot(self, number: int, reports: list[tuple[RoundDone, list[int], Scores]] | None) -> str | None:
        """Slot `number` in the ledger, its groups entered as its predecessor sent them and its rounds taken in
        from the last stage's reports (what they give the requests kept for later); or why it cannot be."""
        if not reports:
            return "the last stage knows none of its rounds (none ran, or a recovery rebuilt it there)"
        with self.ledger.lock:
            waiting = {_key(request.tag): request for request in self.ledger.waiting if request.tag is not None}
        batch = SlotBatch.open(number, self.ledger.pad, self.ledger.policy)
        live: list[Request] = []
        for members, tags in self.groups[number]:
            group = []
            for member, tag in zip(members, tags, strict=True):
                request = self._row(tag, waiting, live)
                if isinstance(request, str):
                    return request
                request.number = int(member)  # as the stages know it
                group.append(request)
            batch.groups.append(batch.enter(group))
        why = _why_not(live)
        if why is not None:
            return why
        unknown = _named(reports) - set(batch.rows_of)
        if unknown:  # a group sent just before the head died, its record not written
            return f"its rounds name requests {sorted(unknown)} that the journal does not hold"
        ours = {id(request) for request in live}
        for row, request in enumerate(batch.requests):
            if id(request) not in ours:  # a stand-in: its choice ended
                batch.settled.add(row)
                batch.dropped.add(row)
        batch.opened = True
        with self.ledger.lock:
            _cancelled_meanwhile(batch, self.ledger.waiting)
            self.ledger.waiting = deque(request for request in self.ledger.waiting if id(request) not in ours)
            self.ledger.flights[number] = Flight(batch, Phase.DECODING, 0, time.monotonic())
        replay = self._replays[number] = Outcome()
        for done, tokens, scores in reports:
            taken = self.ledger.slots.on_round(number, done, list(tokens), scores=scores)
            replay.calls.extend(taken.calls)
            replay.answers.extend(taken.answers)
        return None

    def _give_back(self, number: int, why: str) -> None:
        """A slot that does not go on: out of the ledger, what its rounds gave forgotten, its requests waiting
        again (computed again from their prompts)."""
        self._replays.pop(number, None)
        self._cannot(number, why)
        with self.ledger.lock:
            flight = self.ledger.flights.pop(number, None)
            if flight is None:
                return
            again = [request for row, request in enumerate(flight.batch.requests) if row not in flight.batch.dropped]
            for request in again:
                request.streamed = 0
            self.ledger.waiting.extendleft(reversed(again))

    def _cannot(self, number: int, why: str) -> None:
        log.info("microbatch %d is computed again from its prompts: %s", number, why)
        self.report.dropped[number] = why

    def _send_quietly(self, index: int, message: Message) -> None:
        try:
            self.steps.send(index, message)
        except TransportError as error:  # the watchdog finds a stage gone
            log.warning("%s", error)


def _cancelled_meanwhile(batch: SlotBatch, waiting: deque[Request]) -> None:
    """Rows of `batch` whose request left the waiting queue since it was read (its caller cancelled it): settled
    and dropped, so that the stages end them (under the ledger's lock)."""
    still = {id(request) for request in waiting}
    for row, request in enumerate(batch.requests):
        if row not in batch.settled and id(request) not in still:
            batch.settled.add(row)
            batch.dropped.add(row)


def _named(reports: list[tuple[RoundDone, list[int], Scores]]) -> set[int]:
    """Every request number a slot's round reports name."""
    named: set[int] = set()
    for done, _, _ in reports:
        step, (left, joined) = done.round, done.next
        named.update(done.members, done.complete, step.left, step.joined, step.decoded, left, joined or (),
                     step.prefill[0] if step.prefill else ())
    return named


def _why_not(live: list[Request]) -> str | None:
    """Why a microbatch or slot whose rows still running are `live` is not taken over, or None."""
    return "none of its rows runs" if not live else None


def _key(tag: Any) -> str:
    """A tag as a key (tags are JSON values: lists as the journal gives them back, tuples as written)."""
    return repr(list(tag) if isinstance(tag, (list, tuple)) else tag)
