"""A stage worker: one process that holds one pipeline stage and runs every microbatch through it.

Life of a worker (`bootstrap.run_worker`: `python -m dejavu_sdk.serving.bootstrap --join URL`, as launchers start
it, or `dejavu worker --join URL`):
1. serve an inbox, and send the head `join` with its address;
2. take the head's `assign`: the model, its layers, and where its output goes; load the model, keep its
   stage, connect to its neighbours; send `ready`;
3. run messages until `shutdown` (`StageWorker.run`, this module):
   `prefill` (a new microbatch: its ids or hidden states, mask and rows' limits) and `decode` (one more
   position) run the stage and go on to the next stage; on the last stage they become the next tokens,
   which go to the head (`tokens`) and back to the first stage as the next `decode`, or, once every row has
   ended, `ended` to the head and `end` through the other stages, which free the microbatch's caches.
   Disaggregated, a prompt stage runs only `prefill`, streaming each finished layer's KV to the token stages
   (`kv`), and its last stage sends the first tokens to the head (`prefilled`); a token stage keeps the KV
   it receives until the head's `start` (the first tokens) arrives, then decodes the microbatch as above.
A worker that cannot reach a neighbour, or whose stage fails, tells the head (`failed`) and stops: the head
fails the requests in flight. One that cannot reach the head raises `HeadGone`, and waits as an orphan for a
successor (`bootstrap.run_worker`).

With recovery (`recovery` in the assignment), decoding stages replicate their caches around the ring
(`replication.Replicator`), a neighbour that cannot be reached is reported (`link_lost`) instead of ending
the worker, and the head's recovery messages drive it (`worker_recovery`). What the worker holds between
messages is `worker_state.WorkerState`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ReplicationError, TransportError
from ..generation.decoding import TokenPicker
from ..generation.stage import position_ids
from ..swapping import positions_needed
from .messages import Kind, Message, pack, unpack
from .prompt_steps import PromptSteps
from .worker_recovery import RECOVERY, RecoveryHandlers
from .worker_slots import SlotHandlers
from .worker_state import HeadGone, MicrobatchState, Role, score_fields

__all__ = ["QUIET", "Role", "StageWorker", "failure_message"]  # Role is worker_state's, named here with the worker

log = logging.getLogger(__name__)

#: Seconds a worker's loop waits on a quiet inbox before it checks that its heartbeats and KV sends still go.
QUIET = 2.0
#: The messages that compute a step of a microbatch: what they raise fails that microbatch, not the stage.
STEPS = ("prefill", "decode", "start")
#: The kinds a worker's inbox takes: any other is dropped.
KNOWN_KINDS = frozenset(kind.value for kind in Kind)


def failure_message(stage: str | int, error: BaseException, epoch: int = 0) -> torch.Tensor:
    """The `failed` message that tells the head which stage failed (in which epoch), and why."""
    return pack(Message(Kind.FAILED, {"stage": stage, "epoch": epoch, "error": f"{type(error).__name__}: {error}"}))


class StageWorker(RecoveryHandlers, SlotHandlers, PromptSteps):
    """Runs one assigned stage: `run()` returns when the head says `shutdown`. Its constructor and state are
    `WorkerState`'s; the head's recovery messages are handled by `RecoveryHandlers`, a continuous pipeline's
    slots by `SlotHandlers`, a prompt stage's prefills by `PromptSteps`."""

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
                    if message.kind == Kind.SHUTDOWN:
                        return
                    if message.kind == Kind.REJOIN:  # a new head at the address, found by the heartbeat's link
                        raise HeadGone("a new head listens at the head's address and asks this worker to rejoin")
                    if message.kind == Kind.FENCED:
                        log.warning("%s: another worker has served this stage since epoch %s (this one was stopped "
                                    "or cut off meanwhile): exiting", self.role.name, message.fields.get("epoch"))
                        return
                    self.handle(message)
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
            message = unpack(packed)
        except TransportError as error:
            log.warning("%s dropped what it received: %s", self.role.name, error)
            return None
        if message.kind not in KNOWN_KINDS:
            log.warning("%s dropped a message of unknown kind %r", self.role.name, message.kind[:64])
            return None
        return message

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
            self.tell_head(pack(Message(Kind.LINK_LOST, {"stage": self.role.name, "epoch": self.epoch,
                                                          "error": str(error)})))

    def handle(self, message: Message) -> None:
        number = int(message.fields.get("microbatch", -1))
        kind = message.kind
        if int(message.fields.get("epoch", self.epoch)) < self.epoch:
            log.debug("%s dropped a %r of epoch %s (now %d)", self.role.name, kind, message.fields["epoch"], self.epoch)
            return  # sent before a recovery, which decided where its microbatch goes on from
        if kind in RECOVERY:
            getattr(self, f"_{kind}")(message)
        elif kind in STEPS:
            self._compute(number, message)
        elif kind == Kind.ENTER and self.continuous and self.role.decodes and self.stage.first:
            self._enter(number, message)
        elif kind == Kind.END and self.continuous and self.role.decodes:
            self._end_slot(number, message)
        elif kind == Kind.END:
            self.microbatches.pop(number, None)
            self.caches.remove(number)
            if self.replicator is not None:
                self.replicator.end(number)
            if self.role.number + 2 < self.role.stages:  # the last stage ended it and freed its own already
                self._send(self.following, message)
            else:  # every stage has freed its cache: the head may give its room to another
                self._send(self.head, Message(Kind.FREED, {"microbatch": number}))
        elif kind == Kind.KV and self.role.kind == "token":
            self._receive_kv(number, message)
        elif kind == Kind.CANCEL:
            if self.continuous:
                self._cancel_rows(number, message.fields["rows"])
            else:
                self._cancel(number, message.fields["rows"])
        elif kind == Kind.STATS:
            self.head.send_tensor(pack(Message(Kind.STATS, {"stage": self.role.name, "row_steps": self.row_steps,
                                                         "staged_kv": len(self.staged), **self.caches.stats()})))
        else:
            raise TransportError(f"{self.role.name} got a message of unexpected kind {kind!r}")

    def _compute(self, number: int, message: Message) -> None:
        """Run a step of microbatch `number` (`_run_step`)."""
        self._run_step(number, lambda: self._step_of(number, message))

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
            self.head.send_tensor(pack(Message(Kind.MICROBATCH_FAILED, {
                "microbatch": number, "stage": self.role.name, "epoch": self.epoch,
                "error": f"{self.role.name} failed on it: {type(error).__name__}: {error}"})))

    def _step_of(self, number: int, message: Message) -> None:
        """Run the step that `message` asks of microbatch `number`."""
        kind = message.kind
        slots = self.continuous and self.role.decodes  # a prompt stage prefills as under static batching
        if slots and kind == Kind.PREFILL and self.stage.first:
            self._open_slot(number, message)
        elif slots and kind == Kind.DECODE:
            self._round(number, message)
        elif kind == Kind.START and self.role.kind == "token":
            self._start(number, message)
        elif kind == Kind.PREFILL and self.role.kind == "prompt":
            self._prompt_prefill(number, message)
        elif kind == Kind.PREFILL and self.role.kind == "mixed":
            self._prefill(number, message)
        elif kind == Kind.DECODE and self.role.kind != "prompt":
            if number not in self.microbatches:  # ended or dropped meanwhile: nothing to continue
                log.warning("%s dropped a step of microbatch %d, which it does not hold", self.role.name, number)
                return
            state = self.microbatches[number]
            state.mask = torch.cat([state.mask, state.mask.new_ones(len(state.mask), 1)], dim=1)
            state.positions = state.positions[:, -1:] + 1
            self._step(number, state, message.tensors[0], message, self.caches.acquire(number))
        else:
            raise TransportError(f"{self.role.name} got a message of unexpected kind {kind!r}")

    def _cancel(self, number: int, rows: list[int]) -> None:
        """End `rows` of microbatch `number` at its next step (their requests were cancelled): the head tells the
        first decoding stage, and each passes it on behind the steps it sent, so that the last stage, which picks
        the tokens, has the microbatch when it arrives; one that overtook the microbatch anyway (a `start` waiting
        for its prompt KV) is kept until the microbatch comes. A microbatch with no live row left ends."""
        if not self.stage.last:
            self._send(self.following, Message(Kind.CANCEL, {"microbatch": number, "rows": rows}))
            return
        state = self.microbatches.get(number)
        if state is None or state.ended is None:
            self.keep_cancel(number, rows)
            return
        state.ended[rows] = True

    def _prefill(self, number: int, message: Message) -> None:
        """A mixed stage's first step of a static microbatch: its whole prompts, into the cache it decodes on."""
        inputs, mask = message.tensors
        state = self._prefilled_state(number, dict(message.fields), mask.clone())
        self.microbatches[number] = state
        self._step(number, state, inputs, message, self.caches.new_cache(number))

    def _receive_kv(self, number: int, message: Message) -> None:
        if number in self.failed:  # a piece a failed microbatch's prompt stage sent before it failed
            return
        staged = self._staged(number)
        staged.add(self.stage.layers[0], tuple(message.fields["layers"]), message.tensors[0],
                   bool(message.fields.get("last", True)))
        if staged.complete and staged.start is not None:  # a step that waited for this KV
            self._compute(int(staged.start.fields["microbatch"]), staged.start)

    def _start(self, number: int, message: Message) -> None:
        """A token stage's first step of a microbatch the prompt pipeline ran, once all its layers' KV are here
        (else the message waits for the last piece)."""
        staged = self._staged(number)
        if not staged.complete:
            staged.start = message
            return
        del self.staged[number]
        inputs, prompt_mask, ended, rng = message.tensors
        if bool(ended.all()):  # every row ended with its first token: nothing to decode
            if self.role.last:  # no token stage kept its KV
                self._send(self.head, Message(Kind.ENDED, {"microbatch": number, "freed": True}))
            else:
                self._send(self.following, message)
            return
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_mask), 1)], dim=1)
        state = MicrobatchState(positions_needed(prompt_mask.shape[1], max(message.fields["max_new_tokens"])), mask,
                            position_ids(prompt_mask)[:, -1:] + 1, dict(message.fields))
        if self.stage.last:
            state.picker = TokenPicker(self.stage.adapter.model.generation_config, message.fields["decoding"])
            if rng.numel():
                state.picker.set_states(rng)
            state.ended, state.steps = ended.bool().clone(), 1
            state.ended[self.kept_cancels(number)] = True
            state.history = [list(message.fields.get("first", []))]
        self.microbatches[number] = state
        cache = self.caches.new_cache(number, staged.cache(self.stage.config, prompt_mask.shape[1]))
        output = self.stage.forward(inputs, state.mask, state.positions, cache)
        if not self.stage.last:
            self._send(self.following, Message(Kind.START, message.fields, (output, prompt_mask, ended, rng)))
        else:
            self._next_tokens(number, state, output)
        self._after_step(number, cache, first=True)

    def _step(self, number: int, state: MicrobatchState, inputs: torch.Tensor, message: Message, cache: Any) -> None:
        """Run the stage on the microbatch's new positions in `cache`, and pass the result on."""
        prompt_logprobs: dict[str, Any] = {}
        on_hidden = self._scorer(state, prompt_logprobs) if message.kind == Kind.PREFILL else None
        output = self.stage.forward(inputs, state.mask, state.positions, cache, on_hidden=on_hidden)
        if not self.stage.last:
            tensors = (output, state.mask) if message.kind == Kind.PREFILL else (output,)
            self._send(self.following, Message(message.kind, message.fields, tensors))
        else:
            self._next_tokens(number, state, output, prompt_logprobs)
        self._after_step(number, cache, first=message.kind == Kind.PREFILL)

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
        return self.prompt_scorer(state.fields["decoding"], 0, state.mask.shape[1], into)

    def _next_tokens(self, number: int, state: MicrobatchState, logits: torch.Tensor,
                     prompt_logprobs: dict[str, Any] | None = None) -> None:
        """The last stage: pick each row's next token, report it, and go on or end the microbatch."""
        tokens, ended, failures, logprobs = self._pick(state, logits)
        states = state.picker.states() if state.picker is not None and self.recovery else None
        rng = () if states is None else (states,)
        self._send(self.head, Message(Kind.TOKENS, {"microbatch": number, "failed": failures,
                                                    **score_fields(logprobs, prompt_logprobs or {})}, (tokens, *rng)))
        if bool(ended.all()):
            del self.microbatches[number]
            self._send(self.head, Message(Kind.ENDED, {"microbatch": number, "freed": self.role.stages == 1}))
            if self.role.stages > 1:
                self._send(self.first, Message(Kind.END, {"microbatch": number}))
        else:
            self._send(self.first, Message(Kind.DECODE, {"microbatch": number}, (tokens[:, None],)))
