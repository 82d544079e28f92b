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
A worker that cannot reach a neighbour, or whose stage fails, tells the head (`failed`) and stops: the head
fails the requests in flight.
"""

from __future__ import annotations

import os
import time
from typing import Any

import attrs
import torch

from ..backends import open_transport, serve
from ..errors import TransportError
from ..models import load_model
from ..transports.base import Server, Transport
from .decoding import TokenPicker
from .messages import Message, pack, unpack
from .stage import Stage, position_ids

#: Seconds a worker waits for its assignment after joining.
ASSIGN_TIMEOUT = 120.0
#: Seconds a worker keeps trying to reach a head that is not listening yet.
JOIN_TIMEOUT = 120.0
#: Seconds between a worker's heartbeats while its inbox is quiet; a head that cannot take one is gone.
HEARTBEAT = 2.0


@attrs.define
class _Microbatch:
    """What one stage keeps of a microbatch between steps."""

    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    fields: dict[str, Any]
    ended: torch.Tensor | None = None  # the last stage's: rows that ended
    picker: TokenPicker | None = None  # the last stage's: how the next tokens are chosen
    steps: int = 0


class StageWorker:
    """Runs one assigned stage: `run()` returns when the head says `shutdown`."""

    def __init__(self, stage: Stage, inbox: Server, head: Transport, following: Transport | None,
                 first: Transport | None, number: int, stages: int, eos: list[int], pad: int) -> None:
        self.stage, self.inbox, self.head = stage, inbox, head
        self.following, self.first = following, first  # the next stage; the last stage's way back to the first
        self.number, self.stages, self.pad = number, stages, pad
        self.eos = torch.tensor(eos, dtype=torch.long)  # a row ends at any of them
        self.microbatches: dict[int, _Microbatch] = {}

    def run(self) -> None:
        while True:
            try:
                packed = self.inbox.recv_tensor(timeout=HEARTBEAT)
            except TransportError:  # a quiet inbox: show the head this worker lives (raises if the head is gone)
                self.head.send_tensor(pack(Message("heartbeat", {"stage": self.number})))
                continue
            try:
                message = unpack(packed)
                if message.kind == "shutdown":
                    return
                self.handle(message)
            except Exception as error:  # a neighbour is gone, a bad message, or the stage failed: tell the head
                self.head.send_tensor(pack(Message("failed", {"stage": self.number,
                                                              "error": f"{type(error).__name__}: {error}"})))
                raise

    def handle(self, message: Message) -> None:
        number = int(message.fields.get("microbatch", -1))
        if message.kind == "end":
            self.microbatches.pop(number, None)
            if self.number + 2 < self.stages:  # the last stage ended it and freed its own already
                self._send(self.following, message)
            return
        if message.kind == "prefill":
            inputs, mask = message.tensors
            state = _Microbatch(self.stage.new_cache(), mask.clone(), position_ids(mask), dict(message.fields))
            if self.stage.last:
                state.picker = TokenPicker(self.stage.adapter.model.generation_config, message.fields["decoding"])
            self.microbatches[number] = state
        elif message.kind == "decode":
            (inputs,) = message.tensors
            state = self.microbatches[number]
            state.mask = torch.cat([state.mask, state.mask.new_ones(len(state.mask), 1)], dim=1)
            state.positions = state.positions[:, -1:] + 1
        else:
            raise TransportError(f"stage {self.number} got a message of unknown kind {message.kind!r}")
        output = self.stage.forward(inputs, state.mask, state.positions, state.cache)
        if not self.stage.last:
            tensors = (output, state.mask) if message.kind == "prefill" else (output,)
            self._send(self.following, Message(message.kind, message.fields, tensors))
            return
        self._next_tokens(number, state, output)

    def _next_tokens(self, number: int, state: _Microbatch, logits: torch.Tensor) -> None:
        """The last stage: pick each row's next token, report it, and go on or end the microbatch."""
        if state.ended is None:
            state.ended = torch.zeros(len(logits), dtype=torch.bool)
        assert state.picker is not None  # made with the microbatch on the last stage
        tokens = state.picker(logits).masked_fill(state.ended, self.pad)
        state.steps += 1
        state.ended |= torch.isin(tokens, self.eos)
        state.ended |= torch.tensor([state.steps >= limit for limit in state.fields["max_new_tokens"]])
        self._send(self.head, Message("tokens", {"microbatch": number}, (tokens,)))
        if bool(state.ended.all()):
            del self.microbatches[number]
            self._send(self.head, Message("ended", {"microbatch": number}))
            if self.stages > 1:
                self._send(self.first, Message("end", {"microbatch": number}))
        else:
            self._send(self.first, Message("decode", {"microbatch": number}, (tokens[:, None],)))

    def _send(self, link: Transport | None, message: Message) -> None:
        assert link is not None  # set for every message this stage sends on
        link.send_tensor(pack(message))


def run_worker(join: str, host: str = "127.0.0.1", threads: int | None = None) -> None:
    """Join the head at `join` (a transport URL such as tcp://host:port), serve the stage it assigns, and
    return once it says `shutdown`. The token of the head's servers comes from `DEJAVU_TOKEN`."""
    token = os.environ.get("DEJAVU_TOKEN") or None
    scheme = join.partition("://")[0]
    with serve(f"{scheme}://{host}:0", token=token) as inbox, open_transport(join) as head:
        _join(head, Message("join", {"url": inbox.url, "pid": os.getpid()}))
        assign = unpack(inbox.recv_tensor(timeout=ASSIGN_TIMEOUT))
        if assign.kind != "assign":
            raise TransportError(f"the head sent {assign.kind!r} where an assignment was due")
        fields = assign.fields
        torch.set_num_threads(threads if threads is not None else fields["threads"])  # the worker's own choice first
        try:
            stage = Stage(load_model(fields["model"]), tuple(fields["layers"]))
        except Exception as error:  # whatever stops the stage from loading, the head must hear of it
            head.send_tensor(pack(Message("failed", {"stage": fields["stage"],
                                                     "error": f"{type(error).__name__}: {error}"})))
            raise
        following = open_transport(fields["next"]) if fields.get("next") else None
        first = open_transport(fields["first"]) if stage.last else None
        try:
            head.send_tensor(pack(Message("ready", {"stage": fields["stage"]})))
            StageWorker(stage, inbox, head, following, first, fields["stage"], fields["stages"], fields["eos"],
                        fields["pad"]).run()
        finally:
            for link in (following, first):
                if link is not None:
                    link.close()


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
