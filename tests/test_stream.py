from __future__ import annotations

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.stream import (
    LayerPartition,
    StagingBuffer,
    check_tiling,
    gather,
    plan_stream_out,
    scatter,
    stream_in,
    stream_out,
)
from dejavu_sdk.testing import random_tensor, same_bits

SPEC = dv.KVSpec(layers=6, kv_heads=2, head_dim=8, dtype="bfloat16", batch=2)
PROMPT, STEPS = 5, 4


def _cache(positions: int = PROMPT + STEPS) -> torch.Tensor:
    """A full cache [L, 2, B, H, S, D] of random bits."""
    return random_tensor((SPEC.layers, 2, SPEC.batch, SPEC.kv_heads, positions, SPEC.head_dim), torch.bfloat16)


def _layer_kv(cache: torch.Tensor, layers: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(cache[layer, 0], cache[layer, 1]) for layer in layers]


def test_even_partitions_and_bad_boundaries() -> None:
    assert LayerPartition.even(30, 4).boundaries == (0, 8, 16, 23, 30)
    assert LayerPartition.even(30, 2).stages == [(0, 15), (15, 30)]
    for bad in [(0,), (1, 5), (0, 5, 5), (0, 6, 3)]:
        with pytest.raises(dv.ConfigError, match="boundaries"):
            LayerPartition(bad)
    with pytest.raises(dv.ConfigError, match="cannot cut"):
        LayerPartition.even(3, 4)


@pytest.mark.parametrize("buffered", [True, False])
def test_scatter_then_gather_rebuilds_the_cache_bit_for_bit(buffered: bool) -> None:
    cache, store = _cache(), MemoryStore()
    every_layer = range(SPEC.layers)
    keys = scatter(store, "s", _layer_kv(cache, every_layer), (0, SPEC.layers), (0, PROMPT))  # prefill: per layer
    assert len(keys) == SPEC.layers
    staging = StagingBuffer(SPEC, (0, SPEC.layers)) if buffered else None
    for position in range(PROMPT, PROMPT + STEPS):  # decode: one block per step when buffered
        keys += scatter(store, "s", _layer_kv(cache, every_layer), (0, SPEC.layers), (position, position + 1),
                        staging)
    assert len(keys) == SPEC.layers + STEPS * (1 if buffered else SPEC.layers)
    assert same_bits(gather(store, store.keys("s"), SPEC, PROMPT + STEPS), cache)


def test_gather_of_a_layer_range_and_a_prefix_of_positions() -> None:
    cache, store = _cache(), MemoryStore()
    keys = scatter(store, "s", _layer_kv(cache, range(2, 4)), (2, 4), (0, PROMPT))
    out = torch.zeros(2, 2, SPEC.batch, SPEC.kv_heads, PROMPT, SPEC.head_dim, dtype=torch.bfloat16)
    assert gather(store, keys, SPEC, PROMPT, layers=(2, 4), out=out) is out
    assert same_bits(out, cache[2:4, :, :, :, :PROMPT])


@pytest.mark.parametrize(("keys", "problem"), [
    ([((0, 2), (0, 4))], "stop at position 4"),
    ([((0, 2), (0, 3)), ((0, 2), (4, 5))], "gap at position 3"),
    ([((0, 2), (0, 3)), ((0, 1), (2, 5)), ((1, 2), (3, 5))], "overlap at position 2"),
    ([((0, 3), (0, 5))], "outside"),
    ([((0, 1), (0, 5))], "layer 1 stop at position 0"),
])
def test_tiling_must_be_exact(keys, problem: str) -> None:
    blocks = [dv.BlockKey("s", layers=layers, tokens=tokens) for layers, tokens in keys]
    with pytest.raises(dv.ConfigError, match=problem):
        check_tiling(blocks, (0, 2), (0, 5))


def test_gather_reports_missing_and_misshapen_blocks() -> None:
    cache, store = _cache(), MemoryStore()
    keys = scatter(store, "s", _layer_kv(cache, range(SPEC.layers)), (0, SPEC.layers), (0, PROMPT))
    store.delete("s")
    with pytest.raises(dv.BlockNotFound):
        gather(store, keys, SPEC, PROMPT)
    with pytest.raises(dv.ConfigError, match="out is"):
        gather(store, keys, SPEC, PROMPT, out=torch.empty(3))


def test_staging_buffer_checks_what_it_is_given() -> None:
    staging = StagingBuffer(SPEC, (0, 2))
    cache = _cache()
    with pytest.raises(dv.ConfigError, match="1 positions, not 2"):
        staging.fill(_layer_kv(cache, range(2)), (0, 2))
    with pytest.raises(dv.ConfigError, match="2 layers"):
        staging.fill(_layer_kv(cache, range(3)), (0, 1))
    with pytest.raises(dv.ConfigError, match="need 2"):
        scatter(MemoryStore(), "s", _layer_kv(cache, range(3)), (0, 2), (0, 1))


def test_staging_copies_kv_that_requires_grad_off_the_graph() -> None:
    staging = StagingBuffer(SPEC, (0, 2))
    pairs = [(keys.clone().requires_grad_(), values.clone().requires_grad_())
             for keys, values in _layer_kv(_cache(), range(2))]
    filled = staging.fill(pairs, (3, 4))
    assert not filled.requires_grad
    assert filled.grad_fn is None
    expected = torch.stack([part[:, :, 3:4].detach() for pair in pairs for part in pair])
    assert same_bits(filled.reshape(expected.shape), expected)


def test_a_two_stage_cut_streams_into_a_three_stage_cut() -> None:
    """Prompt pipeline: 2 stages of 3 layers; token pipeline: 3 stages of 2 layers."""
    cache, store = _cache(), MemoryStore()
    source = LayerPartition.even(SPEC.layers, 2)
    for start, stop in source.stages:  # each source stage flushes its own block per position range
        scatter(store, "s", _layer_kv(cache, range(start, stop)), (start, stop), (0, PROMPT),
                StagingBuffer(SPEC, (start, stop), tokens=PROMPT))
        scatter(store, "s", _layer_kv(cache, range(start, stop)), (start, stop), (PROMPT, PROMPT + 1),
                StagingBuffer(SPEC, (start, stop)))
    destination = LayerPartition.even(SPEC.layers, 3)
    plan = plan_stream_out(store.keys("s"), destination)
    assert sorted({(p.layers, p.stage) for p in plan}) == [((0, 2), 0), ((2, 3), 1), ((3, 4), 1), ((4, 6), 2)]
    received: dict[int, list] = {stage: [] for stage in range(3)}
    for stage, key, piece in stream_out(store, store.keys("s"), destination):
        received[stage].append((key, piece))
    for stage, (start, stop) in enumerate(destination.stages):
        merged = stream_in(received[stage], (start, stop))
        assert [key.tokens for key, _ in merged] == [(0, PROMPT), (PROMPT, PROMPT + 1)]
        for key, block in merged:
            assert key.layers == (start, stop)
            assert same_bits(block, cache[start:stop, :, :, :, key.tokens[0]:key.tokens[1]])


def test_stream_in_refuses_an_incomplete_stage() -> None:
    piece = (dv.BlockKey("s", layers=(0, 1), tokens=(0, 1)), torch.zeros(1, 2, 1, 1, 1, 1))
    with pytest.raises(dv.ConfigError, match="layer 1"):
        stream_in([piece], (0, 2))


def test_a_run_survives_streaming_between_cuts() -> None:
    store = MemoryStore()
    blocks = {layer: torch.full((1, 2, 1, 1, 3, 2), float(layer)) for layer in range(4)}
    for layer, block in blocks.items():
        store.flush(dv.BlockKey("s", layers=(layer, layer + 1), tokens=(0, 3), run="ab12"), block)
    destination = LayerPartition.even(4, 2)
    received: dict[int, list] = {stage: [] for stage in range(2)}
    for stage, key, piece in stream_out(store, store.keys("s"), destination):
        assert key.run == "ab12"
        received[stage].append((key, piece))
    for stage, (start, stop) in enumerate(destination.stages):
        [(key, block)] = stream_in(received[stage], (start, stop))
        assert key == dv.BlockKey("s", layers=(start, stop), tokens=(0, 3), run="ab12")
        assert same_bits(block, torch.cat([blocks[layer] for layer in range(start, stop)]))
