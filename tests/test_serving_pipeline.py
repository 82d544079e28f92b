"""Pipelines of stage processes over tcp serve every request exactly as model.generate serves its microbatch."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import expectations
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.serving import Pipeline
from dejavu_sdk.serving.options import PipelineOptions

pytestmark = pytest.mark.usefixtures("workers_import_tiny_models")




#: Each family's mixed pipeline: even and uneven cuts, one to three stages.
MIXED = {"llama": [(0, 1), (1, 3)], "gpt2": [(0, 2), (2, 3)], "opt": [(0, 1), (1, 2), (2, 3)], "mistral": [(0, 3)],
         "qwen2": [(0, 2), (2, 3)], "llama_two_ends": [(0, 2), (2, 3)]}
#: The ways a pipeline can be laid out: one mixed pipeline, or prompt and token pipelines of their own depths.
LAYOUTS = {"mixed": {}, "1P+1T": {"prompt_stages": 1, "token_stages": 1},
           "1P+2T": {"prompt_stages": 1, "token_stages": 2}, "2P+1T": {"prompt_stages": 2, "token_stages": 1}}


def _layout(family: str, layout: str) -> dict:
    return LAYOUTS[layout] or {"layers": MIXED[family]}


def _served_as_generate_serves_them(family: str, arguments: dict, prompts, max_new_tokens, **options) -> list:
    """Serve the prompts (submitted one by one) and check each result against `model.generate` on its
    microbatch; returns the results."""
    model = getattr(tiny_models, family)()
    with Pipeline(f"tiny_models:{family}", microbatch=3, timeout=60, batching="static", **arguments,
                  **options) as pipe:
        futures = [pipe.submit(ids, max_new_tokens=limit) for ids, limit in zip(prompts, max_new_tokens, strict=True)]
        results = [future.result(timeout=120) for future in futures]
        pad, eos = pipe.pad, pipe.eos
    microbatches = expectations.microbatches(results)
    for members in microbatches:
        longest = max(prompts[index].numel() for index in members)
        assert [results[index].padding for index in members] == [longest - prompts[index].numel() for index in members]
    expected = expectations.expected(model, microbatches, prompts, max_new_tokens, pad, eos)
    for result, want in zip(results, expected, strict=True):
        assert torch.equal(result.tokens, want)
    return results


#: Every family and layout over tcp; gloo links (the same code path as nccl) under two families, one of which
#: cuts the mixed pipeline in three, so that its links carry activations both ways.
CASES = [(family, layout, "tcp") for family in MIXED for layout in ("mixed", "1P+1T", "1P+2T")] + [
    (family, layout, "gloo") for family in ("llama", "opt") for layout in ("mixed", "1P+1T", "1P+2T")]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout", "transport"), CASES)
def test_every_request_gets_the_tokens_generate_gives_its_microbatch(family, layout, transport) -> None:
    prompts = expectations.prompts(7)
    # rows end at different steps; the first microbatch (the first request alone) ends with its first token
    max_new_tokens = [1] + [4 + 3 * (index % 4) for index in range(1, len(prompts))]
    results = _served_as_generate_serves_them(family, _layout(family, layout), prompts, max_new_tokens,
                                              transport=transport)
    assert len(expectations.microbatches(results)) >= 3  # 7 requests, at most 3 rows each
    if family == "llama_two_ends":  # some rows end at the second end-of-sequence token
        assert any(result.tokens[-1] == 49 for result in results)


@pytest.mark.slow
def test_prompt_and_token_pipelines_may_cut_the_model_differently() -> None:
    """Two prompt stages feed one token stage: its KV arrives from both, layer by layer."""
    prompts = expectations.prompts(7, seed=5)
    _served_as_generate_serves_them("mistral", LAYOUTS["2P+1T"], prompts, [6] * len(prompts))


@pytest.mark.slow
def test_a_full_token_side_holds_the_prompt_side_back() -> None:
    """One token slot: no prompt runs while a microbatch decodes; the default slots let the next prompt run
    meanwhile. Nothing is dropped either way."""
    prompts = expectations.prompts(4, seed=9)
    for slots, overlapped in ((1, False), (None, True)):
        results = _served_as_generate_serves_them("llama", LAYOUTS["1P+1T"], prompts, [12] * len(prompts),
                                                  token_slots=slots)
        spans: dict[int, tuple[float, float]] = {}  # each microbatch's first token and last token
        for result in results:
            first, last = spans.get(result.microbatch, (result.first_token, result.finished))
            spans[result.microbatch] = (min(first, result.first_token), max(last, result.finished))
        starts, ends = zip(*[spans[number] for number in sorted(spans)], strict=True)
        assert len(spans) >= 2
        assert any(start < end for start, end in zip(starts[1:], ends, strict=False)) == overlapped


@pytest.mark.slow
def test_generate_queues_its_prompts_together_in_order() -> None:
    """Five prompts, static microbatches of two, two stages: (0, 1) and (2, 3) start together, (4) when one
    ends."""
    prompts = expectations.prompts(5, seed=4)
    with Pipeline("tiny_models:llama", stages=2, microbatch=2, timeout=60, batching="static") as pipe:
        outs = pipe.generate(prompts, max_new_tokens=6)
        alone = pipe.submit(prompts[0], max_new_tokens=6).result(timeout=60)
        pad, eos = pipe.pad, pipe.eos
    expected = expectations.expected(tiny_models.seeded("llama"), [[0, 1], [2, 3], [4]], prompts, [6] * 5, pad, eos)
    assert all(torch.equal(out, want) for out, want in zip(outs, expected, strict=True))
    assert (alone.rows, alone.row, alone.padding) == (1, 0, 0)  # an idle pipeline serves it at once, alone


@pytest.mark.parametrize(("arguments", "match"), [
    ({"model": "no-such-model"}, "unknown model"),
    ({"model": "tiny_models:llama", "stages": 4}, "stages"),
    ({"model": "tiny_models:llama", "layers": [(0, 2), (1, 3)]}, "cover"),
    ({"model": "tiny_models:llama", "microbatch": 0}, "microbatch"),
    ({"model": "tiny_models:llama_repetition_penalty"}, "repetition_penalty"),
    ({"model": "tiny_models:llama", "prompt_stages": 1}, "both"),
    ({"model": "tiny_models:llama", "stages": 2, "prompt_stages": 1, "token_stages": 1}, "not both"),
    ({"model": "tiny_models:llama", "prompt_stages": 4, "token_stages": 1}, "4 stages"),
    ({"model": "tiny_models:llama", "prompt_stages": 1, "token_stages": 2, "token_slots": 1}, "token_slots"),
    ({"model": "tiny_models:llama", "stages": 2, "token_slots": 3}, "disaggregated"),
    ({"model": "tiny_models:llama", "machines": 2, "plan": "fast"}, "plan"),
    ({"model": "tiny_models:llama", "machines": 0}, "machines"),
    ({"model": "tiny_models:llama", "machines": 2, "stages": 2}, "machines"),
    ({"model": "tiny_models:llama", "machines": 2, "workload": (0, 4)}, "workload"),
    ({"model": "tiny_models:llama", "transport": "carrier-pigeon"}, "transport"),
    ({"model": "tiny_models:llama", "replica_prefix": "../x"}, "replica_prefix"),
])
def test_bad_pipelines_are_refused_before_any_process_starts(arguments, match) -> None:
    with pytest.raises(dv.ConfigError, match=match):
        Pipeline(**arguments)


def test_the_options_come_grouped_and_an_unknown_one_is_a_type_error() -> None:
    """Each group of options keeps what was given (`links`, `watch`, `resilience`, `memory`); a keyword no
    group takes is refused as a call with an unknown keyword is, by name."""
    options = PipelineOptions.check("tiny_models:llama", 2, transport="gloo", heartbeat=0.5, missed_beats=4,
                                    recovery="replicas", standby=1, kv_budget_bytes=1 << 20, swapping=False,
                                    replica_prefix="run-7", token="secret")
    assert (options.links.transport, options.links.token) == ("gloo", "secret")
    assert (options.watch.heartbeat, options.watch.missed_beats) == (0.5, 4)
    assert (options.resilience.recovery, options.resilience.standby) == ("replicas", 1)
    assert options.resilience.replica_prefix == "run-7"
    assert (options.memory.kv_budget, options.memory.swapping) == (1 << 20, False)
    with pytest.raises(TypeError, match="hearbeat"):
        Pipeline("tiny_models:llama", stages=2, hearbeat=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("machines", [1, 2, 3])
def test_the_planner_lays_out_the_machines(machines) -> None:
    """machines=N: the planner measures Y and t here and picks one mixed pipeline or a prompt/token split."""
    prompts = expectations.prompts(4, seed=13)
    pipe = Pipeline("tiny_models:llama", machines=machines, workload=(24, 3), microbatch=2, timeout=60)
    assert pipe.plan is not None
    if pipe.plan.disaggregate:
        assert [len(layout) for layout in pipe.layouts] == [pipe.plan.prompt_machines, pipe.plan.token_machines]
        assert pipe.plan.prompt_machines + pipe.plan.token_machines == machines
    else:
        assert [len(layout) for layout in pipe.layouts] == [machines]
    with pipe:
        assert all(out.numel() == 3 for out in pipe.generate(prompts, max_new_tokens=3))


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_is_refused() -> None:
    with Pipeline("tiny_models:gpt2", stages=1, timeout=60) as pipe, pytest.raises(dv.ConfigError, match="context"):
        pipe.submit(torch.ones(200, dtype=torch.long), max_new_tokens=4)  # GPT-2 here holds 128 positions


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "killed"), [("mixed", 1), ("1P+2T", 0), ("1P+2T", 2)],
                         ids=["mixed-stage-1", "prompt-stage", "last-token-stage"])
def test_a_killed_worker_fails_its_requests_within_the_timeout(layout, killed) -> None:
    arguments = LAYOUTS[layout] or {"stages": 2}
    with Pipeline("tiny_models:llama", microbatch=2, timeout=10, **arguments) as pipe:
        assert pipe.submit(expectations.prompts(1)[0], max_new_tokens=3).result(timeout=60).tokens.numel() == 3
        futures = [pipe.submit(ids, max_new_tokens=400) for ids in expectations.prompts(4)]
        os.kill(pipe.status()["stages"][killed]["pid"], signal.SIGKILL)
        started = time.monotonic()
        for future in futures:
            with pytest.raises(dv.TransportError):
                future.result(timeout=30)
        assert time.monotonic() - started < 15


@pytest.mark.slow
def test_a_stopped_worker_misses_its_heartbeats_and_fails_its_requests_long_before_the_timeout() -> None:
    """SIGSTOP: the process lives, its neighbours' links stay open, only its missing heartbeats tell."""
    with Pipeline("tiny_models:llama", stages=2, microbatch=2, timeout=120, heartbeat=0.5, missed_beats=3) as pipe:
        assert pipe.submit(expectations.prompts(1)[0], max_new_tokens=3).result(timeout=60).tokens.numel() == 3
        stage = pipe.status()["stages"][1]
        assert 0 <= stage["last_heartbeat_seconds_ago"] < 1.5
        futures = [pipe.submit(ids, max_new_tokens=1000) for ids in expectations.prompts(4)]
        os.kill(stage["pid"], signal.SIGSTOP)
        try:
            started = time.monotonic()
            for future in futures:
                with pytest.raises(dv.TransportError, match="stage 1 sent no heartbeat"):
                    future.result(timeout=60)
            assert time.monotonic() - started < 10  # 3 missed beats of 0.5 s, not the 120 s progress timeout
        finally:
            os.kill(stage["pid"], signal.SIGCONT)


@pytest.mark.slow
def test_a_head_that_stops_listening_for_a_while_takes_no_stage_for_dead() -> None:
    """The head's receiver thread held for 2 s (an `on_token` callback that runs long, as a starved process would
    be) hears no heartbeat meanwhile: that silence is its own, so no stage counts as dead (without recovery that
    would fail the requests) and every request ends exactly."""
    prompts = expectations.prompts(3)
    held = []

    def slow_listener(index: int, token: int) -> None:
        if not held:
            held.append(token)
            time.sleep(2.0)  # ten heartbeats of 0.2 s: three missed count a stage dead

    with Pipeline("tiny_models:llama", stages=2, microbatch=3, timeout=60, heartbeat=0.2, missed_beats=3,
                  batching="static") as pipe:
        futures = pipe.submit_all(prompts, 6, on_token=slow_listener)
        results = [future.result(timeout=60) for future in futures]
        assert held, "the listener was called"
        assert pipe.status()["failure"] is None
        pad, eos = pipe.pad, pipe.eos
    want = expectations.expected(tiny_models.llama(), expectations.microbatches(results), prompts,
                                 [6] * len(prompts), pad, eos)
    for result, expected in zip(results, want, strict=True):
        assert torch.equal(result.tokens, expected)


def test_bad_heartbeat_settings_are_refused() -> None:
    for options in ({"heartbeat": 0}, {"heartbeat": "1s"}, {"missed_beats": 0}, {"missed_beats": 1.5},
                    {"progress_timeout": 0}, {"progress_timeout": float("inf")},
                    {"progress_timeout": 1.0, "heartbeat": 1.0}):
        with pytest.raises(dv.ConfigError, match=r"heartbeat|missed_beats|progress_timeout"):
            Pipeline("tiny_models:llama", stages=2, **options)


@pytest.mark.slow
def test_workers_started_by_hand_through_the_cli_join_the_head(tmp_path, monkeypatch) -> None:
    """As on other machines: `dejavu worker --join` twice, the head listening with launch=False, one token."""
    monkeypatch.setenv("DEJAVU_TOKEN", "a-shared-secret")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = [subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "worker", "--join",
                                 f"tcp://127.0.0.1:{port}", "--threads", "1"]) for _ in range(2)]
    try:
        with Pipeline("tiny_models:llama", stages=2, microbatch=2, launch=False, port=port, timeout=60) as pipe:
            prompts = expectations.prompts(3, seed=8)
            outs = pipe.generate(prompts, max_new_tokens=5)
            pad, eos = pipe.pad, pipe.eos
        expected = expectations.expected(tiny_models.seeded("llama"), [[0, 1], [2]], prompts, [5] * 3, pad, eos)
        assert all(torch.equal(out, want) for out, want in zip(outs, expected, strict=True))
        assert [worker.wait(timeout=30) for worker in workers] == [0, 0]  # shut down by the head
    finally:
        for worker in workers:
            worker.kill()


@pytest.mark.slow
def test_a_worker_without_the_token_is_not_let_in(monkeypatch) -> None:
    monkeypatch.delenv("DEJAVU_TOKEN", raising=False)
    with Pipeline("tiny_models:llama", stages=1, timeout=60) as pipe:
        stranger = dv.open_transport(pipe.url, token="a-guess")
        with pytest.raises(dv.AccessDenied):
            stranger.send_tensor(torch.zeros(4, dtype=torch.uint8))
        stranger.close()
        assert pipe.generate([expectations.prompts(1)[0]], max_new_tokens=2)[0].numel() == 2


def _packed(header: dict) -> torch.Tensor:
    """A message's bytes with this header (and no tensors): what a peer that speaks the format might send."""
    encoded = json.dumps(header).encode()
    data = struct.pack("<I", len(encoded)) + encoded
    return torch.frombuffer(bytearray(data + bytes(-len(data) % 8)), dtype=torch.uint8)


@pytest.mark.slow
def test_garbage_on_a_stage_link_or_at_the_head_costs_that_message_and_no_recovery(caplog) -> None:
    prompts = expectations.prompts(2, seed=8)
    with Pipeline("tiny_models:llama", stages=2, timeout=60, recovery="replicas") as pipe:
        before = pipe.generate(prompts[:1], max_new_tokens=4)[0]
        with dv.open_transport(pipe.fleet.url_of(1), token=pipe.options.links.token, timeout=5) as link:
            link.send_tensor(torch.randint(0, 256, (64,), dtype=torch.uint8))  # no message at all
            link.send_tensor(_packed({"kind": "no-such-kind", "fields": {"microbatch": 0}, "tensors": []}))
            link.send_tensor(_packed({"kind": "decode", "fields": {"microbatch": 0}, "tensors": []}))  # fields short
        token = pipe.options.links.token
        with dv.open_transport(pipe.url, token=token, timeout=5) as head:  # a report without its tokens
            head.send_tensor(_packed({"kind": "tokens", "fields": {"microbatch": 0}, "tensors": []}))
        after = pipe.generate(prompts, max_new_tokens=4)
        assert pipe.recoveries == []
        assert pipe.status()["epoch"] == 0
        assert pipe.status()["failure"] is None
    assert torch.equal(after[0], before)
    assert "the head dropped what it received" in caplog.text


@pytest.mark.slow
def test_a_cancelled_request_leaves_the_others_served() -> None:
    prompts = expectations.prompts(4, seed=6)
    with Pipeline("tiny_models:llama", stages=1, microbatch=1, timeout=60) as pipe:
        futures = [pipe.submit(ids, max_new_tokens=limit) for ids, limit in zip(prompts, [8, 1, 1, 1], strict=True)]
        assert futures[3].cancel()  # still waiting behind the first
        served = [future.result(timeout=60) for future in futures[:3]]
    assert [result.tokens.numel() for result in served[1:]] == [1, 1]  # max_new_tokens=1: the prefill's token


def test_workers_by_hand_need_a_shared_token(monkeypatch) -> None:
    monkeypatch.delenv("DEJAVU_TOKEN", raising=False)
    with pytest.raises(dv.ConfigError, match="DEJAVU_TOKEN"):
        Pipeline("tiny_models:llama", stages=1, launch=False)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"temperature": 0.7, "top_p": 0.9}, {"top_k": 5, "min_p": 0.05}, {}],
                         ids=["temperature+top_p", "top_k+min_p", "the model's defaults"])
def test_sampled_requests_equal_seeded_generate_on_their_microbatch(settings) -> None:
    model = tiny_models.llama()
    prompts = expectations.prompts(5, seed=11)
    with Pipeline("tiny_models:llama", stages=2, microbatch=3, timeout=60, batching="static") as pipe:
        busy = [pipe.submit(ids, max_new_tokens=40) for ids in prompts[:2]]  # both slots taken: the rest wait
        sampled = [pipe.submit(ids, max_new_tokens=8, do_sample=True, seed=7, **settings) for ids in prompts[:3]]
        greedy = pipe.submit(prompts[3], max_new_tokens=8)  # another decoding: never in a sampled microbatch
        unseeded = pipe.submit(prompts[4], max_new_tokens=8, do_sample=True, **settings)
        results = [future.result(timeout=60) for future in sampled]
        lone, drawn = greedy.result(timeout=60), unseeded.result(timeout=60)
        assert all(future.result(timeout=60).rows == 1 for future in busy)
        pad, eos = pipe.pad, pipe.eos
    assert {result.microbatch for result in results} == {results[0].microbatch}
    assert [result.seed for result in results] == [7, 7, 7]
    row = {"do_sample": True, "seed": 7, **_explicit(settings)}  # each row its own generator seeded with 7
    expected = expectations.replayed(model, prompts, [0, 1, 2], [row] * 3, [8] * 3, pad, eos)
    assert all(torch.equal(result.tokens, want) for result, want in zip(results, expected, strict=True))
    assert lone.seed is None
    assert drawn.seed is not None
    assert (lone.microbatch, lone.rows, drawn.microbatch) == (drawn.microbatch, 2, drawn.microbatch)  # shared
    pair = [{"do_sample": False}, {"do_sample": True, "seed": drawn.seed, **_explicit(settings)}]
    assert [result.tokens.tolist() for result in (lone, drawn)] == [
        tokens.tolist() for tokens in expectations.replayed(model, prompts, [3, 4], pair, [8, 8], pad, eos)]


def _explicit(settings: dict) -> dict:
    """Sampling settings with generate's defaults (tiny llama's generation config sets none) filled in."""
    return {"temperature": 1.0, "top_k": 50, "top_p": 1.0, **settings}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1P+1T", "1P+2T"])
def test_disaggregated_sampling_continues_the_prompt_pipelines_generator(layout) -> None:
    """The first token is sampled at the prompt pipeline's last stage, the rest at the token pipeline's: each
    row's generator goes on where the prompt pipeline left it."""
    model = tiny_models.llama()
    prompts = expectations.prompts(3, seed=12)
    settings = {"temperature": 0.8, "top_k": 20}
    with Pipeline("tiny_models:llama", microbatch=3, timeout=60, batching="static", **LAYOUTS[layout]) as pipe:
        outs = pipe.generate(prompts, max_new_tokens=9, do_sample=True, seed=21, **settings)
        pad, eos = pipe.pad, pipe.eos
    row = {"do_sample": True, "seed": 21, **_explicit(settings)}
    expected = expectations.replayed(model, prompts, [0, 1, 2], [row] * 3, [9] * 3, pad, eos)
    assert all(torch.equal(out, want) for out, want in zip(outs, expected, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(("arguments", "match"), [
    ({"temperature": 0.5}, "do_sample"),
    ({"seed": 3}, "do_sample"),
    ({"do_sample": True, "top_k": -2}, "top_k"),
    ({"do_sample": True, "seed": 2**64}, "seed"),
    ({"do_sample": True, "num_beams": 2}, "unknown"),
])
def test_bad_decoding_settings_are_refused(arguments, match) -> None:
    with Pipeline("tiny_models:llama", stages=1, timeout=60) as pipe, pytest.raises(dv.ConfigError, match=match):
        pipe.submit(expectations.prompts(1)[0], max_new_tokens=2, **arguments)
