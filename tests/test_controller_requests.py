"""Through `dejavu serve`, a request is the unit: one client's poison fails only its own request (a 500), the
requests beside it in its microbatch complete exactly, and a client that leaves cancels its request."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import attrs
import expectations
import openai
import pytest
import tiny_models

from dejavu_sdk.generation.decoding import TokenRules

pytestmark = pytest.mark.slow

MODEL = "tiny_models:llama_poisoned"


@attrs.frozen
class _Served:
    url: str
    token: str


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    """`dejavu serve`: one mixed stage, static microbatches of three (a request waits while one runs), every
    request generating its max_tokens."""
    token_file = tmp_path_factory.mktemp("serve") / "tokens"
    token_file.write_text("client-secret\n")
    tests = os.path.dirname(__file__)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", MODEL, "--microbatch", "3",
                                "--batching", "static", "--listen", "127.0.0.1:0", "--token-file", str(token_file),
                                "--ignore-eos"],
                               stdout=subprocess.PIPE, text=True, env=environment)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line
        yield _Served(match.group(1), "client-secret")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _client(controller) -> openai.OpenAI:
    return openai.OpenAI(base_url=controller.url + "/v1", api_key=controller.token, max_retries=0, timeout=120)


def _get(controller, path: str) -> str:
    request = urllib.request.Request(controller.url + path, headers={"Authorization": f"Bearer {controller.token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


def _status(controller) -> dict:
    return json.loads(_get(controller, "/v1/status"))


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.01)


def _cancelled(controller) -> float:
    line = next((line for line in _get(controller, "/metrics").splitlines()
                 if line.startswith('dejavu_requests_total{outcome="cancelled"}')), None)
    return 0.0 if line is None else float(line.split()[-1])


def test_a_poison_request_fails_alone_and_its_microbatch_neighbours_complete_exactly(controller) -> None:
    prompts = [prompt.clamp(max=90) for prompt in expectations.prompts(4, seed=51)]
    prompts = [prompt[:3] for prompt in prompts]  # one length: no row's padding depends on the others
    prompts[0][1] = tiny_models.POISON
    client = _client(controller)
    outcomes: dict[int, object] = {}

    def send(index: int, **options) -> None:
        try:
            outcomes[index] = client.completions.create(model=MODEL, prompt=[prompts[index].tolist()],
                                                        **{"max_tokens": 10, **options}).choices[0].token_ids
        except openai.APIError as error:
            outcomes[index] = error

    blocker = threading.Thread(target=send, args=(3,), kwargs={"max_tokens": 600, "temperature": 0})
    blocker.start()
    _wait(lambda: len(_status(controller)["microbatches"]) == 1, 30, "the blocker in flight")
    senders = []
    for index, options in enumerate([{"temperature": 0}, {"temperature": 0}, {"temperature": 1e-39, "seed": 3}]):
        senders.append(threading.Thread(target=send, args=(index,), kwargs=options))
        senders[-1].start()
        _wait(lambda count=index + 1: _status(controller)["waiting"] == count, 30, f"{index + 1} requests waiting")
    for thread in [*senders, blocker]:
        thread.join(timeout=120)
    assert isinstance(outcomes[0], openai.InternalServerError), outcomes[0]
    assert "not finite" in str(outcomes[0])
    model = tiny_models.llama_poisoned()
    rules = TokenRules.of(model)
    want = expectations.expected(model, [[0, 1, 2]], prompts, [10, 10, 10], rules.pad, rules.eos)
    assert outcomes[1] == want[1].tolist()
    assert outcomes[2] == want[2].tolist()  # temperature 1e-39 is greedy, not an overflow
    assert _status(controller)["recoveries"] == []


def test_a_client_that_leaves_cancels_its_request_streamed_or_not(controller) -> None:
    prompt = expectations.prompts(1, seed=52)[0].clamp(max=90).tolist()
    before = _cancelled(controller)
    stream = _client(controller).completions.create(model=MODEL, prompt=[prompt], max_tokens=2000, temperature=0,
                                                    stream=True)
    chunks = [chunk for _, chunk in zip(range(3), stream, strict=False)]
    assert len(chunks) == 3
    stream.close()  # the client leaves after 3 tokens
    _wait(lambda: _status(controller)["microbatches"] == [], 5, "the abandoned stream to stop")
    _wait(lambda: _cancelled(controller) == before + 1, 5, "the stream counted as cancelled")

    host, port = controller.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": [prompt], "max_tokens": 2000, "temperature": 0}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Authorization: Bearer {controller.token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body)
        _wait(lambda: _status(controller)["microbatches"] != [], 10, "the request to start")
    _wait(lambda: _status(controller)["microbatches"] == [], 5, "the abandoned request to stop")
    _wait(lambda: _cancelled(controller) == before + 2, 5, "the request counted as cancelled")


def test_sigterm_drains_health_turns_503_new_requests_are_refused_and_the_stream_in_flight_finishes(tmp_path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("client-secret\n")
    tests = os.path.dirname(__file__)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", MODEL, "--listen",
                                "127.0.0.1:0", "--token-file", str(token_file), "--ignore-eos", "--drain-timeout",
                                "60"], stdout=subprocess.PIPE, text=True, env=environment)
    try:
        assert process.stdout is not None
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", process.stdout.readline())
        assert match
        served = _Served(match.group(1), "client-secret")
        workers = [stage["pid"] for stage in _status(served)["stages"]]
        stream = _client(served).completions.create(model=MODEL, prompt=[[5, 6, 7]], max_tokens=150, temperature=0,
                                                    stream=True)
        tokens = list(next(iter(stream)).choices[0].token_ids)
        process.send_signal(signal.SIGTERM)

        def health() -> tuple[int, dict]:
            try:
                with urllib.request.urlopen(served.url + "/health", timeout=5) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read())

        _wait(lambda: health()[0] == 503, 10, "/health to turn 503")
        assert health()[1]["status"] == "draining"
        with pytest.raises(openai.InternalServerError) as refused:  # a 503, with Retry-After
            _client(served).completions.create(model=MODEL, prompt=[[1, 2]], max_tokens=2)
        assert refused.value.status_code == 503
        for chunk in stream:
            tokens += chunk.choices[0].token_ids
        assert len(tokens) == 150  # the stream in flight ran to its end
        assert process.wait(timeout=60) == 0
        for pid in workers:  # no worker is left behind
            _wait(lambda pid=pid: not _alive(pid), 10, f"worker {pid} to exit")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_drain_that_times_out_says_so_and_nothing_else_goes_wrong_as_it_stops(tmp_path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("client-secret\n")
    tests = os.path.dirname(__file__)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", MODEL, "--listen",
                                "127.0.0.1:0", "--token-file", str(token_file), "--ignore-eos", "--journal",
                                f"file://{tmp_path}/journal", "--drain-timeout", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    try:
        assert process.stdout is not None
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", process.stdout.readline())
        assert match
        stream = _client(_Served(match.group(1), "client-secret")).completions.create(
            model=MODEL, prompt=[[5, 6, 7]], max_tokens=None, temperature=0, stream=True)  # up to the context
        assert next(iter(stream)).choices[0].token_ids
        stream.close()  # its client gone, the journaled request goes on: it runs past the drain timeout
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=60)
        assert process.returncode == 0
        assert "the drain timeout passed with requests in flight" in log
        assert "Traceback" not in log, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone, waiting for its parent to read its status
        return stat.read().split()[2] != "Z"
