"""Recovery: a stage killed (SIGKILL) or hung (SIGSTOP) mid-generation is replaced, and every request completes
with the tokens of a failure-free run, none lost or streamed twice."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict

import expectations
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.serving import Pipeline

pytestmark = pytest.mark.usefixtures("workers_import_tiny_models")

NEW = 120
DISAGGREGATED = {"prompt_stages": 1, "token_stages": 2}
SAMPLING = {"do_sample": True, "seed": 5, "temperature": 0.8, "top_k": 20}
#: Static microbatches of two, watched closely: each row equals `model.generate` on its microbatch (continuous
#: batching's recovery is tests/test_serving_slots_recovery.py's).
STATIC = {"microbatch": 2, "timeout": 60, "heartbeat": 0.5, "batching": "static"}


# ---- settings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("arguments", "match"), [
    ({"recovery": "magic"}, "recovery='magic'"),
    ({"recovery": "replicas", "transport": "nccl"}, r"links that reconnect to a replacement \(tcp, gloo, ucx\)"),
    ({"recovery": "replicas", "stages": 1}, "two decoding stages"),
    ({"recovery": "replicas", "prompt_stages": 2, "token_stages": 1}, "two decoding stages"),
])
def test_recovery_settings_it_cannot_honour_are_refused(arguments, match) -> None:
    arguments = {"stages": 2, **arguments} if "prompt_stages" not in arguments else arguments
    with pytest.raises(dv.ConfigError, match=match):
        Pipeline("tiny_models:llama", **arguments)


@pytest.mark.parametrize("model", ["mistral", "qwen2_sliding"])
def test_sliding_window_layers_recover_from_replicas_and_auto_chooses_them(model) -> None:
    """Sliding-window layers (all of Mistral's, some of Qwen2's) are replicated as any layer is (the matrix kills
    a stage beside them): replicas are taken, and "auto" picks them where the layout allows."""
    assert Pipeline(f"tiny_models:{model}", stages=2, recovery="replicas").recovery == "replicas"
    assert Pipeline(f"tiny_models:{model}", stages=2, recovery="auto").recovery == "replicas"


# ---- failures -----------------------------------------------------------------------------------------------
def _stage_pid(pipe: Pipeline, name: str) -> int:
    return next(stage["pid"] for stage in pipe.status()["stages"] if stage["name"] == name)


def _steps_taken(pipe: Pipeline) -> int:
    return sum(batch["steps"] for batch in pipe.status()["microbatches"])


def _wait_for_steps(pipe: Pipeline, steps: int, timeout: float = 60) -> None:
    """Wait until the microbatches in flight took `steps` more steps (a new microbatch's count from 0)."""
    deadline, seen, total = time.monotonic() + timeout, _steps_taken(pipe), 0
    while total < steps:
        assert time.monotonic() < deadline, f"{total} steps of {steps} within {timeout} s"
        time.sleep(0.005)
        now = _steps_taken(pipe)
        total, seen = total + max(0, now - seen), now


def _wait_for_each_to_step(pipe: Pipeline, timeout: float = 60) -> None:
    """Wait until every microbatch in flight now took a step or left: one hit again before its first step after
    a recovery fails by the poison bound, which is not what a test of independent failures is about."""
    deadline = time.monotonic() + timeout
    before = {batch["microbatch"]: batch["steps"] for batch in pipe.status()["microbatches"]}
    while True:
        now = {batch["microbatch"]: batch["steps"] for batch in pipe.status()["microbatches"]}
        if all(now.get(number, steps + 1) > steps for number, steps in before.items()):
            return
        assert time.monotonic() < deadline, f"microbatches {before} took no step within {timeout} s: {now}"
        time.sleep(0.005)


def _wait_for_recoveries(pipe: Pipeline, count: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while len(pipe.recoveries) < count:
        assert time.monotonic() < deadline, f"{len(pipe.recoveries)} recoveries of {count} within {timeout} s"
        assert pipe.status()["failure"] is None, pipe.status()["failure"]
        time.sleep(0.05)


def _expected(results, prompts, pad, eos, decoding) -> list[torch.Tensor]:
    """What each request gets from `model.generate` on its microbatch (greedy), or from a replay of its microbatch
    with each row sampled from its own generator seeded with the request's seed."""
    model = tiny_models.llama()
    members = expectations.microbatches(results)
    if not decoding:
        return expectations.expected(model, members, prompts, [NEW] * len(prompts), pad, eos)
    expected: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    row = {"top_p": 1.0, **decoding}  # generate's default, which the tiny llama's generation config keeps
    for batch in members:
        rows = expectations.replayed(model, prompts, batch, [row] * len(batch), [NEW] * len(batch), pad, eos)
        for index, tokens in zip(batch, rows, strict=True):
            expected[index] = tokens
    return expected


def _serve_through_failures(pipe: Pipeline, prompts, victims: list[str], how: signal.Signals, rng: random.Random,
                            decoding: dict) -> tuple[list, dict]:
    """Submit a wave of requests per failure, hit `victims[i]` with `how` at a random step of the wave, and
    wait for the recovery; return every result and the tokens each request streamed."""
    streamed: dict[int, list[int]] = defaultdict(list)
    futures = []
    wave = len(prompts) // len(victims)
    for failure, victim in enumerate(victims):
        first = failure * wave
        futures += pipe.submit_all(prompts[first:first + wave], NEW,
                                   on_token=lambda index, token, first=first: streamed[first + index].append(token),
                                   **decoding)
        _wait_for_steps(pipe, rng.randrange(2, NEW // 2))
        _wait_for_each_to_step(pipe)  # independent failures: none lands before a resumed microbatch goes on
        os.kill(_stage_pid(pipe, victim), how)
        _wait_for_recoveries(pipe, failure + 1)
    return [future.result(timeout=120) for future in futures], streamed


@pytest.mark.slow
@pytest.mark.parametrize(("how", "sampled"), [(signal.SIGKILL, False), (signal.SIGSTOP, True)],
                         ids=["SIGKILL-greedy", "SIGSTOP-sampled"])
def test_three_failures_of_random_token_stages_lose_no_request(how, sampled) -> None:
    rng = random.Random(f"{how.name}-{sampled}")  # a failing run replays with the same victims and steps
    victims = [rng.choice(["token stage 0", "token stage 1"]) for _ in range(3)]
    prompts = expectations.prompts(12, seed=8)
    decoding = SAMPLING if sampled else {}
    with Pipeline("tiny_models:llama", recovery="replicas", **STATIC,
                  **DISAGGREGATED) as pipe:
        results, streamed = _serve_through_failures(pipe, prompts, victims, how, rng, decoding)
        pad, eos = pipe.pad, pipe.eos
        reports = list(pipe.recoveries)
    assert [report.replaced for report in reports] == [[victim] for victim in victims]
    assert all(report.resumed and not report.recomputed for report in reports)  # each went on from its replicas
    assert all(report.transferring < 5 for report in reports)
    expected = _expected(results, prompts, pad, eos, decoding)
    for index, (result, want) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(result.tokens, want), f"request {index}"
        assert streamed[index] == want.tolist(), f"request {index} streamed tokens lost or twice"


@pytest.mark.slow
def test_a_killed_prompt_stage_and_a_killed_mixed_stage_lose_no_request() -> None:
    prompts = expectations.prompts(8, seed=9)
    for arguments, victim in ((DISAGGREGATED, "prompt stage 0"), ({"stages": 2}, "stage 0")):
        with Pipeline("tiny_models:llama", recovery="replicas", **STATIC,
                      **arguments) as pipe:
            futures = pipe.submit_all(prompts, NEW)
            _wait_for_steps(pipe, 20)
            os.kill(_stage_pid(pipe, victim), signal.SIGKILL)
            _wait_for_recoveries(pipe, 1)
            results = [future.result(timeout=120) for future in futures]
            pad, eos = pipe.pad, pipe.eos
            (report,) = pipe.recoveries
        assert report.replaced == [victim]
        expected = _expected(results, prompts, pad, eos, {})
        assert all(torch.equal(result.tokens, want) for result, want in zip(results, expected, strict=True))


@pytest.mark.slow
def test_a_warm_standby_replaces_a_killed_stage_and_the_pool_is_topped_up() -> None:
    prompts = expectations.prompts(4, seed=13)
    with Pipeline("tiny_models:llama", recovery="replicas", **STATIC, standby=1,
                  **DISAGGREGATED) as pipe:
        deadline = time.monotonic() + 60
        while not pipe.status()["standby"]:
            assert time.monotonic() < deadline, "the standby never joined"
            time.sleep(0.05)
        (spare,) = pipe.status()["standby"]
        futures = pipe.submit_all(prompts, NEW)
        _wait_for_steps(pipe, 30)
        os.kill(_stage_pid(pipe, "token stage 0"), signal.SIGKILL)
        _wait_for_recoveries(pipe, 1)
        assert _stage_pid(pipe, "token stage 0") == spare  # the standby took the stage: no process started for it
        results = [future.result(timeout=120) for future in futures]
        while len(pipe.status()["standby"]) != 1:  # a new spare joins the pool
            assert time.monotonic() < deadline + 60, "the pool was not topped up"
            time.sleep(0.05)
        assert pipe.status()["standby"] != [spare]
        pad, eos = pipe.pad, pipe.eos
    expected = _expected(results, prompts, pad, eos, {})
    assert all(torch.equal(result.tokens, want) for result, want in zip(results, expected, strict=True))


@pytest.mark.slow
def test_closing_during_a_recovery_leaves_no_worker_behind() -> None:
    pipe = Pipeline("tiny_models:llama", recovery="replicas", **STATIC,
                    **DISAGGREGATED).start()
    try:
        futures = pipe.submit_all(expectations.prompts(2, seed=15), NEW)
        _wait_for_steps(pipe, 10)
        os.kill(_stage_pid(pipe, "token stage 1"), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not pipe.status()["recovering"]:  # the replacement process is loading the model meanwhile
            assert time.monotonic() < deadline, "no recovery started"
            time.sleep(0.01)
    finally:
        started = time.monotonic()
        pipe.close()
    assert time.monotonic() - started < 30
    errors = [future.exception(timeout=1) for future in futures]  # a row that ended before has its answer
    assert any(isinstance(error, dv.TransportError) for error in errors)
    assert all(error is None or isinstance(error, dv.TransportError) for error in errors)
    workers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _is_worker_of(int(pid), pipe)]
    assert workers == []  # the stages, and the replacement launched for the recovery, are gone


def _is_worker_of(pid: int, pipe: Pipeline) -> bool:
    try:
        return f"--join {pipe.url}".encode() in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
    except OSError:  # gone meanwhile
        return False


def test_standby_workers_need_recovery() -> None:
    with pytest.raises(dv.ConfigError, match="standby"):
        Pipeline("tiny_models:llama", stages=2, standby=1)
    with pytest.raises(dv.ConfigError, match="standby"):
        Pipeline("tiny_models:llama", stages=2, recovery="replicas", standby=-1)


@pytest.mark.slow
@pytest.mark.parametrize("recovery", ["replicas", "recompute"])
def test_both_token_stages_lost_at_once_start_over_from_the_prompts_and_say_so(recovery) -> None:
    prompts = expectations.prompts(4, seed=10)
    streamed: dict[int, list[int]] = defaultdict(list)
    with Pipeline("tiny_models:llama", recovery=recovery, **STATIC,
                  **DISAGGREGATED) as pipe:
        futures = pipe.submit_all(prompts, NEW, on_token=lambda index, token: streamed[index].append(token))
        _wait_for_steps(pipe, 30)
        for victim in ("token stage 0", "token stage 1"):  # each held the other's replicas
            os.kill(_stage_pid(pipe, victim), signal.SIGKILL)
        _wait_for_recoveries(pipe, 1)
        results = [future.result(timeout=120) for future in futures]
        pad, eos = pipe.pad, pipe.eos
        reports = list(pipe.recoveries)
    assert sorted(name for report in reports for name in report.replaced) == ["token stage 0", "token stage 1"]
    assert not any(report.resumed for report in reports)
    assert any(report.recomputed for report in reports)
    assert "recomputed microbatch" in reports[-1].describe()
    expected = _expected(results, prompts, pad, eos, {})
    assert all(torch.equal(result.tokens, want) for result, want in zip(results, expected, strict=True))
    # Before: a microbatch started over streamed its tokens a second time, from its first.
    assert [streamed[index] for index in range(len(prompts))] == [want.tolist() for want in expected]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "victims"), [
    (DISAGGREGATED, ["token stage 0", "token stage 1"]),  # neighbours: each held the other's ring replicas
    ({"prompt_stages": 1, "token_stages": 1}, ["token stage 0"]),  # a ring of one cannot hold its own replica
])
def test_a_replica_store_outlives_the_stages_so_even_neighbours_lost_together_resume(tmp_path, layout,
                                                                                      victims) -> None:
    prompts = expectations.prompts(4, seed=16)
    streamed: dict[int, list[int]] = defaultdict(list)
    with Pipeline("tiny_models:llama", recovery="replicas", **STATIC,
                  replica_store=f"file://{tmp_path}/replicas", **layout) as pipe:
        futures = pipe.submit_all(prompts, NEW, on_token=lambda index, token: streamed[index].append(token))
        _wait_for_steps(pipe, 40)
        for victim in victims:
            os.kill(_stage_pid(pipe, victim), signal.SIGKILL)
        _wait_for_recoveries(pipe, 1)
        results = [future.result(timeout=120) for future in futures]
        pad, eos = pipe.pad, pipe.eos
        reports = list(pipe.recoveries)
    assert sorted(name for report in reports for name in report.replaced) == victims
    assert any(report.resumed for report in reports)  # from the store: not one of them started over
    expected = _expected(results, prompts, pad, eos, {})
    assert all(torch.equal(result.tokens, want) for result, want in zip(results, expected, strict=True))
    assert [streamed[index] for index in range(len(prompts))] == [want.tolist() for want in expected]
    assert dv.open_store(f"file://{tmp_path}/replicas").keys() == []  # each replica went with its microbatch


def test_replica_store_settings_it_cannot_honour_are_refused() -> None:
    with pytest.raises(dv.ConfigError, match="other processes see"):
        Pipeline("tiny_models:llama", stages=2, recovery="replicas", replica_store="memory://")
    with pytest.raises(dv.ConfigError, match="recovery='replicas' too"):
        Pipeline("tiny_models:llama", stages=2, replica_store="memory://")
    with pytest.raises(dv.ConfigError, match="never reads"):
        Pipeline("tiny_models:llama", stages=2, recovery="recompute", replica_store="memory://")


@pytest.mark.slow
def test_recompute_replaces_the_stage_and_starts_the_microbatches_over() -> None:
    """Static microbatches (continuous slots under recompute: tests/test_serving_slots_recovery.py)."""
    prompts = expectations.prompts(4, seed=12)
    with Pipeline("tiny_models:llama", stages=2, microbatch=2, timeout=60, heartbeat=0.5,
                  recovery="recompute", batching="static") as pipe:
        futures = pipe.submit_all(prompts, NEW, **SAMPLING)
        _wait_for_steps(pipe, 40)
        os.kill(_stage_pid(pipe, "stage 1"), signal.SIGKILL)
        _wait_for_recoveries(pipe, 1)
        results = [future.result(timeout=120) for future in futures]
        pad, eos = pipe.pad, pipe.eos
        (report,) = pipe.recoveries
    assert report.replaced == ["stage 1"]
    assert report.recomputed
    assert not report.resumed
    expected = _expected(results, prompts, pad, eos, SAMPLING)  # each microbatch started over, exactly
    assert all(torch.equal(result.tokens, want) for result, want in zip(results, expected, strict=True))


@pytest.mark.slow
def test_a_replaced_worker_started_elsewhere_that_wakes_up_is_told_by_its_epoch_to_exit(monkeypatch) -> None:
    """Workers started by hand (nothing here can kill them), one more than the stages (a spare): token stage 1's
    is stopped (SIGSTOP) and replaced; woken (SIGCONT), its next heartbeat is answered with `fenced` and it
    exits, and every token equals a failure-free run's, streamed once."""
    monkeypatch.setenv("DEJAVU_TOKEN", "fencing-secret")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = [subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "worker", "--join", f"tcp://127.0.0.1:{port}",
                                 "--threads", "1", "--worker-id", f"by-hand-{number}"]) for number in range(4)]
    try:
        prompts = expectations.prompts(4, seed=3)
        streamed: dict[int, list[int]] = defaultdict(list)
        # A stopped worker started elsewhere is not killed: a neighbour's send to it waits out `timeout` before
        # the neighbour can pause, so the test keeps it short.
        with Pipeline("tiny_models:llama", recovery="replicas", launch=False, port=port,
                      **{**STATIC, "timeout": 10}, **DISAGGREGATED) as pipe:
            futures = pipe.submit_all(prompts, NEW, on_token=lambda index, token: streamed[index].append(token))
            _wait_for_steps(pipe, 10)
            known = {f"by-hand-{number}" for number in range(len(workers))}
            assert {stage["worker"] for stage in pipe.status()["stages"]} < known  # by the ids they were given
            victim = _stage_pid(pipe, "token stage 1")
            os.kill(victim, signal.SIGSTOP)
            _wait_for_recoveries(pipe, 1)
            assert _stage_pid(pipe, "token stage 1") != victim
            os.kill(victim, signal.SIGCONT)
            stopped = next(worker for worker in workers if worker.pid == victim)
            assert stopped.wait(timeout=30) == 0  # told to exit, and gone
            results = [future.result(timeout=120) for future in futures]
            pad, eos = pipe.pad, pipe.eos
        for index, (result, want) in enumerate(zip(results, _expected(results, prompts, pad, eos, {}), strict=True)):
            assert torch.equal(result.tokens, want), f"request {index}"
            assert streamed[index] == want.tolist(), f"request {index} streamed tokens lost or twice"
    finally:
        for worker in workers:
            if worker.poll() is None:
                os.kill(worker.pid, signal.SIGCONT)
                worker.kill()
            worker.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "how"), [("gloo", signal.SIGKILL),
                                               pytest.param("ucx", signal.SIGSTOP, marks=pytest.mark.matrix)])
def test_recovery_goes_on_over_gloo_and_ucx_links_too(transport: str, how: signal.Signals) -> None:
    """A token stage killed (gloo) or hung (ucx): the replacement links to its neighbours over the same transport,
    and every request equals a failure-free run's, streamed once."""
    prompts = expectations.prompts(4, seed=12)
    with Pipeline("tiny_models:llama", recovery="replicas", transport=transport, **STATIC, **DISAGGREGATED) as pipe:
        assert pipe.recovery == "replicas"
        results, streamed = _serve_through_failures(pipe, prompts, ["token stage 0"], how, random.Random(transport),
                                                    {})
        pad, eos = pipe.pad, pipe.eos
        assert len(pipe.recoveries) == 1
    for index, (result, want) in enumerate(zip(results, _expected(results, prompts, pad, eos, {}), strict=True)):
        assert torch.equal(result.tokens, want), f"request {index}"
        assert streamed[index] == want.tolist(), f"request {index} streamed tokens lost or twice"


@pytest.mark.slow
def test_static_microbatches_killed_while_their_prompts_run_in_chunks_resume_from_replicas() -> None:
    """Static microbatches of two 29-44-token prompts, prefilled 4 positions (two columns) a round: a stage killed
    a few rounds in finds every microbatch still prefilling; each goes on from its replicas at the round it had
    reached (its group's cache held, and swapped, as its slot's), and every row equals `model.generate` with
    those chunks."""
    prompts = [torch.randint(3, 60, (length,), generator=torch.Generator().manual_seed(length))
               for length in (40, 31, 37, 44, 29, 35)]
    with Pipeline("tiny_models:llama", stages=2, recovery="replicas", swapping=True, max_prefill_tokens=4,
                  threads=1, **STATIC) as pipe:
        futures = pipe.submit_all(prompts, 10)
        _wait_for_steps(pipe, 3)
        os.kill(_stage_pid(pipe, "stage 1"), signal.SIGKILL)
        _wait_for_recoveries(pipe, 1)
        results = [future.result(timeout=120) for future in futures]
        pad, eos = pipe.pad, pipe.eos
    (report,) = pipe.recoveries
    assert report.resumed, report.describe()
    assert not report.recomputed, report.describe()
    assert all(0 < round_number < 15 for round_number in report.resumed.values()), report.resumed  # 15+ to prefill
    want = expectations.expected(tiny_models.llama(), expectations.microbatches(results), prompts, [10] * 6, pad, eos,
                                 max_prefill_tokens=4)
    assert [result.tokens.tolist() for result in results] == [tokens.tolist() for tokens in want]
