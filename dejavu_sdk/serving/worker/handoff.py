"""Prompt/token disaggregation: a prompt stage's KV, layer by layer, into the token stages' host memory.

A prompt stage runs a microbatch's prompt, a chunk of columns at a time (`prompt_steps`); as each of its layers
finishes a chunk, `LayerSender` cuts that layer's new KV at the token pipeline's stage boundaries (`stream_out`:
the two pipelines may cut the model differently) and sends each piece, on a thread of its own so that the next
layer computes meanwhile, to the token stage that owns the layer. A sliding-window layer keeps only its last
positions, so it is sent once, whole, after the last chunk. A token stage keeps the pieces it receives
(`StagedKV`) until the microbatch starts decoding there, then builds the microbatch's cache from them
(`StagedKV.cache`).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from ...blocks import BlockKey
from ...errors import TransportError
from ...stream import LayerPartition, stream_out
from ...transports.base import Transport
from ..wire.messages import Kv, SlotRound, pack


class _OneBlock:
    """The block `stream_out` cuts: one layer's KV, already in memory."""

    def __init__(self, key: BlockKey, block: torch.Tensor) -> None:
        self.key, self.block = key, block

    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor:
        assert key == self.key, key  # stream_out fetches only the keys it was given
        return self.block


class LayerSender:
    """Streams a prompt stage's finished layers to the token stages, on its own thread.

    `links[i]` reaches token stage i, whose layers the `destination` partition gives. A failed send is kept
    and raised by the next `check()` (the worker's loop calls it), so the head hears of it.
    """

    def __init__(self, links: list[Transport], destination: LayerPartition) -> None:
        self.links, self.destination = links, destination
        self._work: queue.SimpleQueue[tuple[int, int, torch.Tensor, torch.Tensor, int, bool] | None] = \
            queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dejavu-kv-sender", daemon=True)
        self._thread.start()

    def layer_done(self, microbatch: int, layer: int, keys: torch.Tensor, values: torch.Tensor,
                   epoch: int = 0, last: bool = True) -> None:
        """Send global `layer`'s new KV `[B, H_kv, positions, D]` of `microbatch` (the positions after those sent
        before; a sliding-window layer's are the last ones it keeps, sent `last`), computed in `epoch` (the token
        stages drop KV of epochs before theirs); `last`: the layer has no more to come."""
        self._work.put((microbatch, layer, keys, values, epoch, last))

    def check(self) -> None:
        """Raise the error a send met, if any."""
        if self._error is not None:
            raise TransportError(f"streaming KV to the token stages failed: {self._error}")

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            if self._error is not None:
                continue  # the worker is failing; drop the rest
            microbatch, layer, keys, values, epoch, last = item
            try:
                self._send(microbatch, layer, keys, values, epoch, last)
            except Exception as error:  # kept for the worker's thread to raise
                self._error = error

    def _send(self, microbatch: int, layer: int, keys: torch.Tensor, values: torch.Tensor, epoch: int,
              last: bool) -> None:
        positions = int(keys.shape[2])
        key = BlockKey(f"microbatch-{microbatch}", layers=(layer, layer + 1), tokens=(0, positions))
        block = torch.stack((keys, values)).unsqueeze(0)
        for stage, piece_key, piece in stream_out(_OneBlock(key, block), [key], self.destination):
            kv = Kv(microbatch=microbatch, epoch=epoch, last=last, layers=piece_key.layers, piece=piece)
            self.links[stage].post_tensor(pack(kv))


@attrs.define
class StagedKV:
    """The KV a token stage holds for one microbatch before it decodes it: local layer -> its pieces in position
    order, each `[2, B, H, S, D]`, and the layers whose last piece is here."""

    layers: int
    pieces: dict[int, list[torch.Tensor]] = attrs.field(factory=dict)
    finished: set[int] = attrs.field(factory=set)
    start: SlotRound | None = None  # the round that came before the last piece

    def add(self, first_layer: int, layers: tuple[int, int], piece: torch.Tensor, last: bool = True) -> None:
        for offset, layer in enumerate(range(*layers)):
            local = layer - first_layer
            if not 0 <= local < self.layers or local in self.finished:
                raise TransportError(f"KV of layer {layer} arrived where it does not belong, or after its last piece")
            self.pieces.setdefault(local, []).append(piece[offset])
            if last:
                self.finished.add(local)

    @property
    def complete(self) -> bool:
        return len(self.finished) == self.layers

    def cache(self, config: Any, prompt_positions: int) -> DynamicCache:
        """The microbatch's cache for this stage's layers, as the prompt pipeline left it: a sliding-window
        layer holds only its last positions, and counts all `prompt_positions` it has seen."""
        cache = DynamicCache(config=config)
        for local in range(self.layers):
            pieces = self.pieces[local]
            block = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=3)
            cache.update(block[0], block[1], local)
            layer = cache.layers[local]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = prompt_positions
        return cache
