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


@pytest.mark.parametrize(("option", "value"), [
    ("replicate_every", 0), ("on_replica_error", "ignore"), ("replicate_within_ms", 0), ("replicate_within_ms", -1),
    ("replicate_within_ms", "5"), ("replicate_within_ms", True), ("replicate_within_ms", float("inf")),
    ("prompt_streaming", "auto"),
    ("prompt_streaming", "later")])
def test_bad_options_are_refused(option: str, value) -> None:
    with pytest.raises(dv.ConfigError, match=option):
        CacheManager(MemoryStore(), "s", 2, **{option: value})


def test_progress_records_for_a_sink_that_cannot_take_them_are_refused() -> None:
    class BlocksOnly:
        def flush(self, key, block) -> None:
            pass

    with pytest.raises(dv.ConfigError, match="progress_for needs a ProgressSink"):
        CacheManager(BlocksOnly(), "s", 2, progress_for=lambda key, positions: (None, b"{}"))


class RecordingStore(MemoryStore):
    """A store that remembers which blocks each of its write requests carried."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[list[tuple[int, int]]] = []

    def flush_group_with_progress(self, group) -> None:
        self.requests.append([key.tokens for key, *_ in group])
        super().flush_group_with_progress(group)

    def flush_group(self, blocks) -> None:
        self.requests.append([key.tokens for key, _ in blocks])
        super().flush_group(blocks)

    def flush(self, key, block) -> None:  # one block, one request
        self.requests.append([key.tokens])
        super().flush(key, block)


def _with_progress(model, store, **options):
    """Generate with progress records, as the engine does (blocks and records together)."""
    steps = iter(range(1000))
    return _generate(model, store, run="ab", **options,
                     progress_for=lambda key, positions: (dv.ProgressKey("req-1", "ab", 0, next(steps)), b"{}"))


@pytest.mark.parametrize("progress", [True, False], ids=["with progress records", "blocks alone"])
@pytest.mark.parametrize("prompt_streaming", ["layerwise", "after"])
def test_the_prompt_leaves_layer_by_layer_or_in_one_write_after_the_forward(model, prompt_streaming: str,
                                                                           progress: bool) -> None:
    store = RecordingStore()
    ids, mask = _inputs()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    if progress:
        out, cache, manager = _with_progress(model, store, prompt_streaming=prompt_streaming)
    else:  # a custom loop's cache (engine.cache): blocks without progress records go together too
        out, cache, manager = _generate(model, store, prompt_streaming=prompt_streaming)
    manager.finish()
    assert torch.equal(out, expected)
    layers = model.config.num_hidden_layers
    prompt_writes = [request for request in store.requests if (0, PROMPT) in request]
    if prompt_streaming == "after":  # every layer's block in one request (these are small)
        assert len(prompt_writes) == 1
        assert prompt_writes[0].count((0, PROMPT)) == layers  # decode steps that waited may join them
    else:  # each layer its own request, unless the streamer fell behind and wrote what waited together
        assert sum(request.count((0, PROMPT)) for request in prompt_writes) == layers
    spec = dv.KVSpec(layers=layers, kv_heads=2, head_dim=16, dtype="float32", batch=2)
    assert same_bits(gather(store, store.keys("req-1"), spec, PROMPT + NEW - 1), _cache_tensor(cache))


class FakeClock:
    """`time.perf_counter` for the cache module: each reading is `step` seconds after the previous one, as
    if every decode step took that long."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 100.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.parametrize(("step_ms", "within_ms", "sizes"), [
    (10, 25, [3, 3, 3, 3, 3, 3, 1]),  # a group waits while the next step would still end within 25 ms
    (10, 15, [2] * 9 + [1]),
    (35, 25, [2] + [1] * 17),  # steps longer than the bound leave one by one (the first has no previous step)
    (10, None, [8, 8, 3]),  # no time bound: full blocks
    (1, 1000, [8, 8, 3]),  # replicate_every bounds the steps of a block whatever the time
])
def test_decode_steps_are_grouped_by_steps_and_by_time(model, monkeypatch, step_ms, within_ms, sizes) -> None:
    import dejavu_sdk.cache as cache_module

    monkeypatch.setattr(cache_module, "time", FakeClock(step_ms / 1000))
    store = MemoryStore()
    manager = CacheManager(store, "loop", model.config.num_hidden_layers, replicate_every=8,
                           replicate_within_ms=within_ms)
    cache = StreamingCache(manager, config=model.config)
    ids, _mask = _inputs()
    tokens = ids
    with torch.no_grad():
        for _ in range(20):  # the prompt, then 19 decode steps
            logits = model(tokens[:, cache.get_seq_length():], cache=cache).logits
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    decode = [key for key in manager.finish() if key.tokens[0] >= PROMPT]
    assert [key.tokens[1] - key.tokens[0] for key in decode] == sizes
    spec = dv.KVSpec(layers=3, kv_heads=2, head_dim=16, dtype="float32", batch=2)
    assert same_bits(gather(store, store.keys("loop"), spec, PROMPT + 19), _cache_tensor(cache))


def test_an_update_without_positions_streams_nothing(model) -> None:
    store = MemoryStore()
    _out, cache, manager = _generate(model, store)
    empty = torch.zeros(2, 2, 0, 16)
    cache.update(empty, empty, 0)  # a forward of no new token
    durable = manager.finish()
    assert max(key.tokens[1] for key in durable) == PROMPT + NEW - 1
    assert manager.durable_positions == PROMPT + NEW - 1


def test_staged_steps_leave_before_a_later_prompt(model) -> None:
    """A custom loop that appends several positions (a next turn) while decode steps wait in the staging
    buffer: the steps leave first, so the durable positions never stop short."""
    store = MemoryStore()
    manager = CacheManager(store, "turns", model.config.num_hidden_layers, replicate_every=8)
    cache = StreamingCache(manager, config=model.config)
    ids, _mask = _inputs()
    with torch.no_grad():
        model(ids, cache=cache)  # the prompt
        for _ in range(2):  # two decode steps, staged (a block holds up to 8)
            model(ids[:, -1:], cache=cache)
        model(ids[:, :3], cache=cache)  # a next turn of three positions
        model(ids[:, -1:], cache=cache)  # one more step
    manager.finish()
    assert cache.get_seq_length() == PROMPT + 2 + 3 + 1
    assert manager.durable_positions == PROMPT + 2 + 3 + 1
    spec = dv.KVSpec(layers=3, kv_heads=2, head_dim=16, dtype="float32", batch=2)
    assert same_bits(gather(store, store.keys("turns"), spec, cache.get_seq_length()), _cache_tensor(cache))
