"""Stages of five architectures, run in order, produce model.generate's logits and tokens bit for bit."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from tiny_models import MODELS, SMALL, VOCAB
from transformers import Qwen2Config, Qwen2ForCausalLM

import dejavu_sdk as dv
from dejavu_sdk.models import random_llama
from dejavu_sdk.serving import Stage, adapter_for, position_ids

NEW = 10
ARCHITECTURES = {
    **MODELS,
    # Qwen2 with a sliding window on its last two layers: each stage must give each layer its own mask type.
    "qwen2-sliding": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, intermediate_size=128, num_key_value_heads=2,
                                                          use_sliding_window=True, sliding_window=4,
                                                          max_window_layers=1, initializer_range=0.2,
                                                          pad_token_id=0)),
}
CUTS = {"whole": [(0, 3)], "1+2": [(0, 1), (1, 3)], "2+1": [(0, 2), (2, 3)], "1+1+1": [(0, 1), (1, 2), (2, 3)]}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model(request):
    torch.manual_seed(0)
    return ARCHITECTURES[request.param]().eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, of different lengths
    mask[2, :1] = 0
    return ids, mask


def _generate_through(stages: list[Stage], ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                      eos: int | None, pad: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding through the stages, as a pipeline runs it: prefill, then one position per step; a row
    that produced `eos` produces `pad` from then on, and decoding stops when every row has ended."""
    caches = [stage.new_cache() for stage in stages]
    inputs, positions, tokens, logits = ids, position_ids(mask), [], []
    ended = torch.zeros(len(ids), dtype=torch.bool)
    for _ in range(new_tokens):
        hidden = inputs
        for stage, cache in zip(stages, caches, strict=True):
            hidden = stage.forward(hidden, mask, positions, cache)
        logits.append(hidden)
        tokens.append(hidden.argmax(-1).masked_fill(ended, pad))
        if eos is not None:
            ended |= tokens[-1] == eos
        if ended.all():
            break
        inputs = tokens[-1][:, None]
        mask = torch.cat([mask, mask.new_ones(len(ids), 1)], dim=1)
        positions = positions[:, -1:] + 1
    return torch.stack(tokens, dim=1), logits


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_stages_give_generates_logits_and_tokens(model, cut) -> None:
    ids, mask = _inputs()
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                              return_dict_in_generate=True, output_logits=True)
    stages = [Stage(copy.deepcopy(model), layers) for layers in CUTS[cut]]
    tokens, logits = _generate_through(stages, ids, mask, NEW, model.generation_config.eos_token_id,
                                       model.generation_config.pad_token_id)
    assert torch.equal(tokens, expected.sequences[:, ids.shape[1]:])
    assert all(torch.equal(got, want) for got, want in zip(logits, expected.logits, strict=True))


def test_a_stage_keeps_only_its_own_layers_and_parts(model) -> None:
    middle = Stage(copy.deepcopy(model), (1, 2))
    assert (middle.first, middle.last) == (False, False)
    assert len(middle.adapter.decoder_layers()) == 1
    assert middle.adapter.attention(middle.adapter.decoder_layers()[0]).layer_idx == 0
    assert middle.config.num_hidden_layers == 1
    assert getattr(middle.adapter.model, "lm_head", None) is None
    kept = sum(parameter.numel() for parameter in middle.adapter.model.parameters())
    assert kept < sum(parameter.numel() for parameter in model.parameters()) / 2


def test_each_stage_gives_its_layers_their_own_attention_types() -> None:
    stage = Stage(ARCHITECTURES["qwen2-sliding"](), (0, 2))
    assert stage.layer_types == ["full_attention", "sliding_attention"]
    assert [type(layer).__name__ for layer in stage.new_cache().layers] == ["DynamicLayer", "DynamicSlidingWindowLayer"]


@pytest.mark.parametrize("layers", [(0, 4), (2, 2), (-1, 2), ("a", 1), (0,), None])
def test_layers_outside_the_model_are_refused(layers) -> None:
    with pytest.raises(dv.ConfigError, match="layers"):
        Stage(MODELS["llama"](), layers)


def test_an_architecture_without_an_adapter_is_refused_naming_what_to_write() -> None:
    unknown = types.SimpleNamespace(config=types.SimpleNamespace(model_type="mamba"))
    with pytest.raises(dv.ConfigError, match=r"mamba.*StageAdapter"):
        adapter_for(unknown)


def test_a_tied_heads_embeddings_stay_on_the_last_stage_only() -> None:
    model = random_llama(layers=3, tie_embeddings=True)
    first, middle, last = (Stage(copy.deepcopy(model), layers) for layers in [(0, 1), (1, 2), (2, 3)])
    assert first.adapter.model.model.embed_tokens is not None
    assert middle.adapter.model.model.embed_tokens is None
    assert last.adapter.model.lm_head.weight is last.adapter.model.model.embed_tokens.weight
