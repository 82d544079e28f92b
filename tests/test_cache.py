"""The streaming cache: generation is unchanged, and what reached the store is exactly the model's cache."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import LlamaForCausalLM

import dejavu_sdk as dv
from dejavu_sdk.cache import CacheManager, StreamingCache
from dejavu_sdk.models import random_llama
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.stream import gather
from dejavu_sdk.testing import same_bits

PROMPT, NEW = 7, 6


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return random_llama(layers=3, vocab_size=128, max_positions=256, pad_token_id=None)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    return ids, mask


def _generate(model, sink, **options):
    ids, mask = _inputs()
    manager = CacheManager(sink, "req-1", model.config.num_hidden_layers, **options)
    cache = StreamingCache(manager, config=model.config)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache=cache)
    return out, cache, manager


def _generate_and_finish(model, sink, **options):
    out, _, manager = _generate(model, sink, **options)
    return out, manager.finish()


def _cache_tensor(cache: StreamingCache) -> torch.Tensor:
    return torch.stack([torch.stack((layer.keys, layer.values)) for layer in cache.layers])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])  # bfloat16: a dtype numpy does not have
@pytest.mark.parametrize("replicate_every", [1, 4])
def test_generation_is_unchanged_and_the_replica_equals_the_cache(model, replicate_every: int, dtype: str) -> None:
    model = copy.deepcopy(model).to(getattr(torch, dtype))
    ids, mask = _inputs()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    store = MemoryStore()
    out, cache, manager = _generate(model, store, replicate_every=replicate_every)
    assert torch.equal(out, expected)
    durable = manager.finish()
    positions = PROMPT + NEW - 1  # the last token's KV is never computed
    layers = model.config.num_hidden_layers
    decode_blocks = -(-(NEW - 1) // replicate_every)
    assert len(durable) == layers + decode_blocks  # one block per layer for the prompt, then per k steps
    spec = dv.KVSpec(layers=layers, kv_heads=2, head_dim=16, dtype=dtype, batch=2)
    assert same_bits(gather(store, store.keys("req-1"), spec, positions), _cache_tensor(cache))


class SlowSink:
    """Takes its time, so the model runs ahead until the bounded queue pushes back."""

    def __init__(self) -> None:
        self.store = MemoryStore()

    def flush(self, key, block) -> None:
        time.sleep(0.01)
        self.store.flush(key, block)


def test_a_slow_sink_with_a_tiny_queue_still_gets_every_block(model) -> None:
    sink = SlowSink()
    _out, cache, manager = _generate(model, sink, queue_size=1)
    manager.finish()
    spec = dv.KVSpec(layers=3, kv_heads=2, head_dim=16, dtype="float32", batch=2)
    assert same_bits(gather(sink.store, sink.store.keys("req-1"), spec, PROMPT + NEW - 1), _cache_tensor(cache))


class FailingSink:
    def __init__(self, fail_after: int) -> None:
        self.calls, self.fail_after = 0, fail_after

    def flush(self, key, block) -> None:
        self.calls += 1
        if self.calls > self.fail_after:
            raise dv.StoreError("disk full")


def test_a_failing_replica_is_an_error_not_a_silent_gap(model) -> None:
    with pytest.raises(dv.ReplicationError, match="disk full"):  # from generate, or at the latest from finish
        _generate_and_finish(model, FailingSink(fail_after=2))


def test_on_replica_error_warn_lets_generation_finish(model) -> None:
    ids, mask = _inputs()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    with pytest.warns(UserWarning, match="disk full"):
        out, durable = _generate_and_finish(model, FailingSink(fail_after=1), on_replica_error="warn")
    assert torch.equal(out, expected)
    assert len(durable) == 1


def test_a_custom_loop_with_autograd_on_streams_too(model) -> None:
    ids, _mask = _inputs()
    store = MemoryStore()
    manager = CacheManager(store, "loop", model.config.num_hidden_layers)
    cache = StreamingCache(manager, config=model.config)
    tokens = ids
    for _ in range(3):  # no torch.no_grad(): the KV requires grad
        logits = model(tokens[:, cache.get_seq_length():], cache=cache).logits
        tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    assert [key.tokens for key in manager.finish()][-2:] == [(PROMPT, PROMPT + 1), (PROMPT + 1, PROMPT + 2)]


@pytest.mark.parametrize(("option", "value"), [("replicate_every", 0), ("on_replica_error", "ignore")])
def test_bad_options_are_refused(option: str, value) -> None:
    with pytest.raises(dv.ConfigError, match=option):
        CacheManager(MemoryStore(), "s", 2, **{option: value})


def test_progress_records_for_a_sink_that_cannot_take_them_are_refused() -> None:
    class BlocksOnly:
        def flush(self, key, block) -> None:
            pass

    with pytest.raises(dv.ConfigError, match="progress_for needs a ProgressSink"):
        CacheManager(BlocksOnly(), "s", 2, progress_for=lambda key, positions: (None, b"{}"))
