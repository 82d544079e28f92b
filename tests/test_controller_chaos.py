"""Chaos: `dejavu serve --journal` SIGKILLed (or stopped) at a random moment while 8 clients stream (greedy and seeded
sampling), alone or with its stage worker; a new one started on the same journal and address goes on with every
request, and each client, reconnecting with its `Last-Event-ID`, ends with exactly the tokens of a run without
the failure: none missing, none twice."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from resuming_clients import ResumingClient

MODEL = "tiny_models:llama_text"
TESTS = str(Path(__file__).parent)
TOKEN = "chaos-token"
CLIENTS, NEW = 8, 24
#: Seconds a client keeps reconnecting while the controller is replaced.
RECONNECT = 120.0


def _serve(port: int, journal: str, tmp_path: Path, *options: str) -> subprocess.Popen:
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN + "\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", MODEL, "--listen",
                             f"127.0.0.1:{port}", "--token-file", str(token_file), "--journal", journal,
                             "--microbatch", "4", *options], stdout=subprocess.PIPE, text=True, env=environment)


def _resumed_by_a_successor(port: int, journal: str, tmp_path: Path, layout: list[str],
                            processes: list[subprocess.Popen], clients: list[ResumingClient],
                            expected: list[list[int]]) -> tuple[str, dict]:
    """Start a successor on the journal and address; every client, reconnecting, ends with the failure-free run's
    tokens. The successor's URL and what it says it adopted."""
    second = _serve(port, journal, tmp_path, *layout)
    processes.append(second)
    url = _serving(second)
    for client in clients:
        client.join(timeout=RECONNECT + 150)
    for number, client in enumerate(clients):
        assert client.error is None, f"client {number}: {client.error!r}"
        assert client.tokens == expected[number], f"client {number} (reconnected {client.reconnects} times)"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    return url, httpx.get(f"{url}/v1/status", headers=headers, timeout=30).json()["adopted"]


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each process still running (SIGKILL past 30 s), and reap it."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _serving(process: subprocess.Popen) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
    assert match, line
    return match.group(1)


def _body(client: int) -> dict:
    sampled = client % 2 == 1
    return {"model": MODEL, "prompt": [5 + client, 17, 33 + client], "max_tokens": NEW, "ignore_eos": True,
            "temperature": 1.0 if sampled else 0, **({"seed": 1000 + client} if sampled else {})}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("failure", [pytest.param("controller-stopped", marks=pytest.mark.matrix),
                                     pytest.param("controller-and-a-token-stage", marks=pytest.mark.matrix)])
def test_every_stream_resumes_exactly_once_after_the_controller_is_killed(tmp_path, failure: str) -> None:
    """Stopped (SIGSTOP) past the workers' orphan timeout: the worker stops on its own, and the successor (started
    once a supervisor has killed the stopped one) starts a new one. Killed with one of its token stages: a new
    worker starts for it, and the other token stage rejoins. (Killed alone, or with a stage of two mixed ones:
    `test_the_successor_goes_on_from_the_caches_its_workers_still_hold`.)"""
    port, journal = _free_port(), f"file://{tmp_path}/journal"
    orphan_timeout = 3.0 if failure == "controller-stopped" else 60.0  # the default: a successor takes seconds
    layout = ["--prompt-stages", "1", "--token-stages", "2"] if failure == "controller-and-a-token-stage" else []
    first = _serve(port, journal, tmp_path, "--orphan-timeout", str(orphan_timeout), *layout)
    processes = [first]
    try:
        url = _serving(first)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        expected = []  # the failure-free run
        for client in range(CLIENTS):
            answer = httpx.post(f"{url}/v1/completions", json=_body(client), headers=headers, timeout=120)
            expected.append(answer.json()["choices"][0]["token_ids"])
        stage_pid = httpx.get(f"{url}/v1/status", headers=headers, timeout=30).json()["stages"][-1]["pid"]
        progress = [0] * CLIENTS
        clients = [ResumingClient(url, TOKEN, _body(client), progress, client, RECONNECT + 120)
                   for client in range(CLIENTS)]
        for client in clients:
            client.start()
        kill_after = random.Random().randint(CLIENTS, CLIENTS * NEW // 2)  # tokens received by all, before the kill
        deadline = time.monotonic() + 120
        while sum(progress) < kill_after:
            assert time.monotonic() < deadline, f"the clients got {sum(progress)} tokens in 120 s"
            time.sleep(0.005)
        if failure == "controller-and-a-token-stage":  # in the same instant (as a machine that hosted both would go)
            os.kill(stage_pid, signal.SIGKILL)
        if failure == "controller-stopped":
            os.kill(first.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            while _running(stage_pid):  # missed heartbeats (3 x 1 s), then the orphan timeout
                assert time.monotonic() - stopped < 60, "the stage worker outlived its stopped controller by 60 s"
                time.sleep(0.1)
            assert time.monotonic() - stopped > orphan_timeout, "the worker stopped before its orphan timeout"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        had = {client.request_id: progress[number] for number, client in enumerate(clients)}  # at the kill
        killed_at = sum(progress)
        second_url, adopted = _resumed_by_a_successor(port, journal, tmp_path, layout, processes, clients, expected)
        assert all(client.finish == "length" for client in clients)
        assert killed_at < CLIENTS * NEW, "the kill came after every token"
        assert sum(client.reconnects for client in clients) > 0
        assert adopted["going_on"], "the successor took over no request"
        for request_id in adopted["going_on"]:  # the report says what it took over from the caches or computed
            tokens = adopted["recomputed"].get(request_id, 0) + adopted["taken_over"].get(request_id, 0)  # again: at
            assert tokens >= had.get(request_id, 0)  # least what the client had (the journal is written ahead)
        assert not adopted["taken_over"], adopted  # no worker holds every stage of a microbatch: nothing is
        status = httpx.get(f"{second_url}/v1/status", headers=headers, timeout=30).json()  # taken over
        names = [stage["name"] for stage in status["stages"]]
        survivors = names[:-1] if failure == "controller-and-a-token-stage" else []
        assert sorted(adopted["rejoined"]) == sorted(survivors)  # every stage whose worker lives took it back
        assert status["stages"][-1]["pid"] != stage_pid
        assert status["epoch"] >= 1  # past the old pipeline's: what its stages still send each other is dropped
    finally:
        _stop(processes)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "kills", "with_stage"), [
    ([], 1, None),
    pytest.param(["--prompt-stages", "1", "--token-stages", "1", "--batching", "static"], 1, None,
                 marks=pytest.mark.matrix),
    pytest.param(["--stages", "2", "--swapping", "on"], 2, None, marks=pytest.mark.matrix),
    pytest.param(["--stages", "2"], 1, 0, marks=pytest.mark.matrix)])
def test_the_successor_goes_on_from_the_caches_its_workers_still_hold(tmp_path, layout: list[str], kills: int,
                                                                      with_stage: int | None) -> None:
    """The controller is SIGKILLed while a microbatch decodes (continuous batching's slots: one stage, with
    recovery by recomputing, and two stages, with replicas; static microbatches: disaggregated; its successor
    killed in turn, `kills`, with the caches swapped to host memory; the first stage killed with it,
    `with_stage`): the stage workers rejoin the successor with their caches, and it goes on from the step the last
    stage reached (greedy and seeded sampled rows alike; a dead stage's part from the replicas its neighbour
    holds), not from the prompts: the report lists the requests as taken over, none as computed again, and every
    client's tokens equal the failure-free run's (and the log-probabilities of the client that asks for them,
    which the last stage keeps with its round reports)."""
    port, journal, clients_count, new = _free_port(), f"file://{tmp_path}/journal", 4, 60
    first = _serve(port, journal, tmp_path, *layout)
    processes = [first]
    try:
        url = _serving(first)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        bodies = [{**_body(client), "max_tokens": new, **({"logprobs": 2} if client == 3 else {})}
                  for client in range(clients_count)]
        pids = [stage["pid"] for stage in httpx.get(f"{url}/v1/status", headers=headers, timeout=30).json()["stages"]]
        answers = [httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).json()["choices"][0]
                   for body in bodies]
        expected = [answer["token_ids"] for answer in answers]
        progress = [0] * clients_count
        clients = [ResumingClient(url, TOKEN, body, progress, client, RECONNECT + 120)
                   for client, body in enumerate(bodies)]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 120
        for kill in range(kills):
            if kill:  # the successor in turn, once it has gone on
                processes.append(_serve(port, journal, tmp_path, *layout))
                _serving(processes[-1])
            while max(progress) < 20 * (kill + 1):  # a microbatch is decoding
                assert time.monotonic() < deadline, f"the clients got {progress} tokens in 120 s"
                time.sleep(0.002)
            if with_stage is not None and kill == kills - 1:  # in the same instant
                stage_pid = httpx.get(f"{url}/v1/status", headers=headers, timeout=30).json()["stages"][with_stage]
                os.kill(stage_pid["pid"], signal.SIGKILL)
            os.kill(processes[-1].pid, signal.SIGKILL)
            processes[-1].wait(timeout=30)
        had = {client.request_id: progress[number] for number, client in enumerate(clients)}
        assert max(had.values()) < new, "the kill came after the last token"
        second_url, adopted = _resumed_by_a_successor(port, journal, tmp_path, layout, processes, clients, expected)
        # past its first token a request is on the (token) stages: one with just its first may wait for a token
        decoding = [request_id for request_id, tokens in had.items() if tokens > 1]  # stage (disaggregated)
        assert decoding, had
        assert set(decoding) <= set(adopted["taken_over"]), adopted
        for request_id in decoding:
            assert adopted["taken_over"][request_id] >= had[request_id]
        assert all(had.get(request_id, 0) <= 1 for request_id in adopted["recomputed"]), adopted
        assert clients[3].logprobs == pytest.approx(answers[3]["logprobs"]["token_logprobs"], abs=1e-4)
        stages = httpx.get(f"{second_url}/v1/status", headers=headers, timeout=30).json()["stages"]
        lived = [index for index in range(len(stages)) if index != with_stage]  # no new worker started for them
        assert sorted(adopted["rejoined"]) == sorted(stages[index]["name"] for index in lived)
        assert [stages[index]["pid"] for index in lived] == [pids[index] for index in lived]
        assert with_stage is None or stages[with_stage]["pid"] != pids[with_stage]
    finally:
        _stop(processes)
