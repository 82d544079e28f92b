"""Microbatch swapping in pipelines: decoding stages keep their microbatches' KV in host memory with two on the
device; tokens stay those of `model.generate`, and the head's admission keeps every stage within its budget."""

from __future__ import annotations

import logging

import expectations
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.serving import Pipeline
from dejavu_sdk.swapping import kv_bytes_per_token, positions_needed

pytestmark = pytest.mark.usefixtures("workers_import_tiny_models")


def _check_against_generate(family: str, prompts, limits, results, pipe, max_prefill_tokens: int) -> None:
    batches = expectations.microbatches(results)
    want = expectations.expected(getattr(tiny_models, family)(), batches, prompts, limits, pipe.pad, pipe.eos,
                                 max_prefill_tokens)
    for result, tokens in zip(results, want, strict=True):
        assert torch.equal(result.tokens, tokens)


#: Positions a static slot's prompts run per round.
CHUNK = 4


@pytest.mark.slow
def test_admission_keeps_every_stage_within_its_budget_and_swapping_lets_more_microbatches_in() -> None:
    """Three one-layer stages, one-row microbatches, a budget of two microbatches' caches per stage: unswapped,
    two microbatches are in flight; swapped, three (one per stage), two at a time on each stage's device. Same
    tokens. A request whose cache alone fills the budget is served; one position more, and it is refused as it is
    submitted (it could never start). Each prompt is prefilled 4 positions a round: a microbatch's cache is held
    (and swapped) as its slot's from its first chunk, so it never waits on the device beside the two swapped in."""
    prompts = [torch.randint(1, tiny_models.VOCAB, (11,), generator=torch.Generator().manual_seed(index))
               for index in range(8)]
    limits = [6] * len(prompts)
    each = positions_needed(11, 6) * kv_bytes_per_token(tiny_models.llama().config, torch.float32, layers=1)
    served = {}
    for swapping in (False, True):
        with Pipeline("tiny_models:llama", stages=3, microbatch=1, kv_budget_bytes=2 * each, swapping=swapping,
                      timeout=60, batching="static", max_prefill_tokens=CHUNK) as pipe:
            futures = [pipe.submit(ids, max_new_tokens=limit) for ids, limit in zip(prompts, limits, strict=True)]
            results = [future.result(timeout=120) for future in futures]
            stats = pipe.stage_stats()
            assert pipe.most_in_flight == (3 if swapping else 2)
            full = torch.randint(1, tiny_models.VOCAB, (20,), generator=torch.Generator().manual_seed(99))
            with pytest.raises(dv.RequestTooLarge) as refused:  # 20 + 14 - 1 positions: one more than 2 x 16
                pipe.submit(full, max_new_tokens=14)
            assert (refused.value.needed, refused.value.budget, refused.value.most_new_tokens) == (33 * each // 16,
                                                                                                   2 * each, 13)
            assert pipe.waiting() == 0
            alone = pipe.submit(full, max_new_tokens=13).result(timeout=120)  # the whole budget
            _check_against_generate("llama", prompts, limits, results, pipe, CHUNK)
            _check_against_generate("llama", [full], [13], [alone], pipe, CHUNK)
        assert sorted(stats) == ["stage 0", "stage 1", "stage 2"]
        for stage in stats.values():  # device bytes held, counted by each stage from its caches' tensors
            assert 0 < stage["peak_kv_bytes"] <= 2 * each
            assert stage["swapping"] is swapping
            assert (stage["swap_ins"] > 0) is swapping
        served[swapping] = [result.tokens.tolist() for result in results]
    assert served[True] == served[False]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"prompt_stages": 1, "token_stages": 2}, {"layers": [(0, 2), (2, 3)]}])
def test_swapped_stages_serve_every_request_as_generate_serves_its_microbatch(layout) -> None:
    """Sliding-window layers (Mistral), rows ending at different steps, KV arriving from a prompt stage; static
    microbatches whose prompts run in chunks longer than the window (15 positions: 5 columns of three rows; a
    window of 5 keeps 4), each equal to `model.generate` with those chunks. (Continuous slots of sliding-window
    layers, swapped: tests/test_continuous.py and the matrix.)"""
    prompts = expectations.prompts(7, seed=31)
    limits = [1] + [4 + 3 * (index % 4) for index in range(1, len(prompts))]
    chunks = 15
    with Pipeline("tiny_models:mistral", microbatch=3, swapping=True, timeout=60, batching="static",
                  max_prefill_tokens=chunks, **layout) as pipe:
        futures = [pipe.submit(ids, max_new_tokens=limit) for ids, limit in zip(prompts, limits, strict=True)]
        results = [future.result(timeout=120) for future in futures]
        stats = pipe.stage_stats()
        _check_against_generate("mistral", prompts, limits, results, pipe, chunks)
    decoding = [stage for name, stage in stats.items() if not name.startswith("prompt")]
    assert decoding
    assert all(stage["swapping"] and stage["swap_ins"] > 0 for stage in decoding)


def test_auto_says_whether_it_swaps_and_why_before_any_process_starts(caplog) -> None:
    model = tiny_models.llama()
    each = 4 * positions_needed(32, 16) * kv_bytes_per_token(model.config, torch.float32, layers=2)
    with caplog.at_level(logging.INFO, logger="dejavu_sdk.serving.options"):
        roomy = Pipeline("tiny_models:llama", stages=2, microbatch=4, workload=(32, 16))
        tight = Pipeline("tiny_models:llama", stages=2, microbatch=4, workload=(32, 16), kv_budget_bytes=each)
    assert roomy.swap_choice is not None
    assert not roomy.swapping
    assert "fits" in roomy.swap_choice.reason
    assert tight.swap_choice is not None
    assert not tight.swapping  # stage processes run on the CPU: swapping would save no memory
    assert "swapping off: the device is the CPU" in caplog.text
    assert Pipeline("tiny_models:llama", stages=2, swapping=True, kv_budget_bytes=each).swapping


@pytest.mark.parametrize(("options", "message"), [
    ({"kv_budget_bytes": 0}, "kv_budget_bytes must be a positive integer"),
    ({"kv_budget_bytes": "1GB"}, "kv_budget_bytes must be a positive integer"),
    ({"swapping": "always"}, "swapping must be True, False or 'auto'"),
])
def test_bad_budgets_and_swapping_settings_are_refused_before_any_process_starts(options, message) -> None:
    with pytest.raises(dv.ConfigError, match=message):
        Pipeline("tiny_models:llama", stages=2, **options)
