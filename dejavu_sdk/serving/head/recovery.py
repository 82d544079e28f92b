"""Recovery of a pipeline whose stage died or hung: the head replaces it and the microbatches go on.

The head runs one recovery at a time on a thread of its own (`recoveries.Recoveries`), in the paper's four steps and
a few of ours:

0. a new epoch: from now on, the head and the stages drop what was sent before it (steps in flight, tokens,
   prompt KV); a dead stage's process, when the pipeline launched it, is killed (a stopped or hung one
   included), and whatever a replaced worker started elsewhere still sends is dropped by its epoch;
1. every surviving stage pauses (`Pause`): it finishes streaming its replicas and reports the caches it
   holds and how far the replicas it holds for the previous decoding stage reach; a survivor that does not
   answer is dead too;
2. each dead stage is replaced (a new process, which joins and loads its stage), and every survivor
   reconnects to it (`Relink`); survivors keep their processes and memory;
3. per microbatch in flight, the head picks the step it resumes from (`resume_point`): the last position
   every stage can have again, the dead stage's from the replica its next decoding stage holds; the holder
   sends that replica back to the replacement (`SendReplica` -> `Restore`), and the previous stage streams
   its own cache to the replacement, which now holds its replica;
4. every decoding stage rewinds the microbatch to that position (`Rewind`), and the head feeds it the token
   of that step: the microbatch goes on exactly as it would have.

A microbatch that cannot resume (still in the prompt pipeline, its replica lost with two adjacent stages,
or `recovery="recompute"`) starts over from its prompt, and gives the same tokens again; a request's
callback never sees a token twice. A microbatch in flight at the previous recovery too, without a new token
since, fails instead (the poison bound). Each recovery is described by a `RecoveryReport`.

The coordinator (`Recovery`) works through the ledger (what is in flight), the fleet (the processes, links and
spares) and the layout (who holds whose replicas); where each microbatch goes on from is decided by
`plan_resume`, a pure function of what the survivors and replicas hold.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch

from ...errors import DejaVuError, TransportError
from ...generation.slot_batch import SlotBatch
from ..kv.replication import assemble, held_positions, replica_stream
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
    Restore,
    Rewind,
    Rewound,
    SendReplica,
    Sent,
)
from .fleet import Fleet
from .ledger import POISON, Ledger
from .recovery_slots import SlotRecovery
from .resume import ResumePlan, ended_rows, plan_resume

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
    """What one recovery did: the `epoch` it began, the stages it replaced and why, which microbatches resumed
    at which step (`resumed`: microbatch -> the step whose token it was fed again), which started over from
    their prompts (`recomputed`), which had every token already (`finished`: their end crossed the
    recovery), which failed (`failed`: in flight at the recovery before too, without a new token since: the
    poison bound), and how long each part took, in seconds: `pausing` the survivors,
    `replacing` (placing the replacements and relinking), `transferring` the caches and rewinding, and
    `total` from the detection until every stage was ready to go on; `detected` is the `time.monotonic()` of
    the detection."""

    epoch: int
    replaced: list[str]
    reason: str
    resumed: dict[int, int]
    recomputed: list[int]
    finished: list[int]
    pausing: float
    replacing: float
    transferring: float
    total: float
    detected: float
    failed: list[int] = attrs.field(factory=list)
    #: Continuous batching: each slot that went on, with the round it went on with, and each that could not, why
    #: (its rows go on in other slots from their prompts and tokens, unless it is poison).
    slots: dict[int, int] = attrs.field(factory=dict)
    lost: dict[int, str] = attrs.field(factory=dict)

    def describe(self) -> str:
        resumed = ", ".join(f"microbatch {number} from step {step}" for number, step in sorted(self.resumed.items()))
        return (f"recovered {', '.join(self.replaced) or 'no stage'} ({self.reason}) in {self.total:.2f} s: paused "
                f"{self.pausing:.2f} s, replaced {self.replacing:.2f} s, caches back {self.transferring:.2f} s; "
                f"resumed {resumed or 'none'}; recomputed {self.recomputed or 'none'}"
                + (f"; slots going on at rounds {self.slots}" if self.slots else "")
                + (f"; slots computed again {self.lost}" if self.lost else "")
                + (f"; finished before it {self.finished}" if self.finished else "")
                + (f"; failed (no progress since the recovery before) {self.failed}" if self.failed else ""))


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
        plan = self._plan(paused)
        log.info("epoch %d: replaced in %.3f s; resuming %s, recomputing %s", self.epoch, replacing, plan.resumed,
                 plan.recomputed)
        slots = SlotRecovery(self)
        slots.plan(paused, POISON)
        decoding = self.layout.decoding_stages()
        self._transfer(plan.resumed, plan.recomputed)
        slots.transfer()
        gone = [number for number in self.ledger.holding_numbers()
                if number not in plan.resumed and number not in slots.resumed and number not in slots.unopened]
        for index in decoding:
            self._send(index, Drop(epoch=self.epoch, microbatches=gone))
        self._rewind(plan.resumed, decoding)
        slots.rewind(decoding)
        failed_rewinds = [number for number in slots.lost if number not in gone]
        if failed_rewinds:
            for index in decoding:
                self._send(index, Drop(epoch=self.epoch, microbatches=failed_rewinds))
        transferring = time.monotonic() - started
        report = RecoveryReport(self.epoch, [stages[index].name for index in sorted(self.dead)], self.reason,
                                plan.resumed, plan.recomputed, plan.finished, pausing, replacing, transferring,
                                time.monotonic() - self.detected, self.detected, plan.failed,
                                {**{number: len(batch.rounds) for number, (batch, _) in slots.resumed.items()},
                                 **dict.fromkeys(slots.unopened, 0)},
                                dict(slots.lost))
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

    def pause(self, survivors: list[int], numbers: list[int] | None = None,
              takeover: bool = False) -> dict[str, Paused]:
        """Pause the `survivors` in this epoch: each reports what it holds, and how far the replicas it holds of
        `numbers` (default: the ledger's microbatches) for the previous decoding stage reach; for a `takeover`,
        the last stage also what a successor head goes on from (steps, tokens, rounds)."""
        numbers = self.ledger.holding_numbers() if numbers is None else numbers
        for index in survivors:
            previous = self.layout.replica_owner(index)
            owner = None if previous is None else self.layout.stages[previous]
            self._send(index, Pause(epoch=self.epoch, microbatches=numbers, takeover=takeover,
                                    replica_of=None if owner is None else owner.number,
                                    replica_layers=0 if owner is None else owner.layer_count))
        return self._await(Paused, {self.layout.stages[index].name for index in survivors})

    def _plan(self, paused: dict[str, Paused]) -> ResumePlan:
        """`plan_resume` over what the survivors reported."""
        survivors = [index for index in self.layout.decoding_stages() if index not in self.dead]
        static = [flight for flight in self.ledger.in_flight() if not isinstance(flight[1], SlotBatch)]
        return plan_resume(
            static, self.dead, self.layout, self.options.recovery, self.ledger.eos,
            lambda number: all(number in paused[self.layout.stages[index].name].caches for index in survivors),
            lambda index, number: self._replica_reach(index, number, paused))

    def _replica_reach(self, index: int, number: int, paused: dict[str, Paused]) -> int:
        """How far dead stage `index`'s replica of microbatch `number` reaches: in the replica store, or as its
        holder reported it (-1: gone with its holder)."""
        stage, store = self.layout.stages[index], self.options.replica_store
        if store is not None:
            return held_positions(store.keys(replica_stream(stage.number, number, self.options.replica_prefix)),
                                  stage.layer_count)
        holder = self._holder(index)
        if holder in self.dead:
            return -1
        return paused[self.layout.stages[holder].name].holds.get(number, -1)

    def _transfer(self, resumed: dict[int, int], recomputed: list[int]) -> None:
        """Each replacement's caches, from the replicas its next decoding stage holds (or the replica store). A
        replica that cannot be read back sends its microbatch back to its prompt; a replacement that cannot be
        reached is dead too."""
        for index in sorted(self.dead):
            if index not in self.layout.decoding_stages() or not resumed:
                continue
            if self.options.replica_store is not None:
                self._restore_from_store(index, resumed, recomputed)
                continue
            holder, stage = self._holder(index), self.layout.stages[index]
            for number, step in resumed.items():
                prompt = self.ledger.batch(number).mask.shape[1]
                self._send(holder, SendReplica(epoch=self.epoch, microbatch=number, owner=stage.number,
                                               layers=stage.layer_count, positions=prompt + step - 1,
                                               to=self.fleet.url_of(index)))
            sent = self._await(Sent, set(resumed), key=lambda reply: reply.microbatch, blame=holder)
            for number, reply in sent.items():
                if reply.unreachable:
                    raise RecoveryRetry([index], f"{stage.name}'s replacement is unreachable: {reply.error}")
                if reply.error:
                    log.warning("the replica of microbatch %d could not be read back (%s): it starts over", number,
                                reply.error)
                    del resumed[number]
                    recomputed.append(number)

    def _restore_from_store(self, index: int, resumed: dict[int, int], recomputed: list[int]) -> None:
        stage, store = self.layout.stages[index], self.options.replica_store
        assert store is not None  # only called with one
        for number, step in list(resumed.items()):
            positions = self.ledger.batch(number).mask.shape[1] + step - 1
            stream = replica_stream(stage.number, number, self.options.replica_prefix)
            try:
                block = assemble(store, stream, stage.layer_count, positions)
            except DejaVuError as error:  # short or damaged: that microbatch starts over
                log.warning("the replica of microbatch %d could not be read back (%s): it starts over", number, error)
                del resumed[number]
                recomputed.append(number)
                continue
            self._send(index, Restore(microbatch=number, epoch=self.epoch, block=block))

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

    def _holder(self, index: int) -> int:
        holder = self.layout.replica_holder(index)
        assert holder is not None  # every decoding stage has one when recovering from replicas
        return holder

    def _rewind(self, resumed: dict[int, int], decoding: list[int]) -> None:
        for number, step in resumed.items():
            batch = self.ledger.batch(number)
            ended = ended_rows(batch.generated, step, batch.max_new_tokens, self.ledger.eos, batch.dropped)
            rng = batch.rng_states.get(step, torch.empty(0, dtype=torch.uint8))  # greedy: no generator
            for index in decoding:
                holder = self.layout.replica_holder(index)
                kept = self.options.replica_store is not None or (holder is not None and holder not in self.dead)
                replicated = batch.mask.shape[1] + step - 1 if kept else 0  # else streamed anew from 0
                self._send(index, Rewind(microbatch=number, specs=batch.row_specs(), epoch=self.epoch,
                                         positions=batch.mask.shape[1] + step - 1, steps=step, replicated=replicated,
                                         generated=[row[:step] for row in batch.generated], mask=batch.mask,
                                         ended=ended, rng=rng))
            self._await(Rewound, {self.layout.stages[index].name for index in decoding})


class RecoveryRetry(TransportError):
    """Stages (names or indices) that failed or did not answer a recovery step: dead as well, so the next
    attempt replaces them too."""

    def __init__(self, stages: list[Any], text: str) -> None:
        super().__init__(text)
        self.stages = stages
