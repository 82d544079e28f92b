"""A successor head takes over the static microbatches that its predecessor's stage workers still hold.

A head (a controller with a journal) that dies leaves its stage workers running: they keep their stage, each
static microbatch's cache and, on the last stage, its picker and every step's tokens, and rejoin the head started
at the same address (`bootstrap`). The successor knows from its journal which rows (request, choice) each
microbatch had, and its adopted requests wait in its ledger under the same names (`Request.tag`). `take_over`:

1. a new epoch: every stage pauses, reporting the microbatches it holds (cache positions) and, the last stage, the
   step each is at and every step's tokens;
2. a microbatch goes on when every decoding stage holds it up to the last stage's step and a row of it still
   runs: it is rebuilt with its former number, its rows the waiting requests of its rows' names (a row whose
   choice ended stands in, dropped), its tokens the last stage's;
3. every decoding stage rewinds it to that step (`rewind` with `keep`: the last stage goes on with its own picker,
   so sampled rows go on from their generators' states as they were); every other microbatch is dropped
   everywhere, and its requests, still waiting, are computed again from their prompts;
4. the ledger feeds each the token of its step, and admission starts.

A request's tokens come to its callback again from the first (the controller's run checks them against what the
journal held, and streams the rest); nothing here is a guess: a microbatch that any stage cannot continue exactly
starts over.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from ..errors import TransportError
from ..generation.batching import Microbatch, Request
from .ledger import Ledger
from .ledger_state import Flight, Phase
from .messages import Kind, Message
from .recovery import Recovery

log = logging.getLogger(__name__)


@attrs.frozen
class TakeoverReport:
    """What a successor took over: each microbatch that went on from its stages' caches, with the step it went on
    from (`resumed`), the names (tags) of the requests in them, and those left to their prompts (`dropped`: every
    microbatch a stage held that did not go on, with why)."""

    resumed: dict[int, int] = attrs.field(factory=dict)
    tags: list[Any] = attrs.field(factory=list)
    dropped: dict[int, str] = attrs.field(factory=dict)


class Takeover:
    """One takeover, on the caller's thread, through a `Recovery`'s bounded sends and waits (a stage that fails or
    does not answer ends it: what was not taken over yet is computed again)."""

    def __init__(self, ledger: Ledger, steps: Recovery, rows: Mapping[int, Sequence[Any]],
                 stand_in: Callable[[Any], Request | None]) -> None:
        self.ledger, self.steps, self.layout = ledger, steps, steps.layout
        self.rows, self.stand_in = rows, stand_in
        self.report = TakeoverReport()

    def run(self) -> TakeoverReport:
        ledger, layout = self.ledger, self.layout
        while not self.steps.replies.empty():  # what came before this epoch answers nothing of it
            self.steps.replies.get_nowait()
        with ledger.lock:
            self.steps.epoch = self.steps.fleet.new_epoch()
        held: set[int] = set()
        try:
            paused = self._pause()
            held = {int(number) for reply in paused.values() for number in reply.fields["caches"]}
            for number in sorted(self.rows):
                batch = self._rebuild(number, paused)
                if isinstance(batch, str):
                    self._cannot(number, batch)
                elif self._rewind(batch):
                    self._go_on(batch)
        except TransportError as error:  # a stage died or did not answer: the watchdog's to recover
            log.warning("taking over the stages' microbatches stopped: %s", error)
        gone = sorted((held | set(self.rows)) - set(self.report.resumed))
        for number in gone:
            self.report.dropped.setdefault(number, "not taken over")
        with ledger.lock:  # the numbers of microbatches the stages held are not given again
            ledger.renumber_from(max([*held, *self.rows, -1]) + 1)
        for index in layout.decoding_stages():
            self._send_quietly(index, Message(Kind.DROP, {"epoch": self.steps.epoch, "microbatches": gone}))
        return self.report

    def _pause(self) -> dict[str, Message]:
        stages = self.layout.stages
        for index in range(len(stages)):
            self.steps.send(index, Message(Kind.PAUSE, {"epoch": self.steps.epoch, "microbatches": sorted(self.rows),
                                                        "replica_of": None}))
        return self.steps.wait(Kind.PAUSED, {stage.name for stage in stages})

    def _rebuild(self, number: int, paused: dict[str, Message]) -> Microbatch | str:
        """Microbatch `number` as its predecessor had it, from the waiting requests of its rows' names and the
        last stage's tokens; or why it cannot go on exactly."""
        decoding = [self.layout.stages[index].name for index in self.layout.decoding_stages()]
        reported = paused[decoding[-1]].fields.get("steps", {}).get(str(number))
        if reported is None:
            return "the last stage does not hold it"
        step, history = int(reported[0]), reported[1]
        requests: list[Request] = []
        live: list[Request] = []
        with self.ledger.lock:
            waiting = {_key(request.tag): request for request in self.ledger.waiting if request.tag is not None}
        for tag in self.rows[number]:
            request = waiting.get(_key(tag)) if tag is not None else None
            if request is not None:
                live.append(request)
            else:
                request = self.stand_in(tag) if tag is not None else None
                if request is None:
                    return f"its row {tag} is not in the journal"
            requests.append(request)
        if not live:
            return "none of its rows runs"
        if any(request.decoding.logprobs is not None or request.decoding.prompt_logprobs is not None
               for request in live):
            return "its rows' log-probabilities so far are in no cache"
        if len(history) != step or any(len(tokens) != len(requests) for tokens in history):
            return f"the last stage's tokens do not fit its {len(requests)} rows"
        batch = Microbatch.of(number, requests, self.ledger.pad)
        positions = batch.mask.shape[1] + step - 1
        short = [name for name in decoding if int(paused[name].fields["caches"].get(str(number), -1)) < positions]
        if short:
            return f"{', '.join(short)} hold less than its {positions} positions"
        batch.generated = [list(row) for row in zip(*history, strict=True)]
        batch.arrived = [time.monotonic()] * step
        stand_ins = {row for row, request in enumerate(requests) if all(request is not other for other in live)}
        batch.settled.update(stand_ins)
        batch.dropped.update(stand_ins)
        return batch

    def _rewind(self, batch: Microbatch) -> bool:
        """Every decoding stage goes on with `batch` from the last stage's step; whether all can."""
        step = len(batch.arrived)
        fields = {**batch.fields(), "epoch": self.steps.epoch, "positions": batch.mask.shape[1] + step - 1,
                  "steps": step, "replicated": 0, "keep": True}
        message = Message(Kind.REWIND, fields, (batch.mask, torch.zeros(len(batch.requests), dtype=torch.uint8),
                                                torch.empty(0, dtype=torch.uint8)))
        decoding = self.layout.decoding_stages()
        for index in decoding:
            self.steps.send(index, message)
        replies = self.steps.wait(Kind.REWOUND, {self.layout.stages[index].name for index in decoding})
        errors = [str(reply.fields["error"]) for reply in replies.values() if reply.fields.get("error")]
        if errors:
            self._cannot(batch.number, "; ".join(errors))
            return False
        return True

    def _go_on(self, batch: Microbatch) -> None:
        """Put `batch` in the ledger, its requests out of the waiting queue."""
        ledger, now = self.ledger, time.monotonic()
        with ledger.lock:
            ours = {id(request) for row, request in enumerate(batch.requests) if row not in batch.settled}
            ledger.waiting = deque(request for request in ledger.waiting if id(request) not in ours)
            for row, request in enumerate(batch.requests):
                if row not in batch.settled:
                    request.started = now
            reserved = ledger.admission.reserve(batch.requests)
            ledger.flights[batch.number] = Flight(batch, Phase.DECODING, reserved, now)
            ledger.most_in_flight = max(ledger.most_in_flight, len(ledger.holding()))
        self.report.resumed[batch.number] = len(batch.arrived)
        self.report.tags.extend(request.tag for row, request in enumerate(batch.requests) if row not in batch.settled)

    def _cannot(self, number: int, why: str) -> None:
        log.info("microbatch %d is computed again from its prompts: %s", number, why)
        self.report.dropped[number] = why

    def _send_quietly(self, index: int, message: Message) -> None:
        try:
            self.steps.send(index, message)
        except TransportError as error:  # the watchdog finds a stage gone
            log.warning("%s", error)


def _key(tag: Any) -> str:
    """A tag as a key (tags are JSON values: lists as the journal gives them back, tuples as written)."""
    return repr(list(tag) if isinstance(tag, (list, tuple)) else tag)
