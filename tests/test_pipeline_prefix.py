"""A pipeline's prompt prefixes: each stage keeps its own layers' chunks and a prompt prefilled alone starts from the
chunks every stage holds; every request's tokens equal `replay` of its slot's rounds (which computes the chunks
read, a chunk at a time, as they were kept), tenants share nothing, and a stage that finds fewer chunks than the
stages before it read has the prompt start again from what all of them hold."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import time

import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.replay import replay
from dejavu_sdk.serving import Pipeline

pytestmark = pytest.mark.usefixtures("workers_import_tiny_models")

CHUNK = 8
NEW = 5


def _prompts(lengths: list[int], head: int, seed: int) -> list[torch.Tensor]:
    """Prompts of `lengths` sharing their first `head` tokens."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, tiny_models.VOCAB, (head,), generator=generator)
    prompts = [torch.randint(1, tiny_models.VOCAB, (length,), generator=generator) for length in lengths]
    for prompt in prompts:
        prompt[:head] = shared[:min(head, prompt.numel())]
    return prompts


def _pipeline(tiers, **options) -> Pipeline:
    return Pipeline("tiny_models:llama", stages=2, microbatch=3, timeout=60, prefix_cache=tiers, prefix_chunk=CHUNK,
                    max_prefill_tokens=CHUNK, **options)


def _serve(pipe: Pipeline, prompts: list[torch.Tensor], **settings) -> list:
    """Each prompt submitted alone, one after another (each finds what those before it kept)."""
    return [pipe.submit(prompt, max_new_tokens=NEW, **settings).result(timeout=60) for prompt in prompts]


def _assert_replayed(prompts, results, decodings: list[Decoding]) -> None:
    """Every result equals the replay of its slot's rounds (`results`: every request those rounds ran)."""
    model = tiny_models.llama()
    requests = {result.request: Request(prompt, NEW, decoding)
                for result, prompt, decoding in zip(results, prompts, decodings, strict=True)}
    for result in results:
        assert result.schedule, "continuous results carry their slot's rounds"
        assert result.tokens.tolist() == replay(model, result.schedule, requests)[result.request].tolist()


def test_each_stage_reads_its_chunks_every_request_equals_its_replay_and_tenants_share_none() -> None:
    prompts = _prompts([30, 27, 41, 30, 12], head=26, seed=1)  # three whole chunks shared, then their own
    sampled = {"do_sample": True, "seed": 11, "top_k": 20}
    with _pipeline("memory://") as pipe:
        results = _serve(pipe, prompts)
        together = [future.result(timeout=60) for future in pipe.submit_all(prompts, NEW, **sampled)]
        other = _serve(pipe, prompts[:1], cache_salt="tenant b")
        again = _serve(pipe, prompts[:1], cache_salt="tenant b")
        with pytest.raises(dv.ConfigError, match="salt"):
            pipe.submit(prompts[0], max_new_tokens=NEW, cache_salt=7)
    assert [result.cached_positions for result in results] == [0, 24, 24, 24, 8]
    assert [result.cached_positions for result in together] == [24, 24, 40, 24, 8]  # greedy requests' chunks
    assert [other[0].cached_positions, again[0].cached_positions] == [0, 24]  # another tenant's own
    _assert_replayed(prompts * 2 + prompts[:1] * 2, results + together + other + again,
                     [Decoding()] * 5 + [Decoding.of(**sampled)] * 5 + [Decoding()] * 2)  # their slots' rounds
    first = next(step for step in results[1].schedule if step.prefill is not None
                 and results[1].request in step.prefill[0])
    assert (first.prefill[1:], first.chunk, first.cached) == ((0, 27), CHUNK, 24)


def test_a_stage_that_finds_fewer_chunks_has_the_prompt_start_again_from_what_all_hold(tmp_path) -> None:
    """Both stages keep their chunks in one directory; the last stage's are deleted there, so the first stage reads
    chunks the second cannot: the prompt starts again from none, and its tokens stay exact."""
    prompts = _prompts([30, 30], head=30, seed=3)
    with _pipeline(f"file://{tmp_path}") as pipe:
        kept_first = _serve(pipe, prompts[:1])
        first, stop = pipe.status()["stages"][1]["layers"]
        kept = sorted(pathlib.Path(tmp_path).glob(f"*-L{first}-{stop}"))
        assert kept, "the second stage keeps its layers' chunks there"
        for path in kept:
            shutil.rmtree(path)
        again = _serve(pipe, prompts[1:])
        after = _serve(pipe, prompts[1:])
    assert again[0].cached_positions == 0
    assert after[0].cached_positions == 24  # kept again by the prompt computed whole
    _assert_replayed([*prompts, prompts[1]], kept_first + again + after, [Decoding()] * 3)


@pytest.mark.parametrize(("options", "match"), [
    ({"max_prefill_tokens": 16}, "max_prefill_tokens=16 with prefix_chunk=8"),
    ({"prompt_stages": 1, "token_stages": 1, "stages": None}, "prompt pipeline"),
    ({"prefix_cache": ["memory://?max_bytes=lots"]}, "not a size"),
    ({"prefix_cache": 3}, "store URLs"),
    ({"prefix_chunk": 0}, "positive"),
])
def test_bad_prefix_options_are_refused_before_any_process_starts(options, match) -> None:
    arguments = {"stages": 2, "prefix_cache": "memory://", "prefix_chunk": CHUNK, "max_prefill_tokens": CHUNK,
                 **options}
    with pytest.raises(dv.ConfigError, match=match):
        Pipeline("tiny_models:llama", **{name: value for name, value in arguments.items() if value is not None})


def test_a_killed_stage_is_recomputed_with_hits_and_every_request_equals_its_replay() -> None:
    """recovery="auto" recomputes with a prefix cache: the stage's replacement holds no chunk of its memory tier, so
    a prompt read again (a lost slot's rows, new ones) starts again from what every stage holds, and every request
    still equals the replay of its rounds."""
    prompts = _prompts([30, 28, 33, 30], head=26, seed=4)
    with _pipeline("memory://", recovery="auto", heartbeat=0.5, missed_beats=6) as pipe:
        assert pipe.options.resilience.recovery == "recompute"
        first = _serve(pipe, prompts[:1])
        futures = pipe.submit_all(prompts, 12)
        deadline = time.monotonic() + 60
        while sum(batch["steps"] for batch in pipe.status()["microbatches"]) < 4:
            assert time.monotonic() < deadline, "the slots never ran"
            time.sleep(0.005)
        os.kill(next(stage["pid"] for stage in pipe.status()["stages"] if stage["name"] == "stage 1"), signal.SIGKILL)
        results = [future.result(timeout=120) for future in futures]
        assert [report.replaced for report in pipe.recoveries] == [["stage 1"]]
        after = _serve(pipe, prompts[:1])
    model = tiny_models.llama()
    requests = {result.request: Request(prompt, limit, Decoding())
                for result, prompt, limit in zip(first + results + after, [prompts[0], *prompts, prompts[0]],
                                                 [NEW, 12, 12, 12, 12, NEW], strict=True)}
    for result in first + results + after:
        assert result.tokens.tolist() == replay(model, result.schedule, requests)[result.request].tolist()
    assert after[0].cached_positions == 24  # kept again by the replacement
