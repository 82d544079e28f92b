"""Microbatch swapping in one process: swapped caches decode exactly as unswapped ones (and as `model.generate`),
admission keeps the caches within the device budget, and "auto" swaps only where the planner says it pays."""

from __future__ import annotations

import logging

import expectations
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.roundrobin import RoundRobin
from dejavu_sdk.swapping import choose_swapping, kv_bytes_per_token, measure_host_bandwidth, positions_needed

FAMILIES = ["llama", "mistral", "gpt2", "opt", "qwen2", "llama_two_ends"]


def _limits(count: int) -> list[int]:
    """Rows of one microbatch end at different steps; the first request ends with its first token."""
    return [1] + [3 + 4 * (index % 3) for index in range(1, count)]


@pytest.mark.parametrize("swapping", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_robin_serves_every_request_as_generate_serves_its_microbatch(family, swapping) -> None:
    model = getattr(tiny_models, family)()
    prompts = expectations.prompts(8, seed=21)
    limits = _limits(len(prompts))
    results = dv.DejaVuEngine(model).generate_many(prompts, limits, microbatch=3, swapping=swapping)
    batches = expectations.microbatches(results)
    assert batches == [[0, 1, 2], [3, 4, 5], [6, 7]]  # in order, up to 3 rows each
    rules = RoundRobin(model).rules
    want = expectations.expected(model, batches, prompts, limits, rules.pad, rules.eos)
    for result, tokens in zip(results, want, strict=True):
        assert torch.equal(result.tokens, tokens)
    if family == "llama_two_ends":  # some rows end early, at the second end-of-sequence token
        assert any(result.tokens[-1] == 49 and result.tokens.numel() < limit
                   for result, limit in zip(results, limits, strict=True))


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_swapped_sampling_equals_unswapped_sampling(family) -> None:
    model = getattr(tiny_models, family)()
    engine = dv.DejaVuEngine(model)
    prompts = expectations.prompts(6, seed=22)
    runs = [engine.generate_many(prompts, 10, microbatch=2, swapping=swapping, do_sample=True, seed=7, top_k=20)
            for swapping in (True, False)]
    assert [result.tokens.tolist() for result in runs[0]] == [result.tokens.tolist() for result in runs[1]]
    assert {result.seed for result in runs[0]} == {7}
    rules = RoundRobin(model).rules  # the first microbatch, each row from its own generator seeded with 7
    row = {"do_sample": True, "seed": 7, "top_k": 20, "temperature": 1.0, "top_p": 1.0}
    expected = expectations.replayed(model, prompts, [0, 1], [row, row], [10, 10], rules.pad, rules.eos)
    assert [result.tokens.tolist() for result in runs[0][:2]] == [tokens.tolist() for tokens in expected]


def _runner(budget_microbatches: float, swapping: bool, model=None) -> tuple[RoundRobin, list]:
    """A round robin over 8 requests of 6 new tokens in microbatches of 2, with a budget of that many
    microbatches' caches (their longest prompts padded to 11 tokens)."""
    model = model or tiny_models.llama()
    prompts = [torch.randint(1, tiny_models.VOCAB, (11,), generator=torch.Generator().manual_seed(index))
               for index in range(8)]
    per_microbatch = 2 * positions_needed(11, 6) * kv_bytes_per_token(model.config, torch.float32)
    runner = RoundRobin(model, microbatch=2, kv_budget_bytes=int(budget_microbatches * per_microbatch),
                        swapping=swapping)
    return runner, runner.run(runner.requests(prompts, 6, Decoding()))


def test_admission_keeps_the_caches_within_the_budget_and_swapping_doubles_what_is_in_flight() -> None:
    unswapped, plain = _runner(2, swapping=False)
    swapped, results = _runner(2, swapping=True)
    budget = unswapped.budget
    assert unswapped.caches is not None
    assert swapped.caches is not None
    # device bytes held, counted from the caches' tensors after every step: never over the budget
    assert 0 < unswapped.caches.peak_bytes <= budget
    assert 0 < swapped.caches.peak_bytes <= budget
    assert unswapped.most_in_flight == 2  # two microbatches' caches fill the budget
    assert swapped.most_in_flight == 4  # every microbatch, two at a time on the device
    assert swapped.caches.swap_ins > 0
    assert [r.tokens.tolist() for r in results] == [r.tokens.tolist() for r in plain]
    half, served = _runner(1.5, swapping=False)  # room for one and a half: the second shrinks to one row
    assert half.most_in_flight == 2
    assert {result.rows for result in served} == {1, 2}
    assert half.caches is not None
    assert half.caches.peak_bytes <= half.budget


def test_a_budget_too_small_for_one_request_or_two_slots_is_refused_before_anything_runs() -> None:
    with pytest.raises(dv.ConfigError, match="cannot hold two device slots"):
        _runner(1.9 / 2, swapping=True)  # one request fits, two slots of one do not
    with pytest.raises(dv.ConfigError, match="cannot hold the KV cache of one request"):
        _runner(0.4, swapping=False)
    _runner(1.0 / 2, swapping=False)  # exactly one request's cache: served one row at a time
    engine = dv.DejaVuEngine(tiny_models.llama())
    for bad in ({"kv_budget_bytes": 0}, {"kv_budget_bytes": 1.5}, {"swapping": "sometimes"}, {"microbatch": 0}):
        with pytest.raises(dv.ConfigError):
            engine.generate_many(expectations.prompts(2), 3, **bad)
    with pytest.raises(dv.ConfigError, match="2 max_new_tokens for 3 prompts"):
        engine.generate_many(expectations.prompts(3), [3, 4])
    with pytest.raises(dv.ConfigError, match="no prompts"):
        engine.generate_many([], 3)


def test_a_budget_holding_one_microbatch_serves_the_others_one_row_at_a_time_when_needed() -> None:
    """Rows that do not fit beside the microbatches in flight wait; a microbatch shrinks to the rows that fit."""
    runner, results = _runner(1.0 / 2 + 0.01, swapping=False)  # one row's cache: microbatches of one row
    assert {result.rows for result in results} == {1}
    assert runner.caches is not None
    assert runner.caches.peak_bytes <= runner.budget


def test_swapping_pays_off_only_while_copies_keep_up_with_steps() -> None:
    common = {"batch": 4, "new_tokens": 64, "cache_bytes_per_token": 100_000, "fits_without": False}
    fast = choose_swapping(prompt_tokens=128, token_time=0.02, host_bandwidth=20e9, **common)
    assert fast.swapping
    assert "pays off" in fast.reason
    slow = choose_swapping(prompt_tokens=128, token_time=0.02, host_bandwidth=0.5e9, **common)
    assert not slow.swapping  # slow copies
    assert "stall" in slow.reason
    long = choose_swapping(prompt_tokens=8192, token_time=0.02, host_bandwidth=20e9, **common)
    assert not long.swapping  # long sequences: bringing a cache back outlasts a step


def test_swapping_is_off_where_it_is_not_needed_pointless_or_impossible_and_measures_only_when_it_must() -> None:
    measured = []

    def measure() -> tuple[float, float]:
        measured.append(True)
        return 0.02, 20e9

    common = {"batch": 4, "prompt_tokens": 128, "new_tokens": 64, "cache_bytes_per_token": 100_000,
              "measure": measure}
    for options, reason in (({"fits_without": True}, "nothing to swap"),
                            ({"fits_without": False, "device_is_host": True}, "the device is the CPU"),
                            ({"fits_without": False, "two_slots": False}, "two device slots")):
        choice = choose_swapping(**common, **options)
        assert not choice.swapping
        assert reason in choice.reason
    assert measured == []  # none of those needed a measurement
    choice = choose_swapping(fits_without=False, **common)
    assert choice.swapping
    assert measured == [True]
    assert (choice.token_time, choice.host_bandwidth) == (0.02, 20e9)
    assert measure_host_bandwidth(torch.device("cpu"), 1 << 20) > 0


def test_auto_says_why_it_does_not_swap_on_a_cpu(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="dejavu_sdk.generation.roundrobin"):
        roomy, _ = _runner(8, swapping="auto")  # type: ignore[arg-type]
        tight, results = _runner(2, swapping="auto")  # type: ignore[arg-type]
    assert roomy.choice is not None
    assert not roomy.choice.swapping
    assert tight.choice is not None
    assert not tight.choice.swapping  # the CPU is both host and device
    assert tight.most_in_flight == 2  # what the budget holds unswapped
    assert "swapping off: every microbatch's cache fits" in caplog.text
    assert "swapping off: the device is the CPU" in caplog.text
    _, plain = _runner(8, swapping=False)
    assert [r.tokens.tolist() for r in results] == [r.tokens.tolist() for r in plain]


def test_an_architecture_without_a_stage_adapter_is_refused_at_once() -> None:
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(dv.ConfigError, match="StageAdapter"):
        dv.DejaVuEngine(model).generate_many(expectations.prompts(2), 3)
