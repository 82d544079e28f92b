"""Prompt/token disaggregation: a prompt stage's KV, layer by layer, into the token stages' host memory.

A prompt stage runs a microbatch's prompt; as each of its layers finishes, `LayerSender` cuts that layer's
KV at the token pipeline's stage boundaries (`stream_out`: the two pipelines may cut the model
differently) and sends each piece, on a thread of its own so that the next layer computes meanwhile, to the
token stage that owns the layer. A token stage keeps the pieces it receives (`StagedKV`) until the
microbatch starts decoding there, then builds the microbatch's cache from them (`StagedKV.cache`).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from ..blocks import BlockKey
from ..errors import TransportError
from ..stream import LayerPartition, stream_out
from ..transports.base import Transport
from .messages import Kind, Message, pack


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
        self._work: queue.SimpleQueue[tuple[int, int, torch.Tensor, torch.Tensor, int] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dejavu-kv-sender", daemon=True)
        self._thread.start()

    def layer_done(self, microbatch: int, layer: int, keys: torch.Tensor, values: torch.Tensor,
                   epoch: int = 0) -> None:
        """Send global `layer`'s KV `[B, H_kv, positions, D]` of `microbatch` (the positions a sliding-window
        layer keeps are the last ones), computed in `epoch` (the token stages drop KV of epochs before theirs)."""
        self._work.put((microbatch, layer, keys, values, epoch))

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
            microbatch, layer, keys, values, epoch = item
            try:
                self._send(microbatch, layer, keys, values, epoch)
            except Exception as error:  # kept for the worker's thread to raise
                self._error = error

    def _send(self, microbatch: int, layer: int, keys: torch.Tensor, values: torch.Tensor, epoch: int) -> None:
        positions = int(keys.shape[2])
        key = BlockKey(f"microbatch-{microbatch}", layers=(layer, layer + 1), tokens=(0, positions))
        block = torch.stack((keys, values)).unsqueeze(0)
        for stage, piece_key, piece in stream_out(_OneBlock(key, block), [key], self.destination):
            self.links[stage].post_tensor(pack(Message(Kind.KV, {"microbatch": microbatch, "epoch": epoch,
                                                            "layers": list(piece_key.layers)}, (piece,))))


@attrs.define
class StagedKV:
    """The KV a token stage holds for one microbatch before it decodes it: local layer -> `[2, B, H, S, D]`."""

    layers: int
    pieces: dict[int, torch.Tensor] = attrs.field(factory=dict)
    start: Message | None = None  # the head's `start`, when it came before the last piece

    def add(self, first_layer: int, layers: tuple[int, int], piece: torch.Tensor) -> None:
        for offset, layer in enumerate(range(*layers)):
            local = layer - first_layer
            if not 0 <= local < self.layers or local in self.pieces:
                raise TransportError(f"KV of layer {layer} arrived where it does not belong, or twice")
            self.pieces[local] = piece[offset]

    @property
    def complete(self) -> bool:
        return len(self.pieces) == self.layers

    def cache(self, config: Any, prompt_positions: int) -> DynamicCache:
        """The microbatch's cache for this stage's layers, as the prompt pipeline left it: a sliding-window
        layer holds only its last positions, and counts all `prompt_positions` it has seen."""
        cache = DynamicCache(config=config)
        for local in range(self.layers):
            block = self.pieces[local]
            cache.update(block[0], block[1], local)
            layer = cache.layers[local]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = prompt_positions
        return cache
