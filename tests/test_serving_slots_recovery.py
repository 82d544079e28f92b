"""Recovery under continuous batching: a stage SIGKILLed while rows join and leave slots is replaced, every slot
goes on from its replicas right after the last round the head heard of, and every row, greedy or sampled,
equals the replay of its slot's schedule; no token is lost or streamed twice."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import expectations
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.replay import replay
from dejavu_sdk.serving import Pipeline

pytestmark = pytest.mark.usefixtures("workers_import_tiny_models")

#: Twelve requests of different lengths and decodings, three rows a slot: rows keep joining and leaving.
LIMITS = [40, 9, 25, 4, 33, 12, 7, 28, 16, 3, 21, 11]
SAMPLED = {"do_sample": True, "top_k": 20}


def _settings(index: int) -> dict:
    return {**SAMPLED, "seed": 100 + index} if index % 3 == 1 else {}


def _stage_pid(pipe: Pipeline, name: str) -> int:
    return next(stage["pid"] for stage in pipe.status()["stages"] if stage["name"] == name)


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.005)


def _rounds(pipe: Pipeline) -> int:
    return sum(batch["steps"] for batch in pipe.status()["microbatches"])


def _serve_and_kill(victims: list[str], rounds: int = 30, **options) -> tuple[list, dict, list, list]:
    """The twelve requests through a continuous pipeline with recovery (from replicas unless `options` say), the
    `victims` SIGKILLed together once the slots ran `rounds` rounds while a sampled row decodes; each request's
    result (or error), the tokens each streamed, the recoveries and the prompts."""
    prompts = [prompt.clamp(max=90) for prompt in expectations.prompts(len(LIMITS), seed=21)]
    streamed: dict[int, list[int]] = defaultdict(list)
    options = {"recovery": "replicas", **options}
    with Pipeline("tiny_models:llama", microbatch=3, timeout=60, heartbeat=0.5, threads=1, max_prefill_tokens=4,
                  **options) as pipe:
        assert pipe.batching == "continuous"
        futures = [pipe.submit(prompt, max_new_tokens=limit,
                               on_token=lambda token, index=index: streamed[index].append(token), **_settings(index))
                   for index, (prompt, limit) in enumerate(zip(prompts, LIMITS, strict=True))]
        def sampled_row_going() -> bool:  # a sampled row (every third from the second) has tokens and decodes
            return any(index % 3 == 1 and streamed[index] and not future.done() for index, future in enumerate(futures))

        _wait(lambda: _rounds(pipe) >= rounds and sampled_row_going(), 60, f"{rounds} rounds, a sampled row decoding")
        for victim in victims:
            os.kill(_stage_pid(pipe, victim), signal.SIGKILL)
        outcomes = [_outcome(future) for future in futures]
        reports = list(pipe.recoveries)
    return outcomes, streamed, reports, prompts


def _outcome(future):
    try:
        return future.result(timeout=120)
    except dv.RequestFailed as error:
        return error


def _check_replayed(outcomes: list, streamed: dict, prompts: list) -> None:
    """Every answered request equals the replay of its slot's schedule, and streamed exactly its tokens."""
    results = {index: outcome for index, outcome in enumerate(outcomes) if not isinstance(outcome, Exception)}
    requests = {outcome.request: Request(prompts[index], LIMITS[index], Decoding.of(**_settings(index)))
                for index, outcome in enumerate(outcomes)}  # a failed request's rows ran beside the others too
    model = tiny_models.llama()
    for index, result in results.items():
        want = replay(model, result.schedule, requests)[result.request]
        assert torch.equal(result.tokens, want), f"request {index}: {result.tokens.tolist()} != {want.tolist()}"
        assert streamed[index] == want.tolist(), f"request {index} streamed tokens lost or twice"


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "victim"), [({"stages": 2}, "stage 1"), ({"stages": 2}, "stage 0"),
                                                ({"prompt_stages": 1, "token_stages": 2}, "token stage 0")],
                         ids=["mixed-last", "mixed-first", "disaggregated-token-0"])
def test_a_stage_killed_while_rows_join_and_leave_resumes_every_slot_exactly(layout, victim) -> None:
    outcomes, streamed, reports, prompts = _serve_and_kill([victim], **layout)
    assert [report.replaced for report in reports] == [[victim]]
    report = reports[0]
    assert report.resumed, report.describe()  # slots went on from their replicas...
    assert not report.recomputed, report.describe()  # ...every one of them
    assert not [outcome for outcome in outcomes if isinstance(outcome, Exception)]
    _check_replayed(outcomes, streamed, prompts)
    # the slots that went on were changing rows around the recovery: rows joined and left before and after it
    longest = max((result.schedule for result in outcomes if result.microbatch in report.resumed), key=len)
    at = report.resumed[next(result.microbatch for result in outcomes if result.schedule is longest)]
    assert any(step.joined or step.left for step in longest[:at])
    assert any(step.joined or step.left for step in longest[at:]), "no row joined or left after the recovery"


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "victims"), [
    ({"prompt_stages": 1, "token_stages": 2}, ["token stage 0", "token stage 1"]),  # neighbours, lost together
    ({"prompt_stages": 1, "token_stages": 1}, ["token stage 0"]),  # a ring of one cannot hold its own replica
], ids=["neighbours", "one-token-stage"])
def test_a_replica_store_lets_every_slot_go_on_even_when_neighbours_die_together(tmp_path, layout, victims) -> None:
    outcomes, streamed, reports, prompts = _serve_and_kill(victims, replica_store=f"file://{tmp_path}/replicas",
                                                           **layout)
    assert sorted(name for report in reports for name in report.replaced) == victims
    assert all(report.resumed and not report.recomputed for report in reports), [r.describe() for r in reports]
    assert not [outcome for outcome in outcomes if isinstance(outcome, Exception)]
    _check_replayed(outcomes, streamed, prompts)
    assert dv.open_store(f"file://{tmp_path}/replicas").keys() == []  # each slot's replica went with it


def _went_on(outcomes: list) -> list[int]:
    """The requests whose rows went on in another slot from the tokens they had (a slot lost before their end)."""
    return [index for index, outcome in enumerate(outcomes)
            if not isinstance(outcome, Exception) and any(step.lost for step in outcome.schedule)]


@pytest.mark.slow
def test_slots_whose_replicas_died_with_them_go_on_from_the_tokens_their_rows_had() -> None:
    """Both token stages of a ring die at once: each held the other's replicas, so no slot can go on from its
    round. Every request still completes: a row with tokens goes on in a new slot from its prompt followed by
    them (sampled rows from their generators as they stood), one without waits again; each equals the replay
    of its schedule, which runs through the lost slot, and streamed each token once."""
    outcomes, streamed, reports, prompts = _serve_and_kill(["token stage 0", "token stage 1"], rounds=10,
                                                           prompt_stages=1, token_stages=2)
    assert any(report.recomputed for report in reports)
    assert not [outcome for outcome in outcomes if isinstance(outcome, Exception)]
    assert _went_on(outcomes), "no row went on from its tokens"
    assert any(index % 3 == 1 for index in _went_on(outcomes)), "no sampled row went on from its tokens"
    _check_replayed(outcomes, streamed, prompts)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "victim"), [({"stages": 1}, "stage 0"), ({"stages": 2}, "stage 1"),
                                                ({"prompt_stages": 1, "token_stages": 1}, "token stage 0")],
                         ids=["one-stage", "mixed-last", "disaggregated-token"])
def test_continuous_recompute_goes_on_with_every_row_of_a_lost_slot_exactly(layout, victim) -> None:
    """recovery="recompute" keeps no replica: a stage killed while rows join and leave loses its slots, and each
    of their rows goes on from its prompt and the tokens it has; every request equals the replay of its schedule
    and streamed each token once."""
    outcomes, streamed, reports, prompts = _serve_and_kill([victim], recovery="recompute", **layout)
    assert [report.replaced for report in reports] == [[victim]]
    assert reports[0].recomputed, reports[0].describe()
    assert not reports[0].resumed, reports[0].describe()
    assert not [outcome for outcome in outcomes if isinstance(outcome, Exception)]
    assert any(index % 3 == 1 for index in _went_on(outcomes)), "no sampled row went on from its tokens"
    _check_replayed(outcomes, streamed, prompts)


@pytest.mark.slow
def test_continuous_recompute_keeps_the_slots_of_living_token_stages_when_a_prompt_stage_dies() -> None:
    """Disaggregated with recovery="recompute": the token stages hold every slot whole, so a dead prompt stage
    loses none of them; they go on from their round (its groups are prefilled again)."""
    outcomes, streamed, reports, prompts = _serve_and_kill(["prompt stage 0"], recovery="recompute", prompt_stages=1,
                                                           token_stages=1)
    assert [report.replaced for report in reports] == [["prompt stage 0"]]
    assert reports[0].resumed, reports[0].describe()
    assert not reports[0].recomputed, reports[0].describe()
    assert not [outcome for outcome in outcomes if isinstance(outcome, Exception)]
    assert not _went_on(outcomes)
    _check_replayed(outcomes, streamed, prompts)
