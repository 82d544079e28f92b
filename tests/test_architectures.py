"""Five architectures: the engine's tokens and logits equal model.generate's, and resume is exact.

Random weights with a large init range, so a position bug changes the tokens instead of hiding."""

from __future__ import annotations

import pytest
import torch
from tiny_models import MODELS, SMALL, VOCAB, Crash
from transformers import LlamaConfig, LogitsProcessorList

import dejavu_sdk as dv
from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.stores import MemoryStore

NEW = 12


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
