"""A stage worker: one process that holds one pipeline stage and runs every microbatch through it.

Life of a worker (`dejavu worker --join URL`, or a process the pipeline launches the same way):
1. serve an inbox, and send the head `join` with its address;
2. take the head's `assign`: the model, its layers, and where its output goes; load the model, keep its
   stage, connect to its neighbours; send `ready`;
3. run messages until `shutdown`:
   `prefill` (a new microbatch: its ids or hidden states, mask and rows' limits) and `decode` (one more
   position) run the stage and go on to the next stage; on the last stage they become the next tokens,
   which go to the head (`tokens`) and back to the first stage as the next `decode`, or, once every row has
   ended, `ended` to the head and `end` through the other stages, which free the microbatch's caches.
   Disaggregated, a prompt stage runs only `prefill`, streaming each finished layer's KV to the token stages
   (`kv`), and its last stage sends the first tokens to the head (`prefilled`); a token stage keeps the KV
   it receives until the head's `start` (the first tokens) arrives, then decodes the microbatch as above.
A worker that cannot reach a neighbour, or whose stage fails, tells the head (`failed`) and stops: the head
fails the requests in flight.

With recovery (`recovery` in the assignment), decoding stages replicate their caches around the ring
(`replication.Replicator`), a neighbour that cannot be reached is reported (`link_lost`) instead of ending
the worker, and the head's recovery messages drive it: `pause` (a new epoch: messages of older epochs are
dropped from now on; report the caches held, and the replicas held for the previous decoding stage),
`relink` (the neighbours' addresses, some of them new), `send_replica` (send a replica held here back to its
restarted owner, as `restore`), `drop` (forget microbatches that start over from their prompts) and `rewind`
(continue a microbatch from a given position: survivors crop their caches to it, a replacement builds its
cache from the restored replica).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ..backends import open_store, open_transport, serve
from ..errors import DejaVuError, ReplicationError, TransportError
from ..generation.decoding import TokenPicker, next_tokens
from ..generation.stage import Stage, position_ids
from ..models import load_model
from ..store import Store
from ..stream import LayerPartition
from ..swapping import SwappedCaches, positions_needed
from ..transports.base import Server, Transport
from .handoff import KV, LayerSender, StagedKV
from .messages import Message, pack, unpack
from .replication import Replicator, assemble, cache_from, held_positions, replica_stream

log = logging.getLogger(__name__)

#: Seconds a worker waits for its assignment after joining.
ASSIGN_TIMEOUT = 120.0
#: Seconds a worker keeps trying to reach a head that is not listening yet.
JOIN_TIMEOUT = 120.0
#: Seconds a worker's loop waits on a quiet inbox before it checks that its heartbeats and KV sends still go.
QUIET = 2.0
#: The head's recovery messages (`pause` starts a new epoch); `drop` also forgets a microbatch that failed.
RECOVERY = ("pause", "relink", "send_replica", "restore", "drop", "rewind")
#: The messages that compute a step of a microbatch: what they raise fails that microbatch, not the stage.
STEPS = ("prefill", "decode", "start")


class _HeadGone(TransportError):
    """The head no longer answers: the worker stops, whatever its recovery settings."""


class Heartbeat:
    """Posts `heartbeat` to the head every `interval` seconds from a thread of its own, however busy the stage
    is (a stopped or hung process sends none: the head counts it dead after a few missed). A head that no
    longer takes them is kept as `error` for the worker's loop to raise."""

    def __init__(self, head: Transport, stage: str, interval: float, epoch: Callable[[], int] = lambda: 0) -> None:
        self.head, self.stage, self.interval, self.epoch = head, stage, interval, epoch
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dejavu-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.head.post_tensor(pack(Message("heartbeat", {"stage": self.stage, "epoch": self.epoch()})))
        except Exception as error:  # the head is gone: the worker stops
            self.error = error

    def check(self) -> None:
        if self.error is not None:
            raise _HeadGone(f"the head no longer takes heartbeats: {self.error}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)



@attrs.define
class _Microbatch:
    """What one stage keeps of a microbatch between steps (its KV cache is in the worker's `caches`)."""

    capacity: int  # cache positions it reaches at its end
    mask: torch.Tensor
    positions: torch.Tensor
    fields: dict[str, Any]
    ended: torch.Tensor | None = None  # the last stage's: rows that ended
    picker: TokenPicker | None = None  # the last stage's: how the next tokens are chosen
    steps: int = 0


@attrs.frozen
class Role:
    """Where a stage sits: `kind` is "mixed" (prompts and tokens), "prompt" or "token"; `number` of `stages` in
    its own pipeline; `name` as errors show it."""

    kind: str
    number: int
    stages: int
    name: str

    @property
    def last(self) -> bool:
        return self.number == self.stages - 1

    @property
    def decodes(self) -> bool:
        return self.kind != "prompt"


class StageWorker:
    """Runs one assigned stage: `run()` returns when the head says `shutdown`.

    `following` is the next stage of its pipeline; `first` the last stage's way back to its pipeline's first
    stage (the next step's tokens); `sender` a prompt stage's link to the token stages.
    """

    def __init__(self, stage: Stage, role: Role, inbox: Server, head: Transport, following: Transport | None,
                 first: Transport | None, eos: list[int], pad: int, sender: LayerSender | None = None,
                 swapping: bool = False, heartbeat: Heartbeat | None = None, replicator: Replicator | None = None,
                 recovery: bool = False, epoch: int = 0, replica_prefix: str = "") -> None:
        self.stage, self.role, self.inbox, self.head, self.heartbeat = stage, role, inbox, head, heartbeat
        self.following, self.first, self.sender, self.pad = following, first, sender, pad
        #: Decoding stages with recovery: streams each microbatch's cache to the next decoding stage.
        self.replicator = replicator
        #: With recovery, a lost neighbour is reported and waited out; the head's `pause` starts a new `epoch`.
        self.recovery, self.epoch = recovery, epoch
        self.prefix = replica_prefix  # of the replica streams, this pipeline's
        self._reported_epoch = -1  # the epoch in which a lost link was last reported
        self.restored: dict[int, torch.Tensor] = {}  # a replacement's: its caches as their replicas held them
        self.eos = torch.tensor(eos, dtype=torch.long)  # a row ends at any of them
        self.microbatches: dict[int, _Microbatch] = {}
        #: The decoding microbatches' KV caches: on the device, or swapped to host memory with two on the device.
        self.caches = SwappedCaches(stage.config, next(stage.adapter.model.parameters()).device,
                                    swapping and role.kind != "prompt")  # a prompt stage keeps no cache
        self.staged: dict[int, StagedKV] = {}  # a token stage's: KV received for microbatches not started yet
        self.row_steps = 0  # the last stage's: rows given a token while live (ended and cancelled rows are not)

    def run(self) -> None:
        while True:
            try:
                packed = self.inbox.recv_tensor(timeout=QUIET)
            except TransportError:  # a quiet inbox
                packed = None
            try:
                if self.heartbeat is not None:
                    self.heartbeat.check()
                if packed is not None:  # handled before the KV sender's check: a failed send loses no message
                    message = unpack(packed)
                    if message.kind == "shutdown":
                        return
                    self.handle(message)
                if self.sender is not None:
                    self.sender.check()
            except (TransportError, ReplicationError) as error:  # a neighbour (or replica holder) is unreachable
                if not self.recovery or isinstance(error, _HeadGone):
                    self.head.send_tensor(_failure(self.role.name, error, self.epoch))
                    raise
                self._link_lost(error)
            except Exception as error:  # a bad message, or the stage failed: tell the head
                self.head.send_tensor(_failure(self.role.name, error, self.epoch))
                raise

    def _link_lost(self, error: BaseException) -> None:
        """A neighbour could not be reached: tell the head once per epoch, and wait for its recovery."""
        if self._reported_epoch < self.epoch:
            self._reported_epoch = self.epoch
            self.head.send_tensor(pack(Message("link_lost", {"stage": self.role.name, "epoch": self.epoch,
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
        elif kind == "end":
            self.microbatches.pop(number, None)
            self.caches.remove(number)
            if self.replicator is not None:
                self.replicator.end(number)
            if self.role.number + 2 < self.role.stages:  # the last stage ended it and freed its own already
                self._send(self.following, message)
            else:  # every stage has freed its cache: the head may give its room to another
                self._send(self.head, Message("freed", {"microbatch": number}))
        elif kind == KV and self.role.kind == "token":
            self._receive_kv(number, message)
        elif kind == "cancel":
            self._cancel(number, message.fields["rows"])
        elif kind == "stats":
            self.head.send_tensor(pack(Message("stats", {"stage": self.role.name, "row_steps": self.row_steps,
                                                         **self.caches.stats()})))
        else:
            raise TransportError(f"{self.role.name} got a message of unexpected kind {kind!r}")

    def _compute(self, number: int, message: Message) -> None:
        """Run a step of microbatch `number`. What its computation raises fails that microbatch alone (the head
        hears `microbatch_failed` and its other stages drop it); a lost link is the stage's, and goes on up."""
        kind = message.kind
        try:
            if kind == "start" and self.role.kind == "token":
                self._start(number, message)
            elif kind == "prefill" and self.role.kind != "token":
                self._prefill(number, message)
            elif kind == "decode" and self.role.kind != "prompt":
                if number not in self.microbatches:  # ended or dropped meanwhile: nothing to continue
                    log.warning("%s dropped a step of microbatch %d, which it does not hold", self.role.name, number)
                    return
                state = self.microbatches[number]
                state.mask = torch.cat([state.mask, state.mask.new_ones(len(state.mask), 1)], dim=1)
                state.positions = state.positions[:, -1:] + 1
                self._step(number, state, message.tensors[0], message, self.caches.acquire(number))
            else:
                raise TransportError(f"{self.role.name} got a message of unexpected kind {kind!r}")
        except (TransportError, ReplicationError):
            raise
        except Exception as error:
            log.exception("%s failed on microbatch %d", self.role.name, number)
            self._forget(number)
            self.head.send_tensor(pack(Message("microbatch_failed", {
                "microbatch": number, "stage": self.role.name, "epoch": self.epoch,
                "error": f"{self.role.name} failed on it: {type(error).__name__}: {error}"})))

    def _cancel(self, number: int, rows: list[int]) -> None:
        """End `rows` of microbatch `number` at its next step (their requests were cancelled): the head tells the
        first decoding stage, and each passes it on behind the steps it sent, so that the last stage, which picks
        the tokens, has the microbatch when it arrives. A microbatch with no live row left ends."""
        if not self.stage.last:
            self._send(self.following, Message("cancel", {"microbatch": number, "rows": rows}))
            return
        state = self.microbatches.get(number)
        if state is None or state.ended is None:
            log.debug("%s: no rows of microbatch %d to cancel here", self.role.name, number)
            return
        state.ended[rows] = True

    def _prefill(self, number: int, message: Message) -> None:
        inputs, mask = message.tensors
        state = _Microbatch(positions_needed(mask.shape[1], max(message.fields["max_new_tokens"])), mask.clone(),
                            position_ids(mask), dict(message.fields))
        if self.stage.last:
            state.picker = TokenPicker(self.stage.adapter.model.generation_config, message.fields["decoding"])
        if self.role.kind == "mixed":
            self.microbatches[number] = state
            self._step(number, state, inputs, message, self.caches.new_cache(number))
            return
        sender, cache, first_layer = self.sender, self.stage.new_cache(), self.stage.layers[0]
        assert sender is not None  # a prompt stage streams every layer it runs
        layers: list[Any] = cache.layers  # key/value layers, as the stage's model makes them

        def stream_layer(local: int) -> None:
            layer = layers[local]
            sender.layer_done(number, first_layer + local, layer.keys, layer.values, self.epoch)

        output = self.stage.forward(inputs, state.mask, state.positions, cache, after_layer=stream_layer)
        if not self.stage.last:
            self._send(self.following, Message("prefill", message.fields, (output, state.mask)))
            return
        tokens, ended, failures = self._pick(state, output)  # the first tokens; the token pipeline takes over
        states = state.picker.states() if state.picker is not None else None
        rng = states if states is not None else torch.empty(0, dtype=torch.uint8)
        self._send(self.head, Message("prefilled", {"microbatch": number, "failed": failures},
                                      (tokens[:, None], state.mask, ended.to(torch.uint8), rng)))

    def _receive_kv(self, number: int, message: Message) -> None:
        staged = self._staged(number)
        staged.add(self.stage.layers[0], tuple(message.fields["layers"]), message.tensors[0])
        if staged.complete and staged.start is not None:
            self._start(number, staged.start)

    def _staged(self, number: int) -> StagedKV:
        return self.staged.setdefault(number, StagedKV(self.stage.layers[1] - self.stage.layers[0]))

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
                self._send(self.head, Message("ended", {"microbatch": number, "freed": True}))
            else:
                self._send(self.following, message)
            return
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_mask), 1)], dim=1)
        state = _Microbatch(positions_needed(prompt_mask.shape[1], max(message.fields["max_new_tokens"])), mask,
                            position_ids(prompt_mask)[:, -1:] + 1, dict(message.fields))
        if self.stage.last:
            state.picker = TokenPicker(self.stage.adapter.model.generation_config, message.fields["decoding"])
            if rng.numel():
                state.picker.set_states(rng)
            state.ended, state.steps = ended.bool().clone(), 1
        self.microbatches[number] = state
        cache = self.caches.new_cache(number, staged.cache(self.stage.config, prompt_mask.shape[1]))
        output = self.stage.forward(inputs, state.mask, state.positions, cache)
        if not self.stage.last:
            self._send(self.following, Message("start", message.fields, (output, prompt_mask, ended, rng)))
        else:
            self._next_tokens(number, state, output)
        self._after_step(number, cache, first=True)

    def _step(self, number: int, state: _Microbatch, inputs: torch.Tensor, message: Message, cache: Any) -> None:
        """Run the stage on the microbatch's new positions in `cache`, and pass the result on."""
        output = self.stage.forward(inputs, state.mask, state.positions, cache)
        if not self.stage.last:
            tensors = (output, state.mask) if message.kind == "prefill" else (output,)
            self._send(self.following, Message(message.kind, message.fields, tensors))
        else:
            self._next_tokens(number, state, output)
        self._after_step(number, cache, first=message.kind == "prefill")

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

    def _pick(self, state: _Microbatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Each row's next token (padding once the row has ended), which rows have now ended, and why each row
        that failed now did (by row, as message fields)."""
        if state.ended is None:
            state.ended = torch.zeros(len(logits), dtype=torch.bool)
        assert state.picker is not None  # made with the microbatch on the last stage
        state.steps += 1
        self.row_steps += int((~state.ended).sum())
        tokens, state.ended, failures = next_tokens(state.picker, logits, state.ended, state.steps,
                                                    state.fields["max_new_tokens"], self.eos, self.pad)
        return tokens, state.ended, {str(row): failure.fields() for row, failure in failures.items()}

    def _next_tokens(self, number: int, state: _Microbatch, logits: torch.Tensor) -> None:
        """The last stage: pick each row's next token, report it, and go on or end the microbatch."""
        tokens, ended, failures = self._pick(state, logits)
        states = state.picker.states() if state.picker is not None and self.recovery else None
        rng = () if states is None else (states,)
        self._send(self.head, Message("tokens", {"microbatch": number, "failed": failures}, (tokens, *rng)))
        if bool(ended.all()):
            del self.microbatches[number]
            self._send(self.head, Message("ended", {"microbatch": number, "freed": self.role.stages == 1}))
            if self.role.stages > 1:
                self._send(self.first, Message("end", {"microbatch": number}))
        else:
            self._send(self.first, Message("decode", {"microbatch": number}, (tokens[:, None],)))

    # ---- recovery: driven by the head, one message at a time ----------------------------------------
    def _pause(self, message: Message) -> None:
        """A new epoch: finish replicating, forget KV of microbatches not yet started here, and report the
        caches held (positions per microbatch) and the positions of the replicas held for `replica_of`."""
        self.epoch = int(message.fields["epoch"])
        self._reported_epoch = self.epoch  # links lost now are what the recovery mends: nothing to report
        if self.replicator is not None:
            self.replicator.finish_all()
        self.staged.clear()
        self.restored.clear()
        caches = {str(number): self.caches.acquire(number).get_seq_length() for number in self.microbatches
                  if number in self.caches}
        holds = {}
        owner = message.fields.get("replica_of")
        if owner is not None:
            store = self.inbox.store
            for number in message.fields["microbatches"]:
                holds[str(number)] = held_positions(store.keys(replica_stream(owner, number, self.prefix)),
                                                    int(message.fields["replica_layers"]))
        self.head.send_tensor(pack(Message("paused", {"stage": self.role.name, "epoch": self.epoch,
                                                      "caches": caches, "holds": holds})))

    def _relink(self, message: Message) -> None:
        """Reconnect to the neighbours at the addresses given (some of them replacements)."""
        self._close_links()
        self.following, self.first, self.sender, self.replicator = open_links(message.fields, self.role)
        self._reported_epoch = self.epoch - 1  # from here on, a lost link is news again
        self.head.send_tensor(pack(Message("relinked", {"stage": self.role.name, "epoch": self.epoch})))

    def _send_replica(self, message: Message) -> None:
        """Send the replica held here of stage `owner`'s microbatch back to that stage's replacement at `to`."""
        fields = message.fields
        number, positions = int(fields["microbatch"]), int(fields["positions"])
        answer: dict[str, Any] = {"stage": self.role.name, "microbatch": number, "epoch": self.epoch}
        try:
            block = assemble(self.inbox.store, replica_stream(int(fields["owner"]), number, self.prefix),
                             int(fields["layers"]), positions)
        except DejaVuError as error:  # a replica short or damaged: that microbatch starts over
            answer["error"] = f"{type(error).__name__}: {error}"
        else:
            try:
                with open_transport(fields["to"]) as replacement:
                    replacement.send_tensor(pack(Message("restore", {"microbatch": number, "epoch": self.epoch},
                                                         (block,))))
            except TransportError as error:  # the replacement is gone too
                answer.update(error=str(error), unreachable=True)
        self.head.send_tensor(pack(Message("sent", answer)))

    def _restore(self, message: Message) -> None:
        self.restored[int(message.fields["microbatch"])] = message.tensors[0].clone()

    def _drop(self, message: Message) -> None:
        """Forget microbatches that start over from their prompts, failed, or ended meanwhile."""
        for number in message.fields["microbatches"]:
            self._forget(number)

    def _forget(self, number: int) -> None:
        """Let go of everything held for microbatch `number`: its state, cache, KV received, replica stream."""
        self.microbatches.pop(number, None)
        self.caches.remove(number)
        self.restored.pop(number, None)
        self.staged.pop(number, None)
        if self.replicator is not None:
            self.replicator.end(number)

    def _rewind(self, message: Message) -> None:
        """Continue microbatch `microbatch` from position `positions`, which the head will feed with the token of
        step `steps`: crop the cache held here to it (a replacement builds it from its restored replica), and
        replicate from there (from 0 to a new holder, else from where the replica reaches)."""
        fields = message.fields
        number, positions, steps = int(fields["microbatch"]), int(fields["positions"]), int(fields["steps"])
        prompt_mask, ended, rng = message.tensors
        if number in self.restored:
            cache = cache_from(self.restored.pop(number), self.stage.config)
        else:
            cache = self.caches.acquire(number)
            if cache.get_seq_length() > positions:
                cache.crop(positions - cache.get_seq_length())  # transformers crops by a negative count
        self.caches.remove(number)
        self.caches.new_cache(number, cache)
        state = _Microbatch(positions_needed(prompt_mask.shape[1], max(fields["max_new_tokens"])),
                            torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_mask), steps - 1)], dim=1),
                            position_ids(prompt_mask)[:, -1:] + steps - 1, dict(fields))
        if self.stage.last:
            state.picker = TokenPicker(self.stage.adapter.model.generation_config, fields["decoding"])
            if rng.numel():
                state.picker.set_states(rng)
            state.ended, state.steps = ended.bool().clone(), steps
        self.microbatches[number] = state
        self.caches.add(number, state.capacity)
        if self.replicator is not None:
            self.replicator.start(number, cache, int(fields["replicated"]))
        self.head.send_tensor(pack(Message("rewound", {"stage": self.role.name, "microbatch": number,
                                                       "epoch": self.epoch})))

    def close(self) -> None:
        self._close_links()

    def _close_links(self) -> None:
        if self.replicator is not None:
            self.replicator.finish_all()
            self.replicator.holder.close()
        links = [self.following, self.first, *(self.sender.links if self.sender is not None else [])]
        if self.sender is not None:
            self.sender.close()
        for link in links:
            if link is not None:
                link.close()

    def _send(self, link: Transport | None, message: Message) -> None:
        """Post a step's message: no round trip per hop. A lost one fails the next post on that link, or the
        head's progress watchdog."""
        assert link is not None  # set for every message this stage sends on
        link.post_tensor(pack(Message(message.kind, {**message.fields, "epoch": self.epoch}, message.tensors)))


def run_worker(join: str, host: str = "127.0.0.1", threads: int | None = None) -> None:
    """Join the head at `join` (a transport URL such as tcp://host:port), serve the stage it assigns, and
    return once it says `shutdown`. The token of the head's servers comes from `DEJAVU_TOKEN`."""
    token = os.environ.get("DEJAVU_TOKEN") or None
    scheme = join.partition("://")[0]
    with serve(f"{scheme}://{host}:0", token=token) as inbox, open_transport(join) as head:
        _join(head, Message("join", {"url": inbox.url, "pid": os.getpid()}))
        assign = unpack(inbox.recv_tensor(timeout=ASSIGN_TIMEOUT))
        model = None
        if assign.kind == "standby":  # load the model now, and wait (beating) until a stage needs this worker
            torch.set_num_threads(threads if threads is not None else assign.fields["threads"])
            model = load_model(assign.fields["model"])
            head.send_tensor(pack(Message("warm", {"url": inbox.url})))
            assign = _wait_for_assignment(inbox, head)
        if assign.kind == "shutdown":
            return
        if assign.kind != "assign":
            raise TransportError(f"the head sent {assign.kind!r} where an assignment was due")
        fields = assign.fields
        torch.set_num_threads(threads if threads is not None else fields["threads"])  # the worker's own choice first
        try:
            stage = Stage(model if model is not None else load_model(fields["model"]), tuple(fields["layers"]))
        except Exception as error:  # whatever stops the stage from loading, the head must hear of it
            head.send_tensor(_failure(fields["stage"], error, int(fields.get("epoch", 0))))
            raise
        role = Role(fields["role"], fields["number"], fields["stages"], fields["name"])
        following, first, sender, replicator = open_links(fields, role)
        worker = StageWorker(stage, role, inbox, head, following, first, fields["eos"], fields["pad"], sender,
                             bool(fields.get("swapping")), None, replicator, bool(fields.get("recovery")),
                             int(fields.get("epoch", 0)), fields.get("replica_prefix", ""))
        try:
            head.send_tensor(pack(Message("ready", {"stage": fields["stage"], "epoch": worker.epoch})))
            worker.heartbeat = Heartbeat(head, role.name, float(fields["heartbeat"]), lambda: worker.epoch)
            worker.run()
        finally:
            if worker.heartbeat is not None:
                worker.heartbeat.close()
            worker.close()


def open_links(fields: dict[str, Any], role: Role) -> tuple[Transport | None, Transport | None, LayerSender | None,
                                                             Replicator | None]:
    """A stage's links, from its assignment (or a recovery's `relink`): to the next stage of its pipeline, the
    last stage's back to the first, a prompt stage's to the token stages, and a decoding stage's to the holder
    of its replicas."""
    following = open_transport(fields["next"]) if fields.get("next") else None
    first = open_transport(fields["first"]) if role.decodes and role.last else None
    token_links = [open_transport(url) for url in fields.get("token_stages", [])]
    sender = LayerSender(token_links, LayerPartition(fields["token_boundaries"])) if token_links else None
    replicator = None
    start, stop = fields["layers"]
    prefix = fields.get("replica_prefix", "")
    if fields.get("replica_store"):
        replicator = Replicator(open_store(fields["replica_store"]), role.number, stop - start, prefix)
    elif fields.get("holder"):
        replicator = Replicator(Store(open_transport(fields["holder"])), role.number, stop - start, prefix)
    return following, first, sender, replicator


def _wait_for_assignment(inbox: Server, head: Transport) -> Message:
    """A standby's wait: the head's next message (an assignment, or shutdown); a head gone ends it."""
    while True:
        try:
            return unpack(inbox.recv_tensor(timeout=QUIET))
        except TransportError:  # noqa: PERF203 - a quiet inbox: is the head still there?
            head.send_tensor(pack(Message("heartbeat", {"stage": "standby"})))


def _failure(stage: str | int, error: BaseException, epoch: int = 0) -> torch.Tensor:
    """The `failed` message that tells the head which stage failed (in which epoch), and why."""
    return pack(Message("failed", {"stage": stage, "epoch": epoch, "error": f"{type(error).__name__}: {error}"}))


def _join(head: Transport, join: Message) -> None:
    """Send `join`, retrying while the head is not listening yet (workers may start before it)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while True:
        try:
            head.send_tensor(pack(join))
            return
        except TransportError:  # noqa: PERF203 - refused: the head is not listening yet, so try again
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
