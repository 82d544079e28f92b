"""A stage worker: one process that holds one pipeline stage and runs every microbatch through it.

Life of a worker (`bootstrap.run_worker`: `python -m dejavu_sdk.serving.processes.bootstrap --join URL`, as launchers
start it, or `dejavu worker --join URL`):
1. serve an inbox, and send the head `Join` with its address;
2. take the head's `Assign`: the model, its layers, and where its output goes; load the model, keep its
   stage, connect to its neighbours; send `Ready`;
3. run messages until `Shutdown` (`StageWorker.run`, this module), each through its class's handler
   (`StageWorker.handlers`). Every microbatch is a slot (`worker.slots`): the head opens it with a group of
   requests (`OpenSlot`, later groups `Enter`), and each round (`SlotRound`) runs the stage on its rows' next
   positions and a joining group's prompt columns and goes on to the next stage; the last stage picks the
   tokens, reports the round to the head (`RoundReport`) and sends the next round back to the first stage. The
   slot's policy is the pipeline's batching: continuous batching lets rows leave as they end and groups join;
   a static slot's rows stay, ended ones as padding, until the last ends. An idle slot that no group is bound
   for is ended by the head (`End` through the stages, the last answering `Freed`).
   Disaggregated, a prompt stage runs only `Prefill`, streaming each finished layer's KV to the token stages
   (`Kv`), and its last stage sends the first tokens to the head (`Prefilled`); a token stage keeps the KV it
   receives until the group enters its slot, which takes it in instead of computing it.
A worker that cannot reach a neighbour, or whose stage fails, tells the head (`Failed`) and stops: the head
fails the requests in flight (a neighbour gone because the head is closing the pipeline is no failure: the
worker's own `Shutdown` follows). One that cannot reach the head raises `HeadGone`, and waits as an orphan for a
successor (`bootstrap.run_worker`).

With recovery (`recovery` in the assignment), decoding stages replicate their caches around the ring
(`replication.Replicator`), a neighbour that cannot be reached is reported (`LinkLost`) instead of ending
the worker, and the head's recovery messages drive it (`worker.recovery`). What the worker holds between
messages is `worker.state.WorkerState`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ...errors import ReplicationError, TransportError
from ..wire.messages import (
    AskRejoin,
    AskStats,
    Cancel,
    Drop,
    End,
    Enter,
    EpochMessage,
    Failed,
    Fenced,
    Kv,
    LinkLost,
    Message,
    MicrobatchFailed,
    MicrobatchMessage,
    OpenSlot,
    Pause,
    Prefill,
    Relink,
    Restore,
    RewindSlot,
    SendReplica,
    Shutdown,
    SlotRound,
    Stats,
    pack,
    unpack,
)
from .prompt_steps import PromptSteps
from .recovery import RecoverySteps
from .slot_recovery import SlotRewinds
from .slots import SlotHandlers
from .state import HeadGone, Role

__all__ = ["QUIET", "Role", "StageWorker", "failure_message"]  # Role is worker.state's, named here with the worker

log = logging.getLogger(__name__)

#: Seconds a worker's loop waits on a quiet inbox before it checks that its heartbeats and KV sends still go.
QUIET = 2.0
#: Seconds a worker that lost a neighbour (without recovery) waits for its own `Shutdown` before it counts the
#: loss a failure: the head tells the stages to stop one after another.
STOP_GRACE = 2.0

Step = TypeVar("Step", bound=MicrobatchMessage)


def failure_message(stage: str, error: BaseException, epoch: int = 0) -> torch.Tensor:
    """The `Failed` message that tells the head which stage failed (in which epoch), and why."""
    return pack(Failed(stage=stage, epoch=epoch, error=f"{type(error).__name__}: {error}"))


class StageWorker(SlotHandlers):
    """Runs one assigned stage: `run()` returns when the head says `shutdown`. Its constructor and state are
    `WorkerState`'s, and the slots' steps `SlotHandlers`'; its parts, each on that state, handle the rest: a
    prompt stage's prefills (`prompts`), the head's recovery messages (`recovery_steps`) and a slot's rewind
    (`rewinds`)."""

    @functools.cached_property
    def prompts(self) -> PromptSteps:
        return PromptSteps(self)

    @functools.cached_property
    def recovery_steps(self) -> RecoverySteps:
        return RecoverySteps(self)

    @functools.cached_property
    def rewinds(self) -> SlotRewinds:
        return SlotRewinds(self)

    @functools.cached_property
    def handlers(self) -> dict[type[Message], Callable[[Any], None]]:
        """What the worker does with each message it may receive: one handler per class. The steps of a microbatch
        run through `_run_step`: what they raise fails that microbatch, not the stage."""
        return {
            Shutdown: self._shutdown, AskRejoin: self._asked_to_rejoin, Fenced: self._fenced, AskStats: self._stats,
            Prefill: self._as_step(self._prefill_of_role), OpenSlot: self._as_step(self._open_slot),
            Enter: self._enter_group, SlotRound: self._as_step(self._slot_round), Kv: self._receive_kv,
            Cancel: self._cancel, End: self._end,
            Pause: self.recovery_steps.pause, Relink: self.recovery_steps.relink,
            SendReplica: self.recovery_steps.send_replica, Restore: self.recovery_steps.restore,
            Drop: self.recovery_steps.drop, RewindSlot: self.rewinds.rewind_slot}

    def run(self) -> None:
        while True:
            try:  # with prompt columns to run, a look at the inbox only: they run between its messages
                packed = self.inbox.recv_tensor(timeout=0.0 if self.prompt_turns else QUIET)
            except TransportError:  # a quiet inbox
                packed = None
            try:
                if self.heartbeat is not None:
                    self.heartbeat.check()
                if self.thread_share is not None:
                    self.thread_share.adjust()
                message = None if packed is None else self._readable(packed)
                if message is not None:  # handled before the KV sender's check: a failed send loses no message
                    self.handle(message)
                    if self.stopped:
                        return
                if self.prompt_turns:
                    self._run_step(self.prompt_turns[0], self.prompts.turn)
                if self.sender is not None:
                    self.sender.check()
            except HeadGone:  # nobody to tell: the worker waits for a successor, or stops
                raise
            except (TransportError, ReplicationError) as error:  # a neighbour, the replica holder or the head
                if not self.recovery:
                    self.tell_head(failure_message(self.role.name, error, self.epoch))
                    if self._told_to_stop():  # the neighbour had stopped because the pipeline is closing
                        return
                    raise
                self._link_lost(error)
            except Exception as error:  # a bad message, or the stage failed: tell the head
                self.tell_head(failure_message(self.role.name, error, self.epoch))
                raise

    def _told_to_stop(self) -> bool:
        """Whether the head's `Shutdown` (or `Fenced`) is in the inbox or comes within STOP_GRACE seconds. A
        closing head tells every worker to stop, and a neighbour may take its word and go before this worker
        has posted its last step to it: that lost post is the pipeline's end, not a failure (exit 0). The
        inbox's other messages are dropped: the worker is ending either way."""
        deadline = time.monotonic() + STOP_GRACE
        while (left := deadline - time.monotonic()) > 0:
            try:
                packed = self.inbox.recv_tensor(timeout=left)
            except TransportError:  # quiet for the whole grace: a failure, which the head has been told
                return False
            if isinstance(self._readable(packed), (Shutdown, Fenced)):
                return True
        return False

    def _readable(self, packed: torch.Tensor) -> Message | None:
        """The message in `packed`, or None (with a warning) when it is none a pipeline sends: bytes that a holder
        of the links' token sent by mistake or malice cost that message, not the stage."""
        try:
            return unpack(packed)
        except TransportError as error:
            log.warning("%s dropped what it received: %s", self.role.name, error)
            return None

    def tell_head(self, message: torch.Tensor) -> None:
        """Send the head a packed message; HeadGone if it cannot be reached (then none is left to tell)."""
        try:
            self.head.send_tensor(message)
        except TransportError as error:
            raise HeadGone(f"the head cannot be reached: {error}") from error

    def _link_lost(self, error: BaseException) -> None:
        """A neighbour could not be reached: tell the head once per epoch, and wait for its recovery."""
        if self.reported_epoch < self.epoch:
            self.reported_epoch = self.epoch
            self.tell_head(pack(LinkLost(stage=self.role.name, epoch=self.epoch, error=str(error))))

    def handle(self, message: Message) -> None:
        """Do what `message` asks (its class's handler), unless it was sent before a recovery, which decided where
        its microbatch goes on from."""
        if isinstance(message, EpochMessage) and message.epoch < self.epoch:
            log.debug("%s dropped a %r of epoch %d (now %d)", self.role.name, message.kind, message.epoch, self.epoch)
            return
        handler = self.handlers.get(type(message))
        if handler is None:
            self._unexpected(message)
        handler(message)

    # ---- the worker's life --------------------------------------------------------------------------------
    def _shutdown(self, message: Shutdown) -> None:
        self.stopped = True

    def _asked_to_rejoin(self, message: AskRejoin) -> None:
        raise HeadGone("a new head listens at the head's address and asks this worker to rejoin")

    def _fenced(self, message: Fenced) -> None:
        log.warning("%s: another worker has served this stage since epoch %d (this one was stopped or cut off "
                    "meanwhile): exiting", self.role.name, message.epoch)
        self.stopped = True

    def _stats(self, message: AskStats) -> None:
        figures = {"stage": self.role.name, "row_steps": self.row_steps, "staged_kv": len(self.staged),
                   "threads": torch.get_num_threads(), "threads_follow_load": self.thread_share is not None,
                   "prefix_tiers": self.prefixes.cache.stats() if self.prefixes is not None else [],
                   **self.caches.stats()}
        self.head.send_tensor(pack(Stats(stage=self.role.name, figures=figures)))

    # ---- a microbatch's steps ----------------------------------------------------------------------------
    def _as_step(self, step: Callable[[Step], None]) -> Callable[[Step], None]:
        """`step` as a handler, run through `_run_step` for the message's microbatch."""
        return lambda message: self._run_step(message.microbatch, lambda: step(message))

    def _run_step(self, number: int, compute: Callable[[], None]) -> None:
        """Run `compute`, a step of microbatch `number`. What it raises fails that microbatch alone (the head
        hears `microbatch_failed` and its other stages drop it); a lost link is the stage's, and goes on up."""
        try:
            compute()
        except (TransportError, ReplicationError):
            raise
        except Exception as error:
            log.exception("%s failed on microbatch %d", self.role.name, number)
            self.forget(number)
            self.head.send_tensor(pack(MicrobatchFailed(
                microbatch=number, stage=self.role.name, epoch=self.epoch,
                error=f"{self.role.name} failed on it: {type(error).__name__}: {error}")))

    def _prefill_of_role(self, message: Prefill) -> None:
        """A group's prompts, disaggregated: a prompt stage prefills them in chunks."""
        if self.role.kind != "prompt":
            self._unexpected(message)
        self.prompts.prefill(message)

    def _slot_round(self, message: SlotRound) -> None:
        if not self.role.decodes:
            self._unexpected(message)
        self._round(message)

    def _cancel(self, message: Cancel) -> None:
        """End rows of a slot at its next round (their requests were cancelled)."""
        self.cancels.cancel_rows(message.microbatch, message.rows)

    def _end(self, message: End) -> None:
        """The head ended an idle slot: free its cache, and pass the word on."""
        if not self.role.decodes:
            self._unexpected(message)
        self._end_slot(message)

    def _receive_kv(self, message: Kv) -> None:
        number = message.microbatch
        if self.role.kind != "token":
            self._unexpected(message)
        if number in self.failed:  # a piece a failed microbatch's prompt stage sent before it failed
            return
        staged = self._staged(number)
        staged.add(self.stage.layers[0], message.layers, message.piece, message.last)
        if staged.complete and staged.start is not None:  # a round that waited for this KV
            self.handlers[type(staged.start)](staged.start)
