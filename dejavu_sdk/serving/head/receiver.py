"""The head's side of its stages (`HeadReceiver`, a part of `Pipeline`): it carries out the ledger's decisions
(messages to send, futures to answer, tokens to stream), and its receiver thread takes what the workers send, each
class through its handler (`handlers`), and watches the stages between messages (processes, heartbeats, progress),
starting a recovery (`recoveries`, which it runs), or failing what is in flight, when one dies or hangs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ...backends import serve
from ...errors import ConfigError, StoreError, TransportError
from ...transports.base import Server
from ..kv.replication import delete_replicas
from ..options import PipelineOptions
from ..wire.link_tls import inbox_options
from ..wire.messages import (
    Enter,
    EpochMessage,
    Failed,
    Freed,
    Heartbeat,
    Join,
    LinkLost,
    Message,
    MicrobatchFailed,
    NotEntered,
    Paused,
    Prefill,
    Prefilled,
    Ready,
    Rejoin,
    Relinked,
    Rewound,
    RoundReport,
    Sent,
    Stats,
    Warm,
    unpack,
)
from .fleet import Fleet
from .hearing import Hearing
from .ledger import Ledger, Outcome, answer, stream
from .recoveries import Recoveries
from .recovery import RecoveryReport

log = logging.getLogger(__name__)

#: Seconds between the head's checks of its stages' processes, heartbeats and progress.
WATCH_PERIOD = 0.1
#: Messages about a microbatch's steps (and lost links): those of an epoch before the head's are dropped (a slot's
#: `RoundReport` counts until a recovery plans the slot: `Ledger.on_round`).
STEP_REPORTS = frozenset({Prefilled, Freed, LinkLost, MicrobatchFailed, NotEntered})


class HeadReceiver:
    """The head's dealings with its stages, over the pipeline's parts: `fleet` (the workers), `ledger` (the
    decisions) and the recoveries it starts (`recoveries`; their steps' answers go to `replies`). `closed()` says
    whether the pipeline was closed; `on_entered()`, `on_failure()` and `on_recovery()` give the pipeline's
    callbacks (or None). Its inbox (`inbox`, where workers join and report) opens at `listen`."""

    def __init__(self, options: PipelineOptions, fleet: Fleet, ledger: Ledger, closed: Callable[[], bool],
                 on_entered: Callable[[], Callable[[int, list[int], list[Any]], object] | None],
                 on_failure: Callable[[], Callable[[str], None] | None],
                 on_recovery: Callable[[], Callable[[RecoveryReport], None] | None]) -> None:
        self.options, self.layout, self.fleet, self.ledger = options, options.layout, fleet, ledger
        self.closed, self.on_entered = closed, on_entered
        self.replies: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.recoveries = Recoveries(ledger, fleet, self.replies, self.fail, self.send, self.admit, closed,
                                     lambda reason: _call_quietly(on_failure(), reason),
                                     lambda report: _call_quietly(on_recovery(), report), options.eos,
                                     options.rules.pad)
        self.inbox: Server | None = None
        self.thread: threading.Thread | None = None
        self.hearing = Hearing()

    def listen(self) -> str:
        """Open the inbox (once), and say where it is."""
        if self.inbox is None:
            links = self.options.links
            self.inbox = serve(f"{links.transport}://{links.host}:{links.port}", token=links.token,
                               **inbox_options(links.tls))
        return self.inbox.url

    def start(self) -> None:
        """Start the receiver thread (`receive`)."""
        self.thread = threading.Thread(target=self.receive, name="dejavu-pipeline-head", daemon=True)
        self.thread.start()

    def close(self, holding: list[int]) -> None:
        """Once the pipeline is closed: let the receiver thread end, close the inbox, and delete what the
        microbatches `holding` rows (left in flight) replicated into a replica store: a closed pipeline leaves
        nothing behind."""
        if self.thread is not None:
            self.thread.join(timeout=5)
        if self.inbox is not None:
            self.inbox.close()
        resilience = self.options.resilience
        if resilience.replica_store is not None:
            decoding = [stage.number for stage in self.layout.stages if stage.decodes]
            delete_replicas(resilience.replica_store, decoding, holding, resilience.replica_prefix)

    @functools.cached_property
    def handlers(self) -> dict[type[Message], Callable[[Any], None]]:
        """What the head's receiver does with each message a worker sends it, one handler per class; the stages'
        answers to a recovery's steps go to the recovery thread."""
        return {
            Join: self.fleet.pool_spare, Rejoin: self.fleet.turn_away, Warm: self.fleet.warm,
            Heartbeat: self._on_heartbeat, Stats: self.fleet.stats_arrived, Failed: self._on_failed,
            LinkLost: self._on_link_lost, RoundReport: self._on_round,
            Prefilled: self._on_prefilled, Freed: self._on_freed,
            MicrobatchFailed: self._on_microbatch_failed, NotEntered: self._on_not_entered,
            **dict.fromkeys((Paused, Relinked, Sent, Rewound, Ready), self.replies.put)}

    # ---- carrying out the ledger's decisions -------------------------------------------------------------
    def admit(self) -> None:
        """Send what the ledger admits; a stage that cannot be reached starts a recovery (or fails the pipeline),
        which decides where what was admitted goes on from."""
        for stage, message in self.ledger.admit():
            if isinstance(message, (Prefill, Enter)):
                self._report_admitted(message.microbatch,
                                      message.group.members if isinstance(message, Enter) else None)
            try:
                self.send(stage, message)
            except (TransportError, StoreError) as error:  # StoreClosed: closed meanwhile
                failure = f"{self.layout.stages[stage].name} is unreachable: {error}"
                if self.options.resilience.recovery is None or self.closed():
                    self.fail(TransportError(failure))
                else:
                    self.recoveries.start(set(), failure)
                return

    def _report_admitted(self, number: int, members: list[int] | None) -> None:
        """Tell `on_entered` of a group of `members` sent into slot `number` (mixed: a disaggregated group goes to
        the prompt pipeline under a number of its own), before the message goes out."""
        flight = self.ledger.flights.get(number)
        try:
            if flight is None:  # disaggregated, a group for the prompt pipeline (numbered apart from its slot)
                return
            batch = flight.batch
            on_entered = self.on_entered()
            if members is not None and on_entered is not None:
                on_entered(number, list(members), [batch.requests[batch.rows_of[member]].tag for member in members])
        except Exception:
            log.exception("the pipeline's on_entered callback failed")

    def send(self, index: int, message: Message) -> None:
        """Send a step's message (it carries the epoch it was decided in)."""
        self.fleet.send(index, message)

    def carry_out(self, outcome: Outcome) -> None:
        """Stream the outcome's tokens, answer its futures, and send its messages (a stage that does not take
        one is the watchdog's to find)."""
        stream(outcome.calls)
        answer(outcome.answers)
        for index, message in outcome.sends:
            with contextlib.suppress(TransportError, StoreError):
                self.send(index, message)

    def fail(self, error: TransportError) -> None:
        """Fail every request in flight or waiting with `error`; later submissions raise it too."""
        answer(self.ledger.fail_all(error))

    # ---- what the stages say ---------------------------------------------------------------------------
    def receive(self) -> None:
        """The head's receiver thread: takes the workers' messages, and watches them between messages."""
        watched = time.monotonic()
        while not self.closed():
            message = self._take(WATCH_PERIOD)
            try:
                if message is not None:
                    self._handle(message)
                if time.monotonic() - watched >= WATCH_PERIOD:
                    watched = time.monotonic()
                    self._watch()
            except Exception as error:  # a malformed message or a broken link: fail the requests, never hang them
                self.fail(error if isinstance(error, TransportError) else
                           TransportError(f"the pipeline's head failed: {type(error).__name__}: {error}"))

    def _take(self, timeout: float) -> Message | None:
        """The next message in the inbox within `timeout` seconds (None: none came, or it was unreadable). The time
        until the next take is the head's pause in listening (`hearing`), and so is a wake later than `timeout` (the
        thread waited for a core)."""
        assert self.inbox is not None
        asked = time.monotonic()
        self.hearing.listening(asked)
        try:
            packed = self.inbox.recv_tensor(timeout=timeout)
        except TransportError:  # a quiet inbox
            packed = None
        took = time.monotonic()
        self.hearing.deaf(took if packed is not None else min(took, asked + timeout))
        return None if packed is None else _readable(packed)

    def _handle(self, message: Message) -> None:
        """Do what a worker's message asks (its class's handler in `handlers`)."""
        if isinstance(message, EpochMessage) and type(message) in STEP_REPORTS and message.epoch < self.fleet.epoch:
            return  # sent before a recovery, which decided where its microbatch goes on from
        handler = self.handlers.get(type(message))
        if handler is None:
            log.warning("the head dropped a message of unexpected kind %r", message.kind)
        else:
            handler(message)

    def _on_round(self, message: RoundReport) -> None:
        """A slot's round: rows may have left, and room for others be free."""
        self.carry_out(self.ledger.slots.on_round(message.microbatch, message.done, message.tokens.tolist(),
                                             message.states, message.epoch, message.scores))
        self.admit()

    def _on_heartbeat(self, message: Heartbeat) -> None:
        """A stage's heartbeat; one from a worker replaced since (stopped, cut off, now back) tells it to exit."""
        if message.url is not None and not self.fleet.serves(message.stage, message.url, message.epoch):
            self.fleet.fence_stale(message.url, message.stage, message.epoch)
        else:
            self.fleet.beat(message.stage, message.epoch, message.work)

    def _on_link_lost(self, message: LinkLost) -> None:
        self.recoveries.start(set(), f"{message.stage} lost a link: {message.error}", message.epoch)

    def _on_not_entered(self, message: NotEntered) -> None:
        self.ledger.slots.on_not_entered(message.microbatch, list(message.members))
        self.admit()

    def _on_prefilled(self, message: Prefilled) -> None:
        """A group's first tokens from the prompt pipeline: it goes to its slot (`on_entered` hears of it first)."""
        outcome = self.ledger.slots.on_group_prefilled(message)
        for _, entering in outcome.sends:
            if isinstance(entering, Enter):
                self._report_admitted(entering.microbatch, entering.group.members)
        self.carry_out(outcome)
        self.admit()

    def _on_freed(self, message: Freed) -> None:
        self.ledger.on_freed(message.microbatch)
        self.admit()

    def _on_microbatch_failed(self, message: MicrobatchFailed) -> None:
        self.carry_out(self.ledger.on_microbatch_failed(message.microbatch, message.error))
        self.admit()

    def _on_failed(self, message: Failed) -> None:
        failure = f"stage {message.stage} failed: {message.error}"
        try:
            index = self.layout.index_of(message.stage)
        except ConfigError:
            log.warning("%s", failure)  # not a stage's worker: a spare that could not load, say
            return
        if self.fleet.replaced_since(self.layout.stages[index].name, message.epoch):
            return  # a worker replaced since (one started elsewhere cannot be stopped from here)
        if self.options.resilience.recovery is None:
            self.fail(TransportError(failure))
        elif self.recoveries.running:
            self.replies.put(message)
        else:
            self.recoveries.start({index}, failure, message.epoch)

    def _watch(self) -> None:
        """Find stages that are dead or hung: a process that exited, a stage silent for `missed_beats`
        heartbeats, or a microbatch without progress (no new tokens) for `progress_timeout` seconds while no
        stage's heartbeats said it ran a layer, each counting only the time the head listened (`hearing`). Recover
        from them, or, without recovery, fail the requests in flight."""
        if self.recoveries.running:
            return  # the recovery watches its own steps
        exited, silent = self.fleet.exited(), self._silent()
        now, stalled = time.monotonic(), self.ledger.stalled_since()
        reasons = [f"the process of {self.layout.stages[index].name} exited" for index in exited]
        reasons += [f"{name} sent no heartbeat for {self.hearing.listened(last, now):.1f} s "
                    f"({self.options.watch.missed_beats} missed): its process is dead or hung" for last, name in silent]
        limit = self.options.watch.progress_timeout
        if stalled is not None and self.hearing.listened(stalled, now) > limit \
                and self.hearing.listened(self.fleet.worked_at, now) > limit:
            reasons.append(f"a microbatch made no progress for {limit:.0f} s and no stage computed meanwhile: a stage "
                           "worker is stuck (progress_timeout)")
        if not reasons:
            return
        if self.options.resilience.recovery is None:
            raise TransportError(reasons[0])
        self.recoveries.start(set(exited) | {self.layout.index_of(name) for _, name in silent}, "; ".join(reasons))

    def _silent(self) -> list[tuple[float, str]]:
        """The stages silent for `missed_beats` heartbeats of the time the head listened."""
        now = time.monotonic()
        return self.fleet.silent(lambda last: self.hearing.listened(last, now))


def _readable(packed: torch.Tensor) -> Message | None:
    """The message in `packed`, or None (with a warning) when it is none a pipeline sends: it costs that message."""
    try:
        return unpack(packed)
    except TransportError as error:
        log.warning("the head dropped what it received: %s", error)
        return None


def _call_quietly(callback: Callable[[Any], None] | None, argument: Any) -> None:
    """Call a user's callback; its failure is logged, and stops nothing."""
    if callback is not None:
        try:
            callback(argument)
        except Exception:
            log.exception("a pipeline callback failed")
