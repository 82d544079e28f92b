"""Recovery of a pipeline whose stage died or hung: the head replaces it and the microbatches go on.

The head runs one recovery at a time on a thread of its own, in the paper's four steps and a few of ours:

0. a new epoch: from now on, the head and the stages drop what was sent before it (steps in flight, tokens,
   prompt KV); a dead stage's process, when the pipeline launched it, is killed (a stopped or hung one
   included), and whatever a replaced worker started elsewhere still sends is dropped by its epoch;
1. every surviving stage pauses (`pause`): it finishes streaming its replicas and reports the caches it
   holds and how far the replicas it holds for the previous decoding stage reach; a survivor that does not
   answer is dead too;
2. each dead stage is replaced (a new process, which joins and loads its stage), and every survivor
   reconnects to it (`relink`); survivors keep their processes and memory;
3. per microbatch in flight, the head picks the step it resumes from (`resume_point`): the last position
   every stage can have again, the dead stage's from the replica its next decoding stage holds; the holder
   sends that replica back to the replacement (`send_replica` -> `restore`), and the previous stage streams
   its own cache to the replacement, which now holds its replica;
4. every decoding stage rewinds the microbatch to that position (`rewind`), and the head feeds it the token
   of that step: the microbatch goes on exactly as it would have.

A microbatch that cannot resume (still in the prompt pipeline, its replica lost with two adjacent stages,
or `recovery="recompute"`) starts over from its prompt, and gives the same tokens again; a request's
callback never sees a token twice. Each recovery is described by a `RecoveryReport`.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..errors import DejaVuError, TransportError
from .messages import Message
from .replication import assemble, held_positions, replica_stream

if TYPE_CHECKING:
    from ..generation.batching import Microbatch
    from .pipeline import Pipeline

log = logging.getLogger(__name__)

#: The ways a pipeline may recover from a dead stage.
RECOVERY = ("replicas", "recompute")
#: Seconds each wait of a recovery may take (for a replacement to join, to load the model, for answers).
STEP_TIMEOUT = 120.0
#: Attempts at one recovery (another stage dying or not answering meanwhile adds it to those replaced)
#: before the pipeline gives up and fails its requests.
ATTEMPTS = 3


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

    def describe(self) -> str:
        resumed = ", ".join(f"microbatch {number} from step {step}" for number, step in sorted(self.resumed.items()))
        return (f"recovered {', '.join(self.replaced) or 'no stage'} ({self.reason}) in {self.total:.2f} s: paused "
                f"{self.pausing:.2f} s, replaced {self.replacing:.2f} s, caches back {self.transferring:.2f} s; "
                f"resumed {resumed or 'none'}; recomputed {self.recomputed or 'none'}"
                + (f"; finished before it {self.finished}" if self.finished else "")
                + (f"; failed (no progress since the recovery before) {self.failed}" if self.failed else ""))


def resume_point(prompt: int, tokens: int, replicas: Sequence[int]) -> int | None:
    """The cache positions a microbatch resumes from: its `prompt` (padded) positions and the `tokens` the head
    holds give P + tokens - 1 positions on every surviving stage; each dead stage's replica reaches
    `replicas[i]`. None when some replica lacks part of the prompt (the microbatch starts over)."""
    positions = min([prompt + tokens - 1, *replicas])
    return positions if positions >= prompt and tokens >= 1 else None


def ended_rows(generated: Sequence[Sequence[int]], steps: int, limits: Sequence[int], eos: Sequence[int],
               dropped: Collection[int] = ()) -> torch.Tensor:
    """Which rows had ended once `steps` tokens were picked (as the last stage tracks it), the `dropped` ones
    (failed or cancelled) included."""
    return torch.tensor([any(token in eos for token in row[:steps]) or steps >= limit or index in dropped
                         for index, (row, limit) in enumerate(zip(generated, limits, strict=True))],
                        dtype=torch.uint8)


def no_progress(batch: Microbatch) -> bool:
    """Whether `batch` was in flight at the previous recovery too and got no new token since (the poison
    bound: it fails rather than be tried again). Marks it as seen by this recovery."""
    stuck = batch.seen_by_recovery == batch.steps_received
    batch.seen_by_recovery = batch.steps_received
    return stuck


class Recovery:
    """One recovery of `head`, run on its own thread: `run()` returns its report once every stage is ready to
    go on (the head then resumes the microbatches: `Pipeline.resume`)."""

    def __init__(self, head: Pipeline, dead: set[int], reason: str, detected: float) -> None:
        self.head, self.dead, self.reason, self.detected = head, set(dead), reason, detected
        self.epoch = 0
        self.replaced: set[int] = set()  # dead stages whose replacement process has started

    # ---- messages from the stages, routed here by the head's receiver -----------------------------------
    def _await(self, kind: str, senders: set[Any], key: str = "stage", blame: Any = None) -> dict[Any, Message]:
        """The replies of `kind` from every one of `senders` (by the field `key`), within STEP_TIMEOUT; a stage
        that fails or does not answer is dead (RecoveryRetry names it: the sender, or `blame` when the senders
        are not stages)."""
        replies: dict[Any, Message] = {}
        deadline = time.monotonic() + STEP_TIMEOUT
        while len(replies) < len(senders):
            self._check_open()
            exited = [index for index in self.head.exited() if index not in self.dead or index in self.replaced]
            if exited:
                raise RecoveryRetry(exited, f"the process of {self.head.stage_table[exited[0]].name} exited")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(senders - replies.keys(), key=str)
                stages = missing if blame is None else [blame]
                raise RecoveryRetry(stages, f"no {kind} from {', '.join(map(str, stages))} within "
                                    f"{STEP_TIMEOUT:.0f} s")
            try:
                message = self.head.replies.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if message.kind == "failed":
                raise RecoveryRetry([message.fields["stage"]], f"stage {message.fields['stage']} failed: "
                                    f"{message.fields['error']}")
            if message.kind == kind and int(message.fields.get("epoch", self.epoch)) == self.epoch:
                replies[message.fields[key]] = message
        return replies

    # ---- the steps ------------------------------------------------------------------------------------
    def run(self) -> RecoveryReport:
        head = self.head
        self.epoch = head.new_epoch()
        self.dead |= set(head.exited())
        for stage in self.dead:
            head.fence(stage)
        started = time.monotonic()
        survivors = [index for index in range(len(head.stage_table)) if index not in self.dead]
        log.info("epoch %d: pausing %s", self.epoch, [head.stage_table[index].name for index in survivors])
        paused = self._pause(survivors)
        pausing = time.monotonic() - started
        log.info("epoch %d: paused in %.3f s; replacing %s", self.epoch, pausing,
                 [head.stage_table[index].name for index in sorted(self.dead)])
        started = time.monotonic()
        self._replace(sorted(self.dead))
        for index in survivors:
            self._send(index, Message("relink", {"epoch": self.epoch, **head.links_of(index)}))
        self._await("relinked", {head.stage_table[index].name for index in survivors})
        replacing = time.monotonic() - started
        started = time.monotonic()
        resumed, recomputed, finished, failed = self._plan(paused)
        log.info("epoch %d: replaced in %.3f s; resuming %s, recomputing %s", self.epoch, replacing, resumed,
                 recomputed)
        decoding = head.decoding_stages()
        self._transfer(resumed, recomputed)
        gone = [number for number in head.holding_numbers() if number not in resumed]
        for index in decoding:
            self._send(index, Message("drop", {"epoch": self.epoch, "microbatches": gone}))
        self._rewind(resumed, decoding)
        transferring = time.monotonic() - started
        report = RecoveryReport(self.epoch, [head.stage_table[index].name for index in sorted(self.dead)],
                                self.reason, resumed, recomputed, finished, pausing, replacing, transferring,
                                time.monotonic() - self.detected, self.detected, failed)
        log.warning("%s", report.describe())
        return report

    def _replace(self, stages: list[int]) -> None:
        """New workers for `stages`: standbys, or processes launched now (or started by someone else)."""
        head = self.head
        self.replaced.update(stages)
        head.launch_replacements(stages)
        deadline = time.monotonic() + STEP_TIMEOUT
        for index in stages:  # every replacement in place before any is told its links
            while (spare := head.take_spare()) is None:
                self._check_open()
                if time.monotonic() > deadline:
                    raise RecoveryRetry([index], f"no worker joined to replace {head.stage_table[index].name} "
                                        f"within {STEP_TIMEOUT:.0f} s")
                time.sleep(0.01)
            head.place(index, *spare)
        for index in stages:
            self._send(index, Message("assign", head.assignment(index)))
        self._await("ready", set(stages))
        for index in stages:
            head.heard_from(index)

    def _pause(self, survivors: list[int]) -> dict[str, Message]:
        head = self.head
        numbers = head.holding_numbers()
        for index in survivors:
            previous = head.replica_owner(index)
            fields: dict[str, Any] = {"epoch": self.epoch, "microbatches": numbers, "replica_of": None}
            if previous is not None:
                fields.update(replica_of=head.stage_table[previous].number,
                              replica_layers=head.stage_table[previous].layer_count)
            self._send(index, Message("pause", fields))
        return self._await("paused", {head.stage_table[index].name for index in survivors})

    def _plan(self, paused: dict[str, Message]) -> tuple[dict[int, int], list[int], list[int], list[int]]:
        """Each microbatch in flight: the step it resumes from, or that it starts over, or that it has all its
        tokens already (its end crossed the recovery's start), or that it fails (poison: `no_progress`)."""
        head = self.head
        resumed: dict[int, int] = {}
        recomputed: list[int] = []
        finished: list[int] = []
        failed: list[int] = []
        decoding = head.decoding_stages()
        for number, batch, phase in head.in_flight_batches():
            prompt, tokens = batch.mask.shape[1], len(batch.generated[0])
            if tokens and bool(ended_rows(batch.generated, tokens, batch.max_new_tokens, head.eos,
                                          batch.dropped).all()):
                finished.append(number)
                continue
            if phase != "staged" and no_progress(batch):  # a staged one waits: it computes nothing to blame
                failed.append(number)
                continue
            point: int | None = None
            if head.recovery == "replicas" and phase == "decoding":
                survivors_hold = all(str(number) in paused[head.stage_table[index].name].fields["caches"]
                                     for index in decoding if index not in self.dead)
                replicas = [self._replica_reach(index, number, paused) for index in decoding if index in self.dead]
                point = resume_point(prompt, tokens, replicas) if survivors_hold else None
                if point is not None and batch.sampled and point - prompt + 1 not in batch.rng_states:
                    point = None  # the generator's state at that step is not known: start over
            if point is None:
                recomputed.append(number)
            else:
                resumed[number] = point - prompt + 1
        return resumed, recomputed, finished, failed

    def _replica_reach(self, index: int, number: int, paused: dict[str, Message]) -> int:
        """How far dead stage `index`'s replica of microbatch `number` reaches: in the replica store, or as its
        holder reported it (-1: gone with its holder)."""
        head, stage = self.head, self.head.stage_table[index]
        if head.replica_store is not None:
            stream = replica_stream(stage.number, number, head.replica_prefix)
            return held_positions(head.replica_store.keys(stream), stage.layer_count)
        holder = self._holder(index)
        if holder in self.dead:
            return -1
        return int(paused[head.stage_table[holder].name].fields["holds"].get(str(number), -1))

    def _transfer(self, resumed: dict[int, int], recomputed: list[int]) -> None:
        """Each replacement's caches, from the replicas its next decoding stage holds (or the replica store). A
        replica that cannot be read back sends its microbatch back to its prompt; a replacement that cannot be
        reached is dead too."""
        head = self.head
        for index in sorted(self.dead):
            if index not in head.decoding_stages() or not resumed:
                continue
            if head.replica_store is not None:
                self._restore_from_store(index, resumed, recomputed)
                continue
            holder, stage = self._holder(index), head.stage_table[index]
            for number, step in resumed.items():
                prompt = head.batch(number).mask.shape[1]
                self._send(holder, Message("send_replica", {
                    "epoch": self.epoch, "microbatch": number, "owner": stage.number, "layers": stage.layer_count,
                    "positions": prompt + step - 1, "to": head.url_of(index)}))
            sent = self._await("sent", set(resumed), key="microbatch", blame=holder)
            for number, reply in sent.items():
                if reply.fields.get("unreachable"):
                    raise RecoveryRetry([index], f"{stage.name}'s replacement is unreachable: {reply.fields['error']}")
                if reply.fields.get("error"):
                    log.warning("the replica of microbatch %d could not be read back (%s): it starts over", number,
                                reply.fields["error"])
                    del resumed[number]
                    recomputed.append(number)

    def _restore_from_store(self, index: int, resumed: dict[int, int], recomputed: list[int]) -> None:
        head, stage = self.head, self.head.stage_table[index]
        assert head.replica_store is not None  # only called with one
        for number, step in list(resumed.items()):
            positions = head.batch(number).mask.shape[1] + step - 1
            stream = replica_stream(stage.number, number, head.replica_prefix)
            try:
                block = assemble(head.replica_store, stream, stage.layer_count, positions)
            except DejaVuError as error:  # short or damaged: that microbatch starts over
                log.warning("the replica of microbatch %d could not be read back (%s): it starts over", number, error)
                del resumed[number]
                recomputed.append(number)
                continue
            self._send(index, Message("restore", {"microbatch": number, "epoch": self.epoch}, (block,)))

    def _check_open(self) -> None:
        if self.head.closed:
            raise TransportError("the pipeline was closed during its recovery")

    def _send(self, index: int, message: Message) -> None:
        """Send stage `index` a recovery message; one that cannot be reached is dead too."""
        try:
            self.head.send(index, message)
        except TransportError as error:
            name = self.head.stage_table[index].name
            raise RecoveryRetry([index], f"{name} is unreachable: {error}") from None

    def _holder(self, index: int) -> int:
        holder = self.head.replica_holder(index)
        assert holder is not None  # every decoding stage has one when recovering from replicas
        return holder

    def _rewind(self, resumed: dict[int, int], decoding: list[int]) -> None:
        head = self.head
        for number, step in resumed.items():
            batch = head.batch(number)
            ended = ended_rows(batch.generated, step, batch.max_new_tokens, head.eos, batch.dropped)
            rng = batch.rng_states.get(step, torch.empty(0, dtype=torch.uint8))  # greedy: no generator
            for index in decoding:
                holder = head.replica_holder(index)
                kept = head.replica_store is not None or (holder is not None and holder not in self.dead)
                replicated = batch.mask.shape[1] + step - 1 if kept else 0  # else streamed anew from 0
                self._send(index, Message("rewind", {
                    **batch.fields(), "epoch": self.epoch, "positions": batch.mask.shape[1] + step - 1,
                    "steps": step, "replicated": replicated}, (batch.mask, ended, rng)))
            self._await("rewound", {head.stage_table[index].name for index in decoding})


class RecoveryRetry(TransportError):
    """Stages (names or indices) that failed or did not answer a recovery step: dead as well, so the next
    attempt replaces them too."""

    def __init__(self, stages: list[Any], text: str) -> None:
        super().__init__(text)
        self.stages = stages

