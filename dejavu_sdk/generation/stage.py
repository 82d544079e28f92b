"""One pipeline stage: layers [a, b) of a Hugging Face causal LM, with KV caches indexed from 0.

The first stage embeds token ids; every stage runs its layers; the last applies the final norm and the
head and returns the next position's logits. Run in order over the same inputs, the stages compute bit for
bit what the whole model computes (same masks, positions and kernels), so a pipeline decodes exactly the
tokens `model.generate` would.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from ..errors import ConfigError
from .adapters import StageAdapter, adapter_for


class Stage:
    """Layers `layers` = (a, b) of `model`, run as one pipeline stage.

    It takes the model over: the other decoder layers are dropped, and so are the embeddings unless the stage
    is the first and the final norm and head unless it is the last (a stage process keeps only its share of
    the weights). The kept layers index the stage's caches from 0 (`new_cache`).
    """

    def __init__(self, model: Any, layers: tuple[int, int]) -> None:
        self.adapter: StageAdapter = adapter_for(model)
        total = len(self.adapter.decoder_layers())
        self.layers = check_layers(layers, total)
        start, stop = self.layers
        self.first, self.last = start == 0, stop == total
        kept = nn.ModuleList(list(self.adapter.decoder_layers())[start:stop])
        self.adapter.set_decoder_layers(kept)
        for local, layer in enumerate(kept):
            self.adapter.attention(layer).layer_idx = local
        self.adapter.drop_unused(self.first, self.last)
        self.config = stage_config(model.config, start, stop)
        self.layer_types: list[str] = list(getattr(self.config, "layer_types", None) or
                                           ["full_attention"] * (stop - start))
        self._modules = kept
        #: Layers run so far, over every forward: a heartbeat sends it, so that the head tells a stage that computes
        #: for long (a long prompt) from one that is stuck.
        self.layers_run = 0
        model.eval()

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for this stage's layers (one per microbatch)."""
        return DynamicCache(config=self.config)

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: DynamicCache, after_layer: Callable[[int], None] | None = None,
                on_hidden: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run the stage on new positions.

        `inputs`: token ids `[B, T]` on the first stage, else the previous stage's hidden states `[B, T, H]`;
        `attention_mask`: `[B, past + T]`, 0 at (left) padding; `position_ids`: `[B, T]` (`position_ids`
        gives them from the mask). Returns the hidden states for the next stage, or on the last stage the
        float32 logits of the position after the last `[B, vocab]`. `after_layer(i)` runs as soon as the
        stage's i-th layer is done (its KV in `cache.layers[i]`): a prompt stage streams that layer's KV from it.
        `on_hidden(hidden)` gets the last stage's final hidden states `[B, T, H]` before its head (for the logits
        of every position: `adapter.head(hidden, every_position=True)`).
        """
        hidden = self.adapter.embed(inputs, position_ids) if self.first else inputs
        # `generate` drops a mask without padding, so that attention takes its causal fast path: so do stages.
        mask = None if bool(attention_mask.all()) else attention_mask
        call = self.adapter.layer_call(hidden, mask, position_ids, cache, self.layer_types)
        for index, layer in enumerate(self._modules):
            hidden = call(index, layer, hidden)
            self.layers_run += 1
            if after_layer is not None:
                after_layer(index)
        if not self.last:
            return hidden
        if on_hidden is not None:
            on_hidden(hidden)
        return self.adapter.head(hidden)


def check_layers(layers: Any, total: int) -> tuple[int, int]:
    """`layers` as a (start, stop) pair within a model of `total` decoder layers; ConfigError otherwise."""
    pair = tuple(layers) if isinstance(layers, (tuple, list)) else ()
    if len(pair) != 2 or not all(isinstance(bound, int) and not isinstance(bound, bool) for bound in pair):
        raise ConfigError(f"a stage's layers are a (start, stop) pair of ints, got {layers!r}")
    start, stop = pair
    if not 0 <= start < stop <= total:
        raise ConfigError(f"a stage's layers ({start}, {stop}) must satisfy 0 <= start < stop <= {total}, "
                          f"the model's decoder layers")
    return start, stop


def stage_config(config: Any, start: int, stop: int) -> Any:
    """A copy of `config` describing layers [start, stop) alone: their count, and their attention types."""
    staged = copy.deepcopy(config)
    types = getattr(config, "layer_types", None)
    staged.num_hidden_layers = stop - start
    if types is not None:
        staged.layer_types = list(types[start:stop])
    return staged


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions `generate` gives a prompt's tokens: the count of unmasked tokens so far, minus one, and 0
    for padding. Each decoded token then takes the previous position plus one."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)
