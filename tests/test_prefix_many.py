"""`generate_many` with a prefix cache: a prompt prefilled alone starts from the chunks it finds and keeps its own,
and every request's tokens stay exact: under continuous batching they equal `replay` of the slot's rounds (which
computes the chunks read, chunk by chunk, as they were kept), a static microbatch of one equals `model.generate`
prefilling at the chunks' boundaries, and chunks kept by `generate` serve `generate_many` and the other way round."""

from __future__ import annotations

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.replay import replay
from dejavu_sdk.models import random_llama

CHUNK = 16
NEW = 6


@pytest.fixture(scope="module")
def model():
    return random_llama(layers=3)


def _prompts(lengths: list[int], head: int, seed: int) -> list[torch.Tensor]:
    """Prompts of `lengths` sharing their first `head` tokens."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, 96, (head,), generator=generator)
    prompts = [torch.randint(1, 96, (length,), generator=generator) for length in lengths]
    for prompt in prompts:
        prompt[:head] = shared[:min(head, prompt.numel())]
    return prompts


def _assert_replayed(model, prompts, results, decoding: Decoding) -> None:
    requests = {result.request: Request(prompt, NEW, decoding) for result, prompt in zip(results, prompts, strict=True)}
    for result in results:
        assert result.schedule, "continuous results carry their slot's rounds"
        want = replay(model, result.schedule, requests)[result.request]
        assert result.tokens.tolist() == want.tolist(), result.request


@pytest.mark.parametrize("settings", [{}, {"do_sample": True, "seed": 7, "top_k": 20}], ids=["greedy", "sampled"])
def test_continuous_batching_reads_the_shared_chunks_and_equals_the_replay_of_its_rounds(model, settings) -> None:
    prompts = _prompts([40, 37, 52, 45, 20], head=34, seed=1)  # two whole chunks shared, then their own
    decoding = Decoding.of(**settings)
    with DejaVuEngine(model, prefix_cache="memory://", prefix_chunk=CHUNK) as engine:
        cold = engine.generate_many(prompts, NEW, microbatch=2, batching="continuous", **settings)
        engine.prefix.cache.drain()
        warm = engine.generate_many(prompts, NEW, microbatch=2, batching="continuous", **settings)
    # cold, the first prompt reads nothing; those after it read the shared chunks it kept, once they land
    assert cold[0].cached_positions == 0
    assert [result.cached_positions for result in warm] == [32, 32, 48, 32, 16]
    _assert_replayed(model, prompts, cold, decoding)
    _assert_replayed(model, prompts, warm, decoding)
    first = next(step for step in warm[0].schedule if step.prefill is not None and warm[0].request in step.prefill[0])
    assert first.prefill[1:] == (0, 40)  # the chunks read are its first round's columns, computed chunk by chunk
    assert first.chunk == CHUNK


def test_a_static_microbatch_of_one_with_a_hit_equals_generate_at_the_chunk_boundaries(model) -> None:
    prompts = _prompts([50, 41], head=40, seed=2)
    with DejaVuEngine(model, prefix_cache="memory://", prefix_chunk=CHUNK) as engine:
        engine.generate_many(prompts[:1], NEW, microbatch=1)
        engine.prefix.cache.drain()
        results = engine.generate_many(prompts, NEW, microbatch=1)
        padded = engine.generate_many(prompts, NEW, microbatch=2)
    assert [result.cached_positions for result in results] == [48, 32]
    assert [result.cached_positions for result in padded] == [0, 0]  # a padded microbatch reads nothing
    for prompt, result in zip(prompts, results, strict=True):
        ids = prompt[None]
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                              prefill_chunk_size=CHUNK)[0, ids.shape[1]:]
        assert result.tokens.tolist() == want.tolist()


def test_chunks_kept_by_generate_serve_generate_many_and_the_other_way_round(model) -> None:
    prompts = _prompts([45, 60], head=45, seed=3)
    with DejaVuEngine(model, prefix_cache="memory://", prefix_chunk=CHUNK) as engine:
        engine.generate(prompts[0][None], max_new_tokens=NEW)
        engine.prefix.cache.drain()
        (many,) = engine.generate_many(prompts[1:], NEW, batching="continuous")
        engine.prefix.cache.drain()
        again = engine.generate(prompts[1][None], max_new_tokens=NEW)
        read_by_generate = engine.cached_positions
    assert many.cached_positions == 32
    _assert_replayed(model, prompts[1:], [many], Decoding())
    assert read_by_generate == 48  # the chunks generate_many kept, past the 32 it read
    ids = prompts[1][None]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, prefill_chunk_size=CHUNK)
    assert torch.equal(again, want)


def test_tenants_share_no_chunks_and_another_prefill_budget_is_refused(model) -> None:
    prompts = _prompts([40, 40], head=40, seed=4)
    with DejaVuEngine(model, prefix_cache="memory://", prefix_chunk=CHUNK) as engine:
        engine.generate_many(prompts[:1], NEW, batching="continuous", cache_salt="tenant a")
        engine.prefix.cache.drain()
        other = engine.generate_many(prompts[1:], NEW, batching="continuous", cache_salt="tenant b")
        same = engine.generate_many(prompts[1:], NEW, batching="continuous", cache_salt="tenant a")
        with pytest.raises(dv.ConfigError, match="max_prefill_tokens=8 with a prefix cache"):
            engine.generate_many(prompts, NEW, batching="continuous", max_prefill_tokens=8)
        with pytest.raises(dv.ConfigError, match="salt"):
            engine.generate_many(prompts, NEW, cache_salt=3)
    assert other[0].cached_positions == 0
    assert same[0].cached_positions == 32
