"""Five architectures: the engine's tokens and logits equal model.generate's, and resume is exact.

Random weights with a large init range, so a position bug changes the tokens instead of hiding."""

from __future__ import annotations

import pytest
import torch
from tiny_models import Crash
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import dejavu_sdk as dv
from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.stores import MemoryStore

VOCAB, NEW = 96, 12
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}

MODELS = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                               initializer_range=0.2, pad_token_id=0)),
    "opt": lambda: OPTForCausalLM(OPTConfig(**SMALL, ffn_dim=128, max_position_embeddings=128,
                                            word_embed_proj_dim=64, init_std=0.2, pad_token_id=0)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, intermediate_size=128, num_key_value_heads=2,
                                                  initializer_range=0.2, pad_token_id=0)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, intermediate_size=128, num_key_value_heads=2,
                                                        sliding_window=5, initializer_range=0.2, pad_token_id=0)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, intermediate_size=128, num_key_value_heads=2,
                                                  initializer_range=0.2, pad_token_id=0)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    return ids, mask


def test_tokens_and_logits_equal_model_generate(model, inputs) -> None:
    ids, mask = inputs
    options = {"max_new_tokens": NEW, "return_dict_in_generate": True, "output_logits": True}
    expected = model.generate(ids, attention_mask=mask, do_sample=False, **options)
    got = DejaVuEngine(model, store=MemoryStore()).generate(ids, attention_mask=mask, **options)
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits, strict=True))


def test_resume_after_a_crash_mid_decode_is_exact(model, inputs) -> None:
    ids, mask = inputs
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    store = MemoryStore()
    with pytest.raises(KeyboardInterrupt):
        DejaVuEngine(model, store=store).generate(ids, attention_mask=mask, max_new_tokens=NEW, stream_id="s",
                                                  logits_processor=LogitsProcessorList([Crash(7)]))
    assert torch.equal(DejaVuEngine(model, store=store).resume("s"), expected)


def test_models_without_a_kv_cache_are_refused() -> None:
    class Hybrid:
        config = LlamaConfig(**SMALL)

    Hybrid.config.layer_types = ["full_attention", "mamba", "linear_attention"]
    with pytest.raises(dv.ConfigError, match="linear_attention, mamba layers, which keep no KV cache"):
        DejaVuEngine(Hybrid(), store=MemoryStore())
