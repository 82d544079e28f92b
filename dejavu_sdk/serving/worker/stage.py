"""A stage worker: one process that holds one pipeline stage and runs every microbatch through it.

Life of a worker (`bootstrap.run_worker`: `python -m dejavu_sdk.serving.processes.bootstrap --join URL`, as launchers
start it, or `dejavu worker --join URL`):
1. serve an inbox, and send the head `Join` with its address;
2. take the head's `Assign`: the model, its layers, and where its output goes; load the model, keep its
   stage, connect to its neighbours; send `Ready`;
3. run messages until `Shutdown` (`StageWorker.run`, this module), each through its class's handler
   (`StageWorker.handlers`): `Prefill` (a new microbatch: its ids or hidden states, mask and rows' limits) and
   `Decode` (one more position) run the stage and go on to the next stage; on the last stage they become the
   next tokens, which go to the head (`Tokens`) and back to the first stage as the next `Decode`, or, once every
   row has ended, `Ended` to the head and `End` through the other stages, which free the microbatch's caches.
   Disaggregated, a prompt stage runs only `Prefill`, streaming each finished layer's KV to the token stages
   (`Kv`), and its last stage sends the first tokens to the head (`Prefilled`); a token stage keeps the KV it
   receives until the head's `Start` (the first tokens) arrives, then decodes the microbatch as above.
A worker that cannot reach a neighbour, or whose stage fails, tells the head (`Failed`) and stops: the head
fails the requests in flight. One that cannot reach the head raises `HeadGone`, and waits as an orphan for a
successor (`bootstrap.run_worker`).

With recovery (`recovery` in the assignment), decoding stages replicate their caches around the ring
(`replication.Replicator`), a neighbour that cannot be reached is reported (`LinkLost`) instead of ending
the worker, and the head's recovery messages drive it (`worker.recovery`). What the worker holds between
messages is `worker.state.WorkerState`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch

from ...errors import ReplicationError, TransportError
from ...generation.logprobs import Scores
from ...generation.picker import TokenPicker
from ...generation.stage import position_ids
from ...swapping import positions_needed
from ..wire.messages import (
    AskRejoin,
    AskStats,
    Cancel,
    Decode,
    Drop,
    End,
    Ended,
    Enter,
    EpochMessage,
    Failed,
    Fenced,
    Freed,
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
    Rewind,
    RewindSlot,
    SendReplica,
    Shutdown,
    SlotRound,
    Start,
    Stats,
    Tokens,
    pack,
    unpack,
)
from .prompt_steps import PromptSteps
from .recovery import RecoveryHandlers
from .slots import SlotHandlers
from .state import HeadGone, MicrobatchState, Role

__all__ = ["QUIET", "Role", "StageWorker", "failure_message"]  # Role is worker.state's, named here with the worker

log = logging.getLogger(__name__)

#: Seconds a worker's loop waits on a quiet inbox before it checks that its heartbeats and KV sends still go.
QUIET = 2.0

Step = TypeVar("Step", bound=MicrobatchMessage)


def failure_message(stage: str, error: BaseException, epoch: int = 0) -> torch.Tensor:
    """The `Failed` message that tells the head which stage failed (in which epoch), and why."""
    return pack(Failed(stage=stage, epoch=epoch, error=f"{type(error).__name__}: {error}"))


class StageWorker(RecoveryHandlers, SlotHandlers, PromptSteps):
    """Runs one assigned stage: `run()` returns when the head says `shutdown`. Its constructor and state are
    `WorkerState`'s; the head's recovery messages are handled by `RecoveryHandlers`, a continuous pipeline's
    slots by `SlotHandlers`, a prompt stage's prefills by `PromptSteps`."""

    @functools.cached_property
    def handlers(self) -> dict[type[Message], Callable[[Any], None]]:
        """What the worker does with each message it may receive: one handler per class. The steps of a microbatch
        run through `_run_step`: what they raise fails that microbatch, not the stage."""
        return {
            Shutdown: self._shutdown, AskRejoin: self._asked_to_rejoin, Fenced: self._fenced, AskStats: self._stats,
            Prefill: self._as_step(self._prefill_of_role), OpenSlot: self._as_step(self._open_slot),
            Enter: self._enter_group, SlotRound: self._as_step(self._slot_round), Decode: self._as_step(self._decode),
            Start: self._as_step(self._start), Kv: self._receive_kv, Cancel: self._cancel, End: self._end,
            Pause: self._pause, Relink: self._relink, SendReplica: self._send_replica, Restore: self._restore,
            Drop: self._drop, Rewind: self._rewind, RewindSlot: self._rewind_slot}

    def run(self) -> None:
        while True:
            try:  # with prompt columns to run, a look at the inbox only: they run between its messages
                packed = self.inbox.recv_tensor(timeout=0.0 if self.prompt_turns else QUIET)
            except TransportError:  # a quiet inbox
                packed = None
            try:
                if self.heartbeat is not None:
                    self.heartbeat.check()
                message = None if packed is None else self._readable(packed)
                if message is not None:  # handled before the KV sender's check: a failed send loses no message
                    self.handle(message)
                    if self.stopped:
                        return
                if self.prompt_turns:
                    self._run_step(self.prompt_turns[0], self._prompt_turn)
                if self.sender is not None:
                    self.sender.check()
            except HeadGone:  # nobody to tell: the worker waits for a successor, or stops
                raise
            except (TransportError, ReplicationError) as error:  # a neighbour, the replica holder or the head
                if not self.recovery:
                    self.tell_head(failure_message(self.role.name, error, self.epoch))
                    raise
                self._link_lost(error)
            except Exception as error:  # a bad message, or the stage failed: tell the head
                self.tell_head(failure_message(self.role.name, error, self.epoch))
                raise

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
        if self._reported_epoch < self.epoch:
            self._reported_epoch = self.epoch
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
            self._forget(number)
            self.head.send_tensor(pack(MicrobatchFailed(
                microbatch=number, stage=self.role.name, epoch=self.epoch,
                error=f"{self.role.name} failed on it: {type(error).__name__}: {error}")))

    def _prefill_of_role(self, message: Prefill) -> None:
        """A static microbatch's prompts (disaggregated, a slot's group's): a prompt stage prefills them in chunks,
        a mixed stage into the cache it decodes on."""
        if self.role.kind == "prompt":
            self._prompt_prefill(message)
        elif self.role.kind == "mixed":
            self._prefill(message)
        else:
            self._unexpected(message)

    def _slot_round(self, message: SlotRound) -> None:
        if not self.continuous or not self.role.decodes:
            self._unexpected(message)
        self._round(message)

    def _decode(self, message: Decode) -> None:
        """A static microbatch's next step on a decoding stage."""
        number = message.microbatch
        if self.role.kind == "prompt":
            self._unexpected(message)
        if number not in self.microbatches:  # ended or dropped meanwhile: nothing to continue
            log.warning("%s dropped a step of microbatch %d, which it does not hold", self.role.name, number)
            return
        state = self.microbatches[number]
        state.mask = torch.cat([state.mask, state.mask.new_ones(len(state.mask), 1)], dim=1)
        state.positions = state.positions[:, -1:] + 1
        self._step(number, state, message, self.caches.acquire(number))

    def _cancel(self, message: Cancel) -> None:
        """End rows of a microbatch at its next step (their requests were cancelled): a slot's, or a static one's."""
        if self.continuous:
            self._cancel_rows(message.microbatch, message.rows)
        else:
            self._cancel_static(message.microbatch, message.rows)

    def _cancel_static(self, number: int, rows: list[int]) -> None:
        """End `rows` of microbatch `number` at its next step (their requests were cancelled): the head tells the
        first decoding stage, and each passes it on behind the steps it sent, so that the last stage, which picks
        the tokens, has the microbatch when it arrives; one that overtook the microbatch anyway (a `start` waiting
        for its prompt KV) is kept until the microbatch comes. A microbatch with no live row left ends."""
        if not self.stage.last:
            self._send(self.following, Cancel(microbatch=number, rows=rows))
            return
        state = self.microbatches.get(number)
        if state is None or state.ended is None:
            self.keep_cancel(number, rows)
            return
        state.ended[rows] = True

    def _end(self, message: End) -> None:
        """Free a microbatch's cache (a slot's, under continuous batching), and pass the word on."""
        if self.continuous and self.role.decodes:
            self._end_slot(message)
            return
        number = message.microbatch
        self.microbatches.pop(number, None)
        self.caches.remove(number)
        if self.replicator is not None:
            self.replicator.end(number)
        if self.role.number + 2 < self.role.stages:  # the last stage ended it and freed its own already
            self._send(self.following, message)
        else:  # every stage has freed its cache: the head may give its room to another
            self._send(self.head, Freed(microbatch=number))

    def _prefill(self, message: Prefill) -> None:
        """A mixed stage's first step of a static microbatch: its whole prompts, into the cache it decodes on."""
        number = message.microbatch
        state = self._prefilled_state(number, message.specs, message.ended, message.mask.clone())
        self.microbatches[number] = state
        self._step(number, state, message, self.caches.new_cache(number))

    def _receive_kv(self, message: Kv) -> None:
        number = message.microbatch
        if self.role.kind != "token":
            self._unexpected(message)
        if number in self.failed:  # a piece a failed microbatch's prompt stage sent before it failed
            return
        staged = self._staged(number)
        staged.add(self.stage.layers[0], message.layers, message.piece, message.last)
        if staged.complete and staged.start is not None:  # a step that waited for this KV
            self.handlers[type(staged.start)](staged.start)

    def _start(self, message: Start) -> None:
        """A token stage's first step of a microbatch the prompt pipeline ran, once all its layers' KV are here
        (else the message waits for the last piece)."""
        number = message.microbatch
        if self.role.kind != "token":
            self._unexpected(message)
        staged = self._staged(number)
        if not staged.complete:
            staged.start = message
            return
        del self.staged[number]
        prompt_mask, ended, rng = message.mask, message.ended, message.rng
        if bool(ended.all()):  # every row ended with its first token: nothing to decode
            if self.role.last:  # no token stage kept its KV
                self._send(self.head, Ended(microbatch=number, freed=True))
            else:
                self._send(self.following, message)
            return
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_mask), 1)], dim=1)
        state = MicrobatchState(positions_needed(prompt_mask.shape[1], max(message.specs.max_new_tokens)), mask,
                                position_ids(prompt_mask)[:, -1:] + 1, message.specs)
        if self.stage.last:
            state.picker = TokenPicker(self.stage.adapter.model.generation_config, message.specs.decoding)
            if rng.numel():
                state.picker.set_states(rng)
            state.ended, state.steps = ended.bool().clone(), 1
            state.ended[self.kept_cancels(number)] = True
            state.history = [list(message.first)]
        self.microbatches[number] = state
        cache = self.caches.new_cache(number, staged.cache(self.stage.config, prompt_mask.shape[1]))
        output = self.stage.forward(message.inputs, state.mask, state.positions, cache)
        if not self.stage.last:
            self._send(self.following, attrs.evolve(message, inputs=output))
        else:
            self._next_tokens(number, state, output)
        self._after_step(number, cache, first=True)

    def _step(self, number: int, state: MicrobatchState, message: Prefill | Decode, cache: Any) -> None:
        """Run the stage on the microbatch's new positions in `cache` (its prompts for a `Prefill`), and pass the
        result on."""
        prompt_logprobs: dict[str, Any] = {}
        prefill = isinstance(message, Prefill)
        on_hidden = self._scorer(state, prompt_logprobs) if prefill else None
        output = self.stage.forward(message.inputs, state.mask, state.positions, cache, on_hidden=on_hidden)
        if self.stage.last:
            self._next_tokens(number, state, output, prompt_logprobs)
        elif isinstance(message, Prefill):
            self._send(self.following, attrs.evolve(message, inputs=output, mask=state.mask))
        else:
            self._send(self.following, attrs.evolve(message, inputs=output))
        self._after_step(number, cache, first=prefill)

    def _after_step(self, number: int, cache: Any, first: bool) -> None:
        """Hand a stepped cache back (after its first step, with its final size), or free it if it ended here;
        replicate what the step added."""
        state = self.microbatches.get(number)
        if state is None:
            self.caches.remove(number)
        elif first:
            self.caches.add(number, state.capacity)
        else:
            self.caches.release(number)
        if self.replicator is None:
            return
        if state is None:
            self.replicator.end(number)
        elif first:
            self.replicator.start(number, cache)
        else:
            self.replicator.step(number, cache)

    def _scorer(self, state: MicrobatchState, into: dict[str, Any]) -> Any:
        """The last stage's prompt scorer of a microbatch's prefill (None elsewhere, or when no row asks)."""
        if not self.stage.last:
            return None
        return self.prompt_scorer(state.specs.decoding, 0, state.mask.shape[1], into)

    def _next_tokens(self, number: int, state: MicrobatchState, logits: torch.Tensor,
                     prompt_logprobs: dict[str, Any] | None = None) -> None:
        """The last stage: pick each row's next token, report it, and go on or end the microbatch."""
        tokens, ended, failures, logprobs = self._pick(state, logits)
        states = state.picker.states() if state.picker is not None and self.recovery else None
        self._send(self.head, Tokens(microbatch=number, failed=failures, tokens=tokens, states=states,
                                     scores=Scores(logprobs, prompt_logprobs or {})))
        if bool(ended.all()):
            del self.microbatches[number]
            self._send(self.head, Ended(microbatch=number, freed=self.role.stages == 1))
            if self.role.stages > 1:
                self._send(self.first, End(microbatch=number))
        else:
            self._send(self.first, Decode(microbatch=number, inputs=tokens[:, None]))
