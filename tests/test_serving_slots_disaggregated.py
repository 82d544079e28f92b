"""Continuous batching in disaggregated pipelines: groups prefilled by the prompt pipeline join the token
pipeline's slots, and every row equals a replay of its slot's recorded rounds."""

from __future__ import annotations

import time

import expectations
import pytest
import tiny_models
import torch

from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.replay import replay
from dejavu_sdk.serving import Pipeline

pytestmark = pytest.mark.usefixtures("workers_import_tiny_models")

#: The first request runs long, so that its slot is still decoding when the later groups come to it; one ends
#: with its first token (from the prompt pipeline).
LIMITS = [30, 3, 9, 5, 12, 4, 7, 6, 2, 1]
SETTINGS = [None, {"do_sample": True, "seed": 11, "top_k": 20}, None,
            {"do_sample": True, "seed": 5, "temperature": 0.7}, None, None, {"do_sample": True, "seed": 3}, None,
            {"do_sample": True, "seed": 8, "top_p": 0.9}, None]


def _replayed_exactly(family: str, prompts, results) -> None:
    model = getattr(tiny_models, family)()
    requests = {result.request: Request(torch.as_tensor(ids), limit, Decoding.of(**(settings or {})))
                for result, ids, limit, settings in zip(results, prompts, LIMITS, SETTINGS, strict=True)}
    for result in results:
        assert result.schedule, "a continuous result carries its slot's rounds"
        want = replay(model, result.schedule, requests)[result.request]
        assert result.tokens.tolist() == want.tolist(), f"request {result.request}"


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout", "transport"), [
    ("llama", {"prompt_stages": 1, "token_stages": 1}, "tcp"),
    ("gpt2", {"prompt_stages": 1, "token_stages": 2}, "gloo"),
    ("llama", {"prompt_stages": 2, "token_stages": 2, "max_prefill_tokens": 6}, "tcp"),
    ("mistral", {"prompt_stages": 1, "token_stages": 2, "max_prefill_tokens": 6}, "tcp"),
], ids=["llama-1P+1T-tcp", "gpt2-1P+2T-gloo", "llama-2P+2T-chunked-tcp", "mistral-sliding-1P+2T-chunked-tcp"])
def test_groups_prefilled_by_the_prompt_pipeline_join_slots_and_every_row_equals_its_replay(family, layout,
                                                                                            transport) -> None:
    prompts = expectations.prompts(len(LIMITS), seed=31)
    with Pipeline(f"tiny_models:{family}", microbatch=3, timeout=60, transport=transport, **layout) as pipe:
        assert pipe.batching == "continuous"
        futures = [pipe.submit(ids, limit, **(settings or {}))
                   for ids, limit, settings in zip(prompts, LIMITS, SETTINGS, strict=True)]
        results = [future.result(timeout=120) for future in futures]
    rounds = [step for result in results for step in result.schedule]
    assert any(step.joined and len(step.decoded) > len(step.joined) for step in rounds), "no row joined a slot"
    assert any(step.left for step in rounds), "no row left a slot"
    assert len(results[-1].tokens) == 1
    if "max_prefill_tokens" in layout:  # the prompt stages ran groups' prompts a chunk a step, in turns
        assert any(step.chunk for step in rounds), "the prompt stages ran no chunks"
    _replayed_exactly(family, prompts, results)


@pytest.mark.slow
def test_a_request_cancelled_in_the_prompt_pipeline_or_its_slot_leaves_the_others_exact() -> None:
    prompts = expectations.prompts(len(LIMITS), seed=32)
    with Pipeline("tiny_models:llama", prompt_stages=1, token_stages=1, microbatch=3, timeout=60) as pipe:
        futures = [pipe.submit(ids, limit, **(settings or {}))
                   for ids, limit, settings in zip(prompts, LIMITS, SETTINGS, strict=True)]
        assert pipe.cancel(futures[4])  # waiting, or in the prompt pipeline, or in its slot
        results = {index: future.result(timeout=120) for index, future in enumerate(futures) if index != 4}
    assert futures[4].cancelled()
    model = tiny_models.llama()
    requests = {result.request: Request(torch.as_tensor(prompts[index]), LIMITS[index],
                                        Decoding.of(**(SETTINGS[index] or {})))
                for index, result in results.items()}
    cancelled = Request(torch.as_tensor(prompts[4]), LIMITS[4])
    for result in results.values():
        members = {member for step in result.schedule for member in step.decoded}
        extra = {number: cancelled for number in members - set(requests)}  # the cancelled row, while it ran
        assert result.tokens.tolist() == replay(model, result.schedule, {**requests, **extra})[result.request].tolist()


def test_continuous_batching_takes_either_recovery() -> None:
    for recovery in ("replicas", "recompute"):
        pipe = Pipeline("tiny_models:llama", prompt_stages=1, token_stages=2, recovery=recovery)
        assert (pipe.batching, pipe.recovery) == ("continuous", recovery)


@pytest.mark.slow
def test_a_decoding_row_cancelled_leaves_its_slot_and_no_stage_keeps_kv_once_idle() -> None:
    """The cancel reaches the token stage that holds the slot (not the prompt stage), the row leaves within a
    few rounds, and once every slot ended no token stage holds a cache or staged prompt KV."""
    prompts = expectations.prompts(6, seed=33)
    with Pipeline("tiny_models:llama", prompt_stages=1, token_stages=2, microbatch=2, timeout=60) as pipe:
        seen: list[int] = []

        def cancel_at_the_third(token: int) -> None:
            seen.append(token)
            if len(seen) == 3:
                long_request.cancel()

        long_request = pipe.submit(prompts[1], 60, on_token=cancel_at_the_third)  # 60 tokens, no end before
        others = [pipe.submit(ids, limit) for ids, limit in zip([prompts[0], *prompts[2:]], [6, 3, 9, 1, 4],
                                                                strict=True)]
        results = [future.result(timeout=120) for future in others]
        deadline = time.monotonic() + 60
        while pipe.status()["microbatches"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pipe.status()["microbatches"] == [], "every slot ends once idle"
        stats = pipe.stage_stats()
    assert long_request.cancelled()
    cancelled = {member for result in results for step in result.schedule for member in step.decoded} - {
        result.request for result in results}
    assert len(cancelled) == 1, "the cancelled row shared a slot with others"
    for result in results:
        rounds = [step for step in result.schedule if cancelled & set(step.decoded)]
        # a cancel that never reached the slot would decode its 57 other rounds; a round of this model takes a
        # millisecond or two, so on a busy machine the cancel may land some rounds after it was asked for
        assert len(rounds) < 20, f"the cancelled row decoded {len(rounds)} rounds beside request {result.request}"
    tokens = [stage for name, stage in stats.items() if name.startswith("token")]
    assert len(tokens) == 2
    assert all(stage["held_kv_bytes"] == 0 and stage["staged_kv"] == 0 for stage in tokens), stats
