"""Recovery of a pipeline whose stage died or hung: the head replaces it and the microbatches go on.

The head runs one recovery at a time on a thread of its own (`recoveries.Recoveries`), in the paper's four steps and
a few of ours:

0. a new epoch: from now on, the head and the stages drop what was sent before it (rounds in flight, reports,
   prompt KV); a dead stage's process, when the pipeline launched it, is killed (a stopped or hung one
   included), and whatever a replaced worker started elsewhere still sends is dropped by its epoch;
1. every surviving stage pauses (`Pause`) and reports the rounds of each slot it holds; a survivor that does not
   answer is dead too;
2. each dead stage is replaced (a new process, which joins and loads its stage), and every survivor
   reconnects to it (`Relink`); survivors keep their processes and memory;
3. per slot in flight, the head traces where it goes on from (`recovery_slots`: right after the last round it
   heard of, from the slot's schedule), and the holder of each dead stage's replica sends that stage's pieces of
   it to the replacement (`SendReplica` -> `Restore`);
4. every decoding stage rewinds the slot there (`RewindSlot`), and the head starts its next round: the slot goes
   on exactly as it would have.

A slot that cannot go on (its replica lost with two adjacent stages, `recovery="recompute"`, a stage that ran
rounds the head never heard of) is computed again: a static slot's microbatch starts over from its prompts, a
continuous slot's rows go on in other slots from their prompts and the tokens they have; a request's callback
never sees a token twice. A slot in flight at the previous recovery too, without a new round since, fails instead
(the poison bound). Each recovery is described by a `RecoveryReport`.

The coordinator (`Recovery`) works through the ledger (what is in flight), the fleet (the processes, links and
spares) and the layout (who holds whose replicas).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from ...errors import TransportError
from ..wire.messages import (
    Assign,
    Drop,
    EpochMessage,
    Failed,
    Message,
    Pause,
    Paused,
    Ready,
    Relink,
    Relinked,
)
from .fleet import Fleet
from .ledger import Ledger
from .ledger_state import POISON
from .recovery_slots import SlotRecovery

log = logging.getLogger(__name__)
#: Seconds each wait of a recovery may take (for a replacement to join, to load the model, for answers).
STEP_TIMEOUT = 120.0
#: Attempts at one recovery (another stage dying or not answering meanwhile adds it to those replaced)
#: before the pipeline gives up and fails its requests.
ATTEMPTS = 3

Reply = TypeVar("Reply", bound=EpochMessage)


def by_stage(reply: Any) -> str:
    """The stage that sent a recovery step's answer (`Paused`, `Relinked`, `Ready`, `Sent`, `Rewound`)."""
    return str(reply.stage)


@attrs.frozen
class RecoveryReport:
    """What one recovery did: the `epoch` it began, the stages it replaced and why, which microbatches (slots)
    went on from where they were (`resumed`: each with the round it went on with), which could not (`recomputed`:
    each with why; a static microbatch starts over from its prompts, a continuous slot's rows go on in other slots
    from their prompts and the tokens they have, unless it is poison: in flight at the recovery before too,
    without a new token since), and how long each part took, in seconds: `pausing` the survivors, `replacing`
    (placing the replacements and relinking), `transferring` the caches and rewinding, and `total` from the
    detection until every stage was ready to go on; `detected` is the `time.monotonic()` of the detection."""

    epoch: int
    replaced: list[str]
    reason: str
    resumed: dict[int, int]
    recomputed: dict[int, str]
    pausing: float
    replacing: float
    transferring: float
    total: float
    detected: float

    def describe(self) -> str:
        resumed = ", ".join(f"microbatch {number} at round {step}" for number, step in sorted(self.resumed.items()))
        recomputed = "; ".join(f"microbatch {number} ({why})" for number, why in sorted(self.recomputed.items()))
        return (f"recovered {', '.join(self.replaced) or 'no stage'} ({self.reason}) in {self.total:.2f} s: paused "
                f"{self.pausing:.2f} s, replaced {self.replacing:.2f} s, caches back {self.transferring:.2f} s; "
                f"resumed {resumed or 'none'}; recomputed {recomputed or 'none'}")


class Recovery:
    """One recovery, run on the head's recovery thread: `run()` returns its report once every stage is ready to
    go on (the ledger then resumes the microbatches). `replies` are the stages' answers, routed here by the
    head's receiver; `assignment(index)` is what a replacement for stage `index` is told; `closed()` whether
    the pipeline was closed meanwhile."""

    def __init__(self, ledger: Ledger, fleet: Fleet, replies: queue.SimpleQueue[Message], dead: set[int],
                 reason: str, detected: float, assignment: Callable[[int], Assign],
                 closed: Callable[[], bool]) -> None:
        self.ledger, self.fleet, self.layout, self.replies = ledger, fleet, fleet.layout, replies
        self.options = fleet.options
        self.dead, self.reason, self.detected = set(dead), reason, detected
        self.assignment, self.closed = assignment, closed
        self.epoch = 0
        self.replaced: set[int] = set()  # dead stages whose replacement process has started

    # ---- messages from the stages, routed here by the head's receiver -----------------------------------
    def _await(self, kind: type[Reply], senders: set[Any], key: Callable[[Reply], Any] = by_stage,
               blame: Any = None) -> dict[Any, Reply]:
        """The replies of class `kind` in this epoch from every one of `senders` (as `key` names a reply's
        sender), within STEP_TIMEOUT; a stage that fails or does not answer is dead (RecoveryRetry names it: the
        sender, or `blame` when the senders are not stages). Other messages are of no use to this step."""
        replies: dict[Any, Reply] = {}

        def answered(reply: Reply) -> None:
            if reply.epoch == self.epoch:
                replies[key(reply)] = reply

        def failed(message: Failed) -> None:
            raise RecoveryRetry([message.stage], f"stage {message.stage} failed: {message.error}")

        handlers: dict[type[Message], Callable[[Any], None]] = {Failed: failed, kind: answered}
        deadline = time.monotonic() + STEP_TIMEOUT
        while len(replies) < len(senders):
            self._check_open()
            exited = [index for index in self.fleet.exited() if index not in self.dead or index in self.replaced]
            if exited:
                raise RecoveryRetry(exited, f"the process of {self.layout.stages[exited[0]].name} exited")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(senders - replies.keys(), key=str)
                stages = missing if blame is None else [blame]
                raise RecoveryRetry(stages, f"no {kind.kind} from {', '.join(map(str, stages))} within "
                                    f"{STEP_TIMEOUT:.0f} s")
            try:
                message = self.replies.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            handler = handlers.get(type(message))
            if handler is not None:
                handler(message)
        return replies

    # ---- the steps ------------------------------------------------------------------------------------
    def run(self) -> RecoveryReport:
        fleet, stages = self.fleet, self.layout.stages
        with self.ledger.lock:  # what the ledger decided before carries the old epoch, and is dropped
            self.epoch = fleet.new_epoch()
        self.dead |= set(fleet.exited())
        for stage in self.dead:
            fleet.fence(stage)
        started = time.monotonic()
        survivors = [index for index in range(len(stages)) if index not in self.dead]
        log.info("epoch %d: pausing %s", self.epoch, [stages[index].name for index in survivors])
        paused = self.pause(survivors)
        pausing = time.monotonic() - started
        log.info("epoch %d: paused in %.3f s; replacing %s", self.epoch, pausing,
                 [stages[index].name for index in sorted(self.dead)])
        started = time.monotonic()
        self._replace(sorted(self.dead))
        for index in survivors:
            self._send(index, Relink(epoch=self.epoch, links=fleet.links_of(index)))
        self._await(Relinked, {stages[index].name for index in survivors})
        replacing = time.monotonic() - started
        started = time.monotonic()
        slots = SlotRecovery(self)
        slots.plan(paused, POISON)
        log.info("epoch %d: replaced in %.3f s; resuming %s, recomputing %s", self.epoch, replacing,
                 sorted(slots.resumed), sorted(slots.lost))
        decoding = self.layout.decoding_stages()
        slots.transfer()
        gone = [number for number in self.ledger.holding_numbers()
                if number not in slots.resumed and number not in slots.unopened]
        for index in decoding:
            self._send(index, Drop(epoch=self.epoch, microbatches=gone))
        slots.rewind(decoding)
        failed_rewinds = [number for number in slots.lost if number not in gone]
        if failed_rewinds:
            for index in decoding:
                self._send(index, Drop(epoch=self.epoch, microbatches=failed_rewinds))
        transferring = time.monotonic() - started
        report = RecoveryReport(self.epoch, [stages[index].name for index in sorted(self.dead)], self.reason,
                                {**{number: len(batch.rounds) for number, (batch, _) in slots.resumed.items()},
                                 **dict.fromkeys(slots.unopened, 0)},
                                dict(slots.lost), pausing, replacing, transferring, time.monotonic() - self.detected,
                                self.detected)
        log.warning("%s", report.describe())
        return report

    def _replace(self, dead: list[int]) -> None:
        """New workers for the `dead` stages: standbys, or processes launched now (or started by someone else)."""
        fleet = self.fleet
        self.replaced.update(dead)
        fleet.launch_replacements(dead)
        deadline = time.monotonic() + STEP_TIMEOUT
        for index in dead:  # every replacement in place before any is told its links
            while (spare := fleet.take_spare()) is None:
                self._check_open()
                if time.monotonic() > deadline:
                    raise RecoveryRetry([index], f"no worker joined to replace {self.layout.stages[index].name} "
                                        f"within {STEP_TIMEOUT:.0f} s")
                time.sleep(0.01)
            fleet.place(index, spare)
        for index in dead:
            self._send(index, self.assignment(index))
        self._await(Ready, {self.layout.stages[index].name for index in dead})
        for index in dead:
            fleet.heard_from(index)

    def pause(self, survivors: list[int], takeover: bool = False) -> dict[str, Paused]:
        """Pause the `survivors` in this epoch: each reports the slots it holds; for a `takeover`, the last stage
        also what a successor head goes on from (its slots' round reports)."""
        for index in survivors:
            self._send(index, Pause(epoch=self.epoch, takeover=takeover))
        return self._await(Paused, {self.layout.stages[index].name for index in survivors})

    def send(self, index: int, message: Message) -> None:
        """Send stage `index` a recovery message (`_send`)."""
        self._send(index, message)

    def wait(self, kind: type[Reply], senders: set[Any], key: Callable[[Reply], Any] = by_stage,
             blame: Any = None) -> dict[Any, Reply]:
        """The replies of class `kind` from every one of `senders` (`_await`)."""
        return self._await(kind, senders, key, blame)

    def dead_too(self, index: int, reason: str) -> None:
        """Stage `index` is dead as well: this attempt stops, and the next replaces it too."""
        raise RecoveryRetry([index], reason)

    def _check_open(self) -> None:
        if self.closed():
            raise TransportError("the pipeline was closed during its recovery")

    def _send(self, index: int, message: Message) -> None:
        """Send stage `index` a recovery message; one that cannot be reached is dead too."""
        try:
            self.fleet.send(index, message)
        except TransportError as error:
            raise RecoveryRetry([index], f"{self.layout.stages[index].name} is unreachable: {error}") from None


class RecoveryRetry(TransportError):
    """Stages (names or indices) that failed or did not answer a recovery step: dead as well, so the next
    attempt replaces them too."""

    def __init__(self, stages: list[Any], text: str) -> None:
        super().__init__(text)
        self.stages = stages
