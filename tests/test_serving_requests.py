"""The request is the unit: each row its own decoding, its own end, its own cancellation and its own failure."""

from __future__ import annotations

import os
import signal
import threading
import time

import expectations
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.serving import Pipeline
from dejavu_sdk.serving.head.ledger_state import POISON

pytestmark = [pytest.mark.usefixtures("workers_import_tiny_models"), pytest.mark.slow]

#: Rows of one microbatch, each decoded its own way (explicit settings: the reference applies exactly these).
GREEDY = {"do_sample": False}
ROWS = [{"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.0, "seed": 11},
        GREEDY,
        {"do_sample": True, "temperature": 1.3, "top_k": 0, "top_p": 1.0, "min_p": 0.05, "seed": -3}]


def _prompts(count: int, seed: int) -> list[torch.Tensor]:
    """Prompts of ids below the patched models' special ids."""
    return [prompt.clamp(max=90) for prompt in expectations.prompts(count, seed=seed)]


def _options(decoding: dict) -> dict:
    return {} if not decoding.get("do_sample") else decoding


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.005)


def _stage_pid(pipe: Pipeline, name: str) -> int:
    return next(stage["pid"] for stage in pipe.status()["stages"] if stage["name"] == name)


def _block(pipe: Pipeline, prompts, count: int) -> list:
    """Fill `count` microbatch slots with a request each that runs until cancelled (no end at eos, far from its
    limit), one at a time (two sent together could share a microbatch); their futures."""
    blockers = []
    for index in range(count):
        blockers.append(pipe.submit(prompts[-1 - index], max_new_tokens=500, ignore_eos=True))
        _wait(lambda in_flight=index + 1: len(pipe.status()["microbatches"]) == in_flight, 60, "the blockers in flight")
    return blockers


def _serve_rows_together(pipe: Pipeline, prompts, limits, blockers: int, streamed: dict | None = None) -> list:
    """Fill the pipeline's microbatch slots with `blockers` requests, submit one request per row of ROWS so that they
    wait, then cancel the blockers: the rows start as one microbatch; their futures."""
    running = _block(pipe, prompts, blockers)
    futures = []
    for row, (decoding, limit) in enumerate(zip(ROWS, limits, strict=True)):
        on_token = None if streamed is None else streamed.setdefault(row, []).append
        futures.append(pipe.submit(prompts[row], max_new_tokens=limit, on_token=on_token, **_options(decoding)))
    for blocker in running:
        blocker.cancel()
    return futures


def _check_rows(results, prompts, limits, pad, eos) -> None:
    assert len({result.microbatch for result in results}) == 1, "the rows did not share a microbatch"
    assert [result.row for result in results] == [0, 1, 2]
    expected = expectations.replayed(tiny_models.llama(), prompts, [0, 1, 2], ROWS, limits, pad, eos)
    for row, (result, want) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(result.tokens, want), f"row {row}: {result.tokens.tolist()} != {want.tolist()}"


def test_rows_of_different_settings_share_a_microbatch_each_exact_and_answered_at_its_own_end() -> None:
    """Greedy and sampled rows of different settings and seeds in one microbatch: each equals its replayed
    reference; the short row is answered while the long one still runs; a request alone in its microbatch
    equals `torch.manual_seed(seed)` + `model.generate(do_sample=True)`; temperature 1e-39 is greedy."""
    prompts = _prompts(6, seed=21)
    limits = [3, 40, 20]
    with Pipeline("tiny_models:llama", stages=2, microbatch=3, timeout=60, batching="static") as pipe:
        alone = pipe.submit(prompts[3], max_new_tokens=8, do_sample=True, temperature=0.8, top_k=10, seed=5)
        alone.result(timeout=60)
        futures = _serve_rows_together(pipe, prompts, limits, blockers=2)
        short = futures[0].result(timeout=60)
        long_running = not futures[1].done()
        results = [future.result(timeout=60) for future in futures]
        tiny = pipe.submit(prompts[4], max_new_tokens=6, do_sample=True, temperature=1e-39, seed=1).result(timeout=60)
        pad, eos = pipe.pad, pipe.eos
    assert long_running, "the short row waited for its microbatch's end"
    assert short.finished < results[1].finished
    _check_rows(results, prompts, limits, pad, eos)
    model = tiny_models.llama()
    (want,) = expectations.sampled(model, prompts, [3], 8, pad, eos, 5, temperature=0.8, top_k=10)
    assert torch.equal(alone.result().tokens, want)
    greedy = expectations.expected(model, [[4]], prompts, [0, 0, 0, 0, 6], pad, eos)[4]
    assert tiny.seed is None
    assert torch.equal(tiny.tokens, greedy)


def test_mixed_rows_resume_exactly_after_a_token_stage_is_killed() -> None:
    """Disaggregated, with recovery from replicas: the token stage killed mid-generation, each row of the mixed
    microbatch (its generator state travels with it) still equals its reference, and streams no token twice."""
    prompts = _prompts(6, seed=22)
    limits = [30, 24, 36]
    streamed: dict[int, list[int]] = {}
    with Pipeline("tiny_models:llama", prompt_stages=1, token_stages=2, token_slots=2, microbatch=3, timeout=60,
                  heartbeat=0.5, recovery="replicas", batching="static") as pipe:
        futures = _serve_rows_together(pipe, prompts, limits, blockers=2, streamed=streamed)
        _wait(lambda: len(streamed[2]) >= 8, 60, "8 tokens of the microbatch")
        os.kill(_stage_pid(pipe, "token stage 0"), signal.SIGKILL)
        results = [future.result(timeout=120) for future in futures]
        pad, eos = pipe.pad, pipe.eos
        reports = list(pipe.recoveries)
    assert reports
    assert any(results[0].microbatch in report.resumed for report in reports)
    _check_rows(results, prompts, limits, pad, eos)
    assert [streamed[row] for row in range(3)] == [result.tokens.tolist() for result in results]


def test_non_finite_logits_fail_their_request_alone_and_the_rows_beside_it_go_on() -> None:
    prompts = _prompts(5, seed=23)
    prompts[1][2] = tiny_models.POISON
    limits = [12, 12, 12]
    with Pipeline("tiny_models:llama_poisoned", stages=2, microbatch=3, timeout=60, recovery="replicas",
                  batching="static") as pipe:
        blockers = _block(pipe, prompts, 2)
        futures = [pipe.submit(prompts[row], max_new_tokens=12) for row in range(3)]
        for blocker in blockers:
            blocker.cancel()
        with pytest.raises(dv.RequestFailed, match="not finite") as failure:
            futures[1].result(timeout=60)
        assert not failure.value.input_error
        assert not futures[0].done() or not futures[2].done()  # answered at its own step, not its microbatch's end
        results = [futures[row].result(timeout=60) for row in (0, 2)]
        after = pipe.submit(prompts[3], max_new_tokens=5).result(timeout=60)
        pad, eos = pipe.pad, pipe.eos
        assert pipe.recoveries == []  # a request's failure is no stage's
    expected = expectations.expected(tiny_models.llama_poisoned(), [[0, 1, 2], [3]], prompts, [*limits, 5], pad, eos)
    assert torch.equal(results[0].tokens, expected[0])
    assert torch.equal(results[1].tokens, expected[2])
    assert torch.equal(after.tokens, expected[3])


@pytest.mark.parametrize("layout", [
    {"stages": 2, "recovery": "recompute", "batching": "static"},
    {"stages": 2, "recovery": "recompute", "batching": "continuous"},
    {"prompt_stages": 1, "token_stages": 2, "recovery": "replicas", "batching": "continuous"},
], ids=["mixed static", "mixed continuous recompute", "disaggregated continuous"])
def test_a_request_in_two_recoveries_in_a_row_without_progress_fails_and_the_next_is_served(layout) -> None:
    prompts = _prompts(3, seed=24)
    prompts[0][1] = tiny_models.FATAL
    with Pipeline("tiny_models:llama_fatal", microbatch=1, timeout=60, heartbeat=0.5, standby=1,
                  **layout) as pipe:
        with pytest.raises(dv.RequestFailed, match="two recoveries in a row"):
            pipe.submit(prompts[0], max_new_tokens=6).result(timeout=120)
        after = pipe.submit(prompts[1], max_new_tokens=6).result(timeout=120)
        pad, eos = pipe.pad, pipe.eos
        reports = list(pipe.recoveries)
    assert len(reports) == 2
    if layout["recovery"] == "recompute":  # each recovery lost its slot: lost again without a token, it fails
        assert all(report.recomputed for report in reports)
    else:  # the slot its group opened never reached the token stages: it is lost with the poison bound's reason
        assert list(reports[-1].recomputed.values()) == [POISON]
    (want,) = expectations.expected(tiny_models.llama(), [[1]], prompts, [0, 6, 0], pad, eos)[1:2]
    assert torch.equal(after.tokens, want)


def test_cancelled_requests_are_never_computed_or_stop_being_stepped_and_give_their_room_back() -> None:
    prompts = _prompts(6, seed=25)
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    with Pipeline("tiny_models:llama", stages=1, microbatch=2, timeout=60, ignore_eos=True, batching="static") as pipe:
        first = pipe.submit_all(prompts[:3], 60, on_token=lambda index, token: streamed[index].append(token))
        waiting = first[2]  # one stage, a microbatch of two: it waits for room
        assert pipe.cancel(waiting)
        assert waiting.cancelled()
        later = pipe.submit(prompts[3], max_new_tokens=4)  # held back by the first submission: a microbatch beside
        _wait(lambda: len(streamed[1]) >= 5, 60, "5 tokens of the second row")
        assert pipe.cancel(first[1])
        cancelled_at = len(streamed[1])
        kept = first[0].result(timeout=60)
        assert later.result(timeout=60).microbatch == kept.microbatch + 1  # the cancelled request never ran
        stepped = pipe.stage_stats()["stage 0"]["row_steps"]
        # a microbatch whose rows are all cancelled ends at once, and the next one is admitted in its room
        lone_tokens: list[int] = []
        lone = pipe.submit(prompts[4], max_new_tokens=200, on_token=lone_tokens.append)
        _wait(lambda: len(lone_tokens) >= 3, 60, "3 tokens of the lone request")
        lone.cancel()
        started = time.monotonic()
        last = pipe.submit(prompts[5], max_new_tokens=3).result(timeout=60)
        assert time.monotonic() - started < 10
        assert last.microbatch == kept.microbatch + 3
        _wait(lambda: pipe.status()["microbatches"] == [], 10, "every microbatch to end")  # ends after its answer
    assert first[1].cancelled()
    assert streamed[2] == []
    assert len(streamed[1]) <= cancelled_at + 2
    assert 60 + 4 + cancelled_at <= stepped <= 60 + 4 + cancelled_at + 3  # the cancelled row: a step or two more


def test_a_submission_during_start_up_waits_for_the_pipeline_and_is_served() -> None:
    prompts = _prompts(1, seed=26)
    pipe = Pipeline("tiny_models:llama", stages=2, microbatch=2, timeout=60)
    starter = threading.Thread(target=pipe.start)
    try:
        starter.start()
        _wait(lambda: _listening(pipe), 60, "the head to listen")
        result = pipe.submit(prompts[0], max_new_tokens=5).result(timeout=60)
        pad, eos = pipe.pad, pipe.eos
    finally:
        starter.join(timeout=120)
        pipe.close()
    (want,) = expectations.expected(tiny_models.llama(), [[0]], prompts, [5], pad, eos)
    assert torch.equal(result.tokens, want)


def _listening(pipe: Pipeline) -> bool:
    try:
        return bool(pipe.url)
    except dv.ConfigError:
        return False


def test_a_large_submission_does_not_hold_back_a_later_one() -> None:
    prompts = _prompts(21, seed=27)
    with Pipeline("tiny_models:llama", stages=1, microbatch=2, timeout=60) as pipe:
        many = pipe.submit_all(prompts[:20], 4)
        late = pipe.submit(prompts[20], max_new_tokens=4).result(timeout=60)
        numbers = sorted({future.result(timeout=120).microbatch for future in many})
    assert late.microbatch <= numbers[0] + 1  # the next microbatch after the one running when it came
