"""Slow is not dead: a prompt whose prefill takes longer than `progress_timeout` is served without a recovery in
every layout (its stage's heartbeats say it is computing), a request sent after it is served too, and a stage
killed during such a prefill is still recovered."""

from __future__ import annotations

import os
import signal
import time

import expectations
import pytest
import tiny_models
import torch

from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.replay import replay
from dejavu_sdk.serving import Pipeline
from dejavu_sdk.serving.options import DEFAULT_PREFILL_TOKENS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("module_workers_import_tiny_models")]

#: The long prompt's length: its prefill takes seconds on this model, several times `PROGRESS`.
LONG = 8000
#: The progress threshold of these pipelines, and their heartbeat: a layer of the long prefill takes a fraction
#: of a second, the whole of it several seconds.
PROGRESS, HEARTBEAT = 1.0, 0.2
#: Heartbeats missed before a stage counts as dead: a stage killed here is found by its exit, and a heartbeat this
#: frequent may come late on a loaded machine, so 2 s of silence (not 3 beats) counts.
MISSED = 10
#: The threshold where a step runs the whole 8,000-token prompt (unchunked): above the time of one of its layers
#: on a busy machine, below the whole prefill's.
UNCHUNKED_PROGRESS = 1.5
#: Layouts, each with the recovery and batching it serves long prompts with; unchunked (`max_prefill_tokens`
#: None), so that one step holds a stage for the whole prefill.
LAYOUTS = {
    "one stage": {"stages": 1, "recovery": "recompute"},
    "mixed": {"stages": 2, "recovery": "replicas", "batching": "continuous"},
    "disaggregated": {"prompt_stages": 1, "token_stages": 1, "recovery": "recompute"},
}


def _first_stage(layout: str) -> str:
    return "prompt stage 0" if layout == "disaggregated" else "stage 0"


def _long_prompt() -> torch.Tensor:
    return torch.randint(1, 90, (LONG,), generator=torch.Generator().manual_seed(3))


def _pipeline(layout: dict) -> Pipeline:
    return Pipeline("tiny_models:long_llama", microbatch=2, threads=1, heartbeat=HEARTBEAT, missed_beats=MISSED,
                    progress_timeout=UNCHUNKED_PROGRESS, max_prefill_tokens=None, **layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_prefill_longer_than_the_progress_timeout_is_no_failure(layout: str) -> None:
    long, short = _long_prompt(), torch.randint(1, 90, (12,), generator=torch.Generator().manual_seed(4))
    with _pipeline(LAYOUTS[layout]) as pipe:
        began = time.monotonic()
        first = pipe.submit(long, max_new_tokens=4)
        time.sleep(0.5)
        second = pipe.submit(short, max_new_tokens=4)
        results = [first.result(timeout=120), second.result(timeout=120)]
        took = time.monotonic() - began
        assert pipe.recoveries == [], f"a long prefill was taken for a failure: {pipe.recoveries[0].describe()}"
        pad, eos = pipe.pad, pipe.eos
    assert took > UNCHUNKED_PROGRESS, f"the long prefill took {took:.1f} s: not long enough to test anything"
    model = tiny_models.long_llama()
    want = expectations.expected(model, [[0], [1]], [long, short], [4, 4], pad, eos)
    for result, tokens in zip(results, want, strict=True):
        assert torch.equal(result.tokens, tokens)


def test_a_stage_killed_during_a_long_prefill_is_recovered() -> None:
    long = _long_prompt()
    with _pipeline(LAYOUTS["one stage"]) as pipe:
        future = pipe.submit(long, max_new_tokens=4)
        deadline = time.monotonic() + 30
        while pipe.fleet.work.get("stage 0", 0) == 0 and not future.done():  # its heartbeats say it computes
            assert time.monotonic() < deadline, "the stage never said that it computes"
            time.sleep(0.02)
        pid = next(stage["pid"] for stage in pipe.status()["stages"] if stage["name"] == "stage 0")
        os.kill(pid, signal.SIGKILL)
        result = future.result(timeout=120)
        reports = list(pipe.recoveries)
        pad, eos = pipe.pad, pipe.eos
    assert len(reports) == 1
    assert "exited" in reports[0].reason
    (want,) = expectations.expected(tiny_models.long_llama(), [[0]], [long], [4], pad, eos)
    assert torch.equal(result.tokens, want)


#: Layouts under continuous batching with their recovery (the prompt pipeline runs its groups' chunks in turns),
#: and static batching, whose slots prefill in chunks too.
BESIDE = {
    "one stage": {"stages": 1, "recovery": None},
    "mixed": {"stages": 2, "recovery": "replicas"},
    "disaggregated": {"prompt_stages": 1, "token_stages": 1, "recovery": None},
    "mixed, static": {"stages": 2, "recovery": "replicas", "batching": "static"},
}


@pytest.mark.parametrize("layout", [pytest.param(layout, marks=pytest.mark.matrix) if layout == "mixed" else layout
                                    for layout in BESIDE])
def test_a_short_request_gets_its_first_token_beside_a_long_prefill(layout: str) -> None:
    """A long prompt runs a chunk a round (disaggregated: a chunk a turn of the prompt stage), and a request that
    cannot join its slot before it does opens a slot beside it: its first token comes within a few of the long
    prompt's chunks. A static slot's chunks give `model.generate` with those chunks."""
    long, short = _long_prompt(), torch.randint(1, 90, (12,), generator=torch.Generator().manual_seed(4))
    options = {"batching": "continuous", **BESIDE[layout]}
    with Pipeline("tiny_models:long_llama", microbatch=2, threads=1, heartbeat=HEARTBEAT, missed_beats=MISSED,
                  progress_timeout=PROGRESS, **options) as pipe:
        first = pipe.submit(long, max_new_tokens=4)
        deadline = time.monotonic() + 30
        while pipe.fleet.work.get(_first_stage(layout), 0) == 0:  # its first chunk runs
            assert time.monotonic() < deadline, "the long prompt's first chunk never ran"
            time.sleep(0.01)
        second = pipe.submit(short, max_new_tokens=4)
        long_result, short_result = first.result(timeout=120), second.result(timeout=120)
        assert pipe.recoveries == []
        pad, eos = pipe.pad, pipe.eos
    prefill = long_result.first_token - long_result.submitted
    waited = short_result.first_token - short_result.submitted
    assert prefill > 2 * PROGRESS, f"the long prefill took {prefill:.1f} s: not long enough to test anything"
    assert waited < prefill / 4, f"the short request waited {waited:.2f} s for its first token beside a prefill " \
        f"of {prefill:.2f} s"
    assert short_result.microbatch != long_result.microbatch  # a slot of its own, beside the long one
    model = tiny_models.long_llama()
    (want,) = expectations.expected(model, [[0]], [short], [4], pad, eos)
    assert torch.equal(short_result.tokens, want)  # alone in its slot, within the prefill budget
    if options["batching"] == "static":
        (want,) = expectations.expected(model, [[0]], [long], [4], pad, eos, max_prefill_tokens=DEFAULT_PREFILL_TOKENS)
        assert torch.equal(long_result.tokens, want)
        return
    requests = {long_result.request: Request(long, 4, Decoding())}
    assert long_result.tokens.tolist() == replay(model, long_result.schedule, requests)[long_result.request].tolist()


def test_a_long_prompt_cancelled_in_the_prompt_pipeline_stops_being_prefilled() -> None:
    """Disaggregated: cancelling the only request of a group whose prompt the prompt stage is running in chunks
    stops its chunks there (the stage's layers-run count stops growing), and the pipeline goes on serving."""
    short = torch.randint(1, 90, (12,), generator=torch.Generator().manual_seed(4))
    with Pipeline("tiny_models:long_llama", microbatch=2, threads=1, heartbeat=HEARTBEAT, missed_beats=MISSED,
                  progress_timeout=PROGRESS, batching="continuous", **BESIDE["disaggregated"]) as pipe:
        future = pipe.submit(_long_prompt(), max_new_tokens=4)
        deadline = time.monotonic() + 30
        while pipe.fleet.work.get("prompt stage 0", 0) == 0:  # its first chunks run
            assert time.monotonic() < deadline, "the long prompt's first chunk never ran"
            time.sleep(0.01)
        assert pipe.cancel(future)
        time.sleep(4 * HEARTBEAT)  # the chunk it was running ends, and a heartbeat says so
        stopped = pipe.fleet.work["prompt stage 0"]
        time.sleep(8 * HEARTBEAT)
        assert pipe.fleet.work["prompt stage 0"] == stopped, "the prompt stage went on prefilling a cancelled prompt"
        layers = tiny_models.long_llama().config.num_hidden_layers
        chunks = -(-LONG // 256)
        assert stopped < layers * chunks / 2, f"{stopped} layers ran of the {layers * chunks} of the whole prefill"
        result = pipe.submit(short, max_new_tokens=4).result(timeout=60)
        pad, eos = pipe.pad, pipe.eos
    assert future.cancelled()
    (want,) = expectations.expected(tiny_models.long_llama(), [[0]], [short], [4], pad, eos)
    assert torch.equal(result.tokens, want)
