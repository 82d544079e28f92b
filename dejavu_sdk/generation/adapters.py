"""How to cut a Hugging Face causal LM into pipeline stages: one small adapter per model family.

An adapter names the parts of a model that a stage split needs: the token (and position) embeddings, the
decoder layers, the final norm and the head; and it runs one stage's layers the way the family's own
forward runs all of them (the same attention masks, rotary embeddings and arguments), so that the stages
together compute bit for bit what the whole model computes. Families: Llama (Llama, Mistral, Qwen2 and
SmolLM2, which is a Llama), OPT and GPT-2. Any other model is refused with `ConfigError` naming the
adapter to write.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..errors import ConfigError

#: Runs decoder layer `index` (counted within the stage) on the hidden states.
LayerCall = Callable[[int, nn.Module, torch.Tensor], torch.Tensor]


class StageAdapter(ABC):
    """The parts of one family's models that a pipeline stage needs, and how its decoder layers are called.

    Subclasses name the `model_types` (`config.model_type`) they serve and implement the four methods.
    `position_ids` are what `generate` gives the model: from the 2-D attention mask, `cumsum - 1`, with
    padding at position 0.
    """

    model_types: ClassVar[tuple[str, ...]]

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config

    @abstractmethod
    def decoder_layers(self) -> nn.ModuleList:
        """The model's decoder layers, in order (the container a stage replaces by its slice)."""

    @abstractmethod
    def set_decoder_layers(self, layers: nn.ModuleList) -> None:
        """Keep only `layers` in the model (a stage frees the others)."""

    @abstractmethod
    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input: the embeddings of `input_ids` `[B, T]` at `position_ids`."""

    @abstractmethod
    def layer_call(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                   cache: Cache, layer_types: list[str]) -> LayerCall:
        """How each of this stage's layers is called for this forward (masks and rotary embeddings made once).

        `attention_mask` is the 2-D mask of everything so far `[B, past + T]`, None without padding;
        `cache` the stage's own, indexed from 0 and made from the stage's config (so its layers have the
        stage's attention types); `layer_types` the attention type of each of the stage's layers.
        """

    @abstractmethod
    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layers between the last decoder layer and the head (the final norm), over every position."""

    def head(self, hidden: torch.Tensor, every_position: bool = False) -> torch.Tensor:
        """The last stage's output: `final` over every position, then the head on the last one (as `generate`
        does), as float32 logits `[B, vocab]`; with `every_position`, on each position `[B, T, vocab]`."""
        final = self.final(hidden)
        if every_position:
            return self.model.lm_head(final).float()
        return self.model.lm_head(final[:, -1:, :])[:, -1, :].float()

    @abstractmethod
    def drop_unused(self, first: bool, last: bool) -> None:
        """Free the embeddings unless `first` and the final norm and head unless `last`."""

    @staticmethod
    def attention(layer: nn.Module) -> Any:
        """The attention module of a decoder layer (it carries `layer_idx`, the index into the cache)."""
        return layer.self_attn


class LlamaAdapter(StageAdapter):
    """Llama and the families that share its layout: `model.model.{embed_tokens, layers, norm, rotary_emb}`,
    `model.lm_head`; Mistral's sliding window and Qwen2's per-layer attention types included."""

    model_types = ("llama", "mistral", "qwen2")

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def set_decoder_layers(self, layers: nn.ModuleList) -> None:
        self.model.model.layers = layers

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def layer_call(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                   cache: Cache, layer_types: list[str]) -> LayerCall:
        arguments = {"config": self.config, "inputs_embeds": hidden, "attention_mask": attention_mask, "cache": cache,
                     "position_ids": position_ids}
        if self.config.model_type == "mistral":  # one mask for every layer, sliding when the config says so
            function = create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask
            shared = function(**arguments)
            masks = dict.fromkeys(layer_types, shared)
        else:
            masks = {"full_attention": create_causal_mask(**arguments)}
            if "sliding_attention" in layer_types:
                masks["sliding_attention"] = create_sliding_window_causal_mask(**arguments)
        rotary = self.model.model.rotary_emb(hidden, position_ids)

        def call(index: int, layer: nn.Module, states: torch.Tensor) -> torch.Tensor:
            return layer(states, attention_mask=masks[layer_types[index]], position_embeddings=rotary,
                         position_ids=position_ids, cache=cache, use_cache=True)

        return call

    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(hidden)

    def drop_unused(self, first: bool, last: bool) -> None:
        if not first and not (last and _tied(self.model)):  # a tied head shares the embeddings' weight
            self.model.model.embed_tokens = None
        if not last:
            self.model.model.norm = None
            self.model.lm_head = None


class OPTAdapter(StageAdapter):
    """OPT: `model.model.decoder.{embed_tokens, embed_positions, project_in, layers, final_layer_norm,
    project_out}`, `model.lm_head`; learned positions added at the first stage."""

    model_types = ("opt",)

    @property
    def _decoder(self) -> Any:
        return self.model.model.decoder

    def decoder_layers(self) -> nn.ModuleList:
        return self._decoder.layers

    def set_decoder_layers(self, layers: nn.ModuleList) -> None:
        self._decoder.layers = layers

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        decoder = self._decoder
        embeddings = decoder.embed_tokens(input_ids)
        positions = decoder.embed_positions(None, 0, position_ids=position_ids)
        if decoder.project_in is not None:
            embeddings = decoder.project_in(embeddings)
        return embeddings + positions.to(embeddings.device)

    def layer_call(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                   cache: Cache, layer_types: list[str]) -> LayerCall:
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden,
                                  attention_mask=attention_mask, cache=cache)

        def call(index: int, layer: nn.Module, states: torch.Tensor) -> torch.Tensor:
            return layer(states, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True)

        return call

    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        decoder = self._decoder
        if decoder.final_layer_norm is not None:
            hidden = decoder.final_layer_norm(hidden)
        if decoder.project_out is not None:
            hidden = decoder.project_out(hidden)
        return hidden

    def drop_unused(self, first: bool, last: bool) -> None:
        decoder = self._decoder
        if not first:
            decoder.embed_positions = decoder.project_in = None
            if not (last and _tied(self.model)):
                decoder.embed_tokens = None
        if not last:
            decoder.final_layer_norm = decoder.project_out = None
            self.model.lm_head = None


class GPT2Adapter(StageAdapter):
    """GPT-2: `model.transformer.{wte, wpe, h, ln_f}`, `model.lm_head`; learned positions at the first stage."""

    model_types = ("gpt2",)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.transformer.h

    def set_decoder_layers(self, layers: nn.ModuleList) -> None:
        self.model.transformer.h = layers

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        transformer = self.model.transformer
        embeddings = transformer.wte(input_ids)
        return transformer.drop(embeddings + transformer.wpe(position_ids).to(embeddings.device))

    def layer_call(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                   cache: Cache, layer_types: list[str]) -> LayerCall:
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden,
                                  attention_mask=attention_mask, cache=cache, position_ids=position_ids)

        def call(index: int, layer: nn.Module, states: torch.Tensor) -> torch.Tensor:
            return layer(states, cache, mask, None, use_cache=True, position_ids=position_ids)

        return call

    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.ln_f(hidden)

    def drop_unused(self, first: bool, last: bool) -> None:
        transformer = self.model.transformer
        if not first:
            transformer.wpe = None
            if not (last and _tied(self.model)):
                transformer.wte = None
        if not last:
            transformer.ln_f = None
            self.model.lm_head = None

    @staticmethod
    def attention(layer: nn.Module) -> Any:
        return layer.attn


ADAPTERS: tuple[type[StageAdapter], ...] = (LlamaAdapter, OPTAdapter, GPT2Adapter)


def adapter_for(model: Any) -> StageAdapter:
    """The adapter of `model`'s family; ConfigError naming what to write for any other."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter(model)
    served = ", ".join(kind for adapter in ADAPTERS for kind in adapter.model_types)
    raise ConfigError(f"cannot cut a {type(model).__name__} (model_type {model_type!r}) into pipeline stages: "
                      f"adapters exist for {served}. Write a dejavu_sdk.serving.StageAdapter subclass for it (its "
                      "embeddings, decoder layers, final norm and head) and add it to dejavu_sdk.generation.ADAPTERS")


def _tied(model: Any) -> bool:
    """Whether the head shares its weight with the token embeddings (then the last stage needs them too)."""
    head = getattr(model, "lm_head", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return head is not None and embeddings is not None and head.weight is embeddings.weight
