"""The controller's OpenAI-compatible API, through the official `openai` client and raw HTTP: the tokens of
`model.generate`, streamed or not, sampling from a seed, and every bad request answered, never a crash."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import expectations
import httpx
import openai
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.decoding import TokenRules
from dejavu_sdk.serving.options import PipelineOptions

TESTS = str(Path(__file__).parent)
MODEL = "tiny_models:llama"


@pytest.fixture(scope="module")
def controller(module_workers_import_tiny_models):
    """One controller (two mixed stages, microbatches of two) for the tests that only send requests."""
    with dv.Controller(MODEL, stages=2, microbatch=2, port=0, timeout=60) as running:
        yield running


def _listening(controller) -> bool:
    try:
        return bool(controller.url)
    except dv.ConfigError:  # not started yet
        return False


def _client(controller, token: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=controller.url + "/v1", api_key=token or controller.token, max_retries=0,
                         timeout=120)


def _raw(controller, path: str, body: bytes | None = None, token: str | None = "valid",
         method: str | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {controller.token if token == 'valid' else token}"
    request = urllib.request.Request(controller.url + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _health(controller) -> str:
    """`/health`'s status code and state, as "200 serving"."""
    status, body = _raw(controller, "/health", token=None)
    return f"{status} {body['status']}"


def _two_prompts() -> list[list[int]]:
    return [ids.tolist() for ids in expectations.prompts(2, seed=41)]


@pytest.mark.slow
def test_completions_give_the_tokens_generate_gives_the_microbatch(controller) -> None:
    prompts = _two_prompts()
    answer = _client(controller).completions.create(model=MODEL, prompt=prompts, max_tokens=7, temperature=0)
    model = tiny_models.llama()
    rules = TokenRules.of(model)
    want = expectations.expected(model, [[0, 1]], [torch.tensor(p) for p in prompts], [7, 7], rules.pad, rules.eos)
    assert [choice.index for choice in answer.choices] == [0, 1]
    assert [choice.token_ids for choice in answer.choices] == [tokens.tolist() for tokens in want]
    assert all(choice.finish_reason == "length" for choice in answer.choices)
    assert all(choice.text == "" for choice in answer.choices)  # served without a tokenizer
    assert answer.usage.prompt_tokens == sum(map(len, prompts))
    assert answer.usage.completion_tokens == 14
    assert answer.model == MODEL
    assert answer.object == "text_completion"


@pytest.mark.slow
def test_streamed_tokens_add_up_to_the_answer_and_the_last_token_carries_the_finish_reason(controller) -> None:
    prompts = _two_prompts()
    client = _client(controller)
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    finished, last_chunk = {}, {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            assert choice.index not in finished  # nothing after a choice's end
            streamed[choice.index] += choice.token_ids
            if choice.finish_reason is not None:
                finished[choice.index], last_chunk[choice.index] = choice.finish_reason, choice.token_ids
    assert streamed == {choice.index: choice.token_ids for choice in whole.choices}
    assert finished == {0: "length", 1: "length"}
    assert {index: tokens[-1:] for index, tokens in last_chunk.items()} == {
        choice.index: choice.token_ids[-1:] for choice in whole.choices}


@pytest.mark.slow
def test_sampling_follows_the_seed_as_generate_does(controller) -> None:
    prompt = _two_prompts()[0]
    client = _client(controller)
    arguments = {"model": MODEL, "prompt": [prompt], "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    first, again = (client.completions.create(**arguments).choices[0].token_ids for _ in range(2))
    model = tiny_models.llama()  # built first: building it seeds torch
    torch.manual_seed(5)
    out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=0.8, top_p=0.9, top_k=0,
                         max_new_tokens=8)
    assert first == again == out[0, len(prompt):].tolist()
    other = client.completions.create(**{**arguments, "seed": 6}).choices[0].token_ids
    assert other != first


@pytest.mark.slow
def test_models_status_and_metrics(controller) -> None:
    assert [model.id for model in _client(controller).models.list().data] == [MODEL]
    status, body = _raw(controller, "/v1/status")
    assert status == 200
    assert body["model"] == MODEL
    assert body["layout"] == "mixed"
    assert [stage["layers"] for stage in body["stages"]] == [[0, 2], [2, 3]]
    assert all(stage["alive"] for stage in body["stages"])
    _client(controller).completions.create(model=MODEL, prompt=[[5, 6, 7]], max_tokens=3, temperature=0)
    status, text = _raw(controller, "/metrics")
    assert status == 200
    assert re.search(r'^dejavu_requests_total\{outcome="ok"\} [1-9]', text, re.MULTILINE)
    assert re.search(r"^dejavu_generated_tokens_total [1-9]", text, re.MULTILINE)
    assert "dejavu_time_to_first_token_seconds_bucket" in text


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_harms_nobody(controller) -> None:
    import http.client

    host, port = controller.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": MODEL, "prompt": [[7, 8, 9]], "max_tokens": 300, "temperature": 0, "stream": True})
    connection.request("POST", "/v1/completions", body=body, headers={
        "Authorization": f"Bearer {controller.token}", "Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"id: cmpl-")  # the first token's event: its id,
    assert response.readline().startswith(b"data: {")  # and its chunk
    connection.sock.close()  # gone, without reading the rest
    deadline = time.monotonic() + 60
    while True:  # its request finishes unheard and is counted: nothing stays in flight
        _, text = _raw(controller, "/metrics")
        if re.search(r"^dejavu_requests_in_flight 0\.0", text, re.MULTILINE):
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    answer = _client(controller).completions.create(model=MODEL, prompt=[[3, 4]], max_tokens=2, temperature=0)
    assert len(answer.choices[0].token_ids) == 2


@pytest.mark.slow
def test_a_wrong_or_missing_token_is_401(controller) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(controller, token="not-the-token").models.list()
    for path in ("/v1/models", "/v1/status", "/metrics"):
        assert _raw(controller, path, token=None)[0] == 401
    assert _raw(controller, "/v1/completions", b"{}", token="wrong")[0] == 401


@pytest.mark.slow
def test_bad_requests_get_a_reason_and_the_controller_keeps_serving(controller) -> None:
    huge = json.dumps({"model": MODEL, "prompt": [[1] * 2_000_000]}).encode()
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "gpt-17", "prompt": [1]}).encode(), 404, "not served here"),
        (json.dumps({"prompt": [1]}).encode(), 400, "'model' is required"),
        (json.dumps({"model": MODEL, "prompt": "some text"}).encode(), 400, "without a tokenizer"),
        (json.dumps({"model": MODEL, "prompt": []}).encode(), 400, "'prompt' must be"),
        (json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": [1, 2], "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL, "prompt": [1, 2], "best_of": 3}).encode(), 400, "not supported"),
        (json.dumps({"model": MODEL, "prompt": [1, 500]}).encode(), 400, "vocabulary"),
        (json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 100_000}).encode(), 400, "context"),
        (huge, 413, ""),
    ]
    for body, status, reason in cases:
        answered, error = _raw(controller, "/v1/completions", body)
        assert answered == status, (body[:60], error)
        assert isinstance(error, dict)
        assert reason in error["error"]["message"]
    assert _raw(controller, "/v1/nowhere")[0] == 404
    assert _raw(controller, "/v1/completions", method="GET")[0] == 405
    with pytest.raises(openai.NotFoundError):
        _client(controller).completions.create(model="gpt-17", prompt=[[1, 2]], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        _client(controller).completions.create(model=MODEL, prompt="text", max_tokens=2)
    answer = _client(controller).completions.create(model=MODEL, prompt=[[3, 4, 5]], max_tokens=2, temperature=0)
    assert len(answer.choices[0].token_ids) == 2
    status, text = _raw(controller, "/metrics")
    assert re.search(r'^dejavu_requests_total\{outcome="bad_request"\} [1-9]', text, re.MULTILINE)


@pytest.mark.slow
def test_a_killed_stage_fails_its_requests_with_503_and_counts_a_failure(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    with dv.Controller(MODEL, stages=2, microbatch=2, port=0, timeout=30, recovery=None) as controller:
        client = _client(controller)
        assert client.completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=2, temperature=0).choices
        os.kill(controller.status()["stages"][1]["pid"], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as failure:
            client.completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=400, temperature=0)
        assert time.monotonic() - started < 30
        assert failure.value.status_code == 503
        status, text = _raw(controller, "/metrics")
        assert status == 200
        assert re.search(r"^dejavu_stage_failures_total 1\.0", text, re.MULTILINE)
        assert _raw(controller, "/v1/status")[1]["failure"]


@pytest.mark.slow
def test_a_stage_killed_mid_stream_is_recovered_and_the_stream_goes_on_unchanged(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    prompt = [[5, 6, 7, 8]]
    with dv.Controller(MODEL, prompt_stages=1, token_stages=2, microbatch=2, port=0, heartbeat=0.5) as controller:
        client = _client(controller)
        assert controller.pipeline.recovery == "replicas"  # "auto" with two token stages
        calm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=600, temperature=0)
        streamed: list[int] = []
        health: list[str] = []
        watching = threading.Event()

        def watch_health() -> None:  # what /health says from the kill until the stream ends
            while watching.is_set():
                health.append(_health(controller))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch_health, daemon=True)
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=600, temperature=0,
                                               stream=True):
            streamed += chunk.choices[0].token_ids or []
            if len(streamed) == 40:
                watching.set()
                watcher.start()
                os.kill(next(stage["pid"] for stage in controller.status()["stages"]
                             if stage["name"] == "token stage 1"), signal.SIGKILL)
        watching.clear()
        watcher.join(timeout=10)
        assert streamed == calm.choices[0].token_ids  # nothing lost, nothing twice
        assert "503 recovering" in health  # while the stage was replaced
        assert health[-1] == "200 serving"
        _status, text = _raw(controller, "/metrics")
        assert re.search(r"^dejavu_stage_failures_total 1\.0", text, re.MULTILINE)
        assert re.search(r"^dejavu_recoveries_total 1\.0", text, re.MULTILINE)
        assert re.search(r"^dejavu_recovery_seconds_count 1\.0", text, re.MULTILINE)
        (report,) = _raw(controller, "/v1/status")[1]["recoveries"]
        assert report["replaced"] == ["token stage 1"]
        assert report["resumed"]  # its slot went on from the replicas (continuous batching: the default)
        assert not report["recomputed"]


@pytest.mark.slow
def test_workers_started_elsewhere_ask_the_controller_where_to_join(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("DEJAVU_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("worker-secret\n")
    command = [sys.executable, "-m", "dejavu_sdk.cli", "worker", "--token-file", str(token_file), "--controller"]
    with pytest.raises(dv.ConfigError, match="differ"):
        dv.Controller(MODEL, token="cluster-secret", worker_token="cluster-secret", launch=False)
    controller = dv.Controller(MODEL, stages=2, microbatch=2, port=0, token="cluster-secret",
                               worker_token="worker-secret", launch=False)
    workers: list[subprocess.Popen] = []
    try:
        starting = threading.Thread(target=controller.start)
        starting.start()  # returns once both workers joined and loaded their stages
        deadline = time.monotonic() + 60
        while not _listening(controller):
            assert time.monotonic() < deadline, "the controller never listened"
            time.sleep(0.05)
        assert _raw(controller, "/v1/workers", token="cluster-secret")[0] == 401  # a client's token opens no link
        assert _raw(controller, "/v1/models", token="worker-secret")[0] == 401  # nor a worker's a client route
        wrong = tmp_path / "wrong"
        wrong.write_text("cluster-secret\n")
        refused = subprocess.run([*command[:-3], "--token-file", str(wrong), "--controller", controller.url],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0
        assert "refused the token" in refused.stderr
        workers = [subprocess.Popen([*command, controller.url]) for _ in range(2)]
        starting.join(timeout=120)
        assert not starting.is_alive()
        answer = _client(controller, "cluster-secret").completions.create(model=MODEL, prompt=[[3, 4, 5]],
                                                                         max_tokens=4, temperature=0)
        assert len(answer.choices[0].token_ids) == 4
        assert sorted(stage["name"] for stage in controller.status()["stages"]) == ["stage 0", "stage 1"]
    finally:
        controller.close()
        for worker in workers:
            worker.wait(timeout=30)


@pytest.mark.slow
def test_dejavu_controller_waits_for_dejavu_worker_controller_and_then_serves(tmp_path) -> None:
    token_file, worker_token_file = tmp_path / "tokens", tmp_path / "worker-token"
    token_file.write_text("cluster-secret\n")
    worker_token_file.write_text("worker-secret\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    environment.pop("DEJAVU_TOKEN", None)
    cli = [sys.executable, "-m", "dejavu_sdk.cli"]
    controller = subprocess.Popen([*cli, "controller", "--model", MODEL, "--stages", "2", "--listen", "127.0.0.1:0",
                                   "--token-file", str(token_file), "--worker-token-file", str(worker_token_file)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    workers: list[subprocess.Popen] = []
    try:
        assert controller.stderr is not None
        assert controller.stdout is not None
        for line in controller.stderr:  # it says where workers join before it waits for them
            if match := re.search(r"dejavu worker --controller (http://127\.0\.0\.1:\d+)", line):
                break
        else:
            raise AssertionError("the controller never said where workers join")
        url = match.group(1)
        threading.Thread(target=controller.stderr.read, daemon=True).start()  # its log goes on; keep the pipe open
        workers = [subprocess.Popen([*cli, "worker", "--controller", url, "--token", "worker-secret"],
                                    env=environment) for _ in range(2)]
        assert f"at {url}/v1" in controller.stdout.readline()  # serving once both joined
        client = openai.OpenAI(base_url=url + "/v1", api_key="cluster-secret", max_retries=0, timeout=120)
        answer = client.completions.create(model=MODEL, prompt=[[3, 4, 5]], max_tokens=3, temperature=0)
        assert len(answer.choices[0].token_ids) == 3
        controller.send_signal(signal.SIGTERM)
        assert controller.wait(timeout=60) == 0
        assert [worker.wait(timeout=60) for worker in workers] == [0, 0]  # told to shut down, and gone
    finally:
        for process in [controller, *workers]:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.slow
def test_dejavu_serve_answers_with_a_token_from_its_file_and_stops_on_sigterm(tmp_path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("client-secret\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    environment.pop("DEJAVU_TOKEN", None)
    process = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", MODEL, "--listen",
                                "127.0.0.1:0", "--token-file", str(token_file)], stdout=subprocess.PIPE, text=True,
                               env=environment)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line
        client = openai.OpenAI(base_url=match.group(1) + "/v1", api_key="client-secret", max_retries=0, timeout=60)
        assert [model.id for model in client.models.list().data] == [MODEL]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=match.group(1) + "/v1", api_key="guess", max_retries=0).models.list()
        chosen = process.stdout.readline()  # what the defaults chose, and why
        status = httpx.get(match.group(1) + "/v1/status", headers={"Authorization": "Bearer client-secret"},
                           timeout=30).json()
        expected = PipelineOptions.check(MODEL).defaults  # chosen for this machine as the test runs on it
        rows = expected.rows
        assert (status["defaults"]["microbatch"], status["defaults"]["threads"]) == (rows, expected.threads)
        assert (status["batching"], status["recovery"]) == ("continuous", "recompute")  # recovery stays on
        assert chosen.startswith("mixed layout of 1 stage(s), continuous batching, recovery recompute; ")
        assert f"{rows} rows per slot" in chosen
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_drains_and_stops_without_a_recovery(tmp_path) -> None:
    """As a terminal's Ctrl-C or a service manager's stop delivers it: the head, the zygote and every stage
    worker get the signal at once. The head drains (the request in flight gets all its tokens), the workers
    exit when told, and nothing is recovered."""
    token_file = tmp_path / "tokens"
    token_file.write_text("client-secret\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    environment.pop("DEJAVU_TOKEN", None)
    log = tmp_path / "serve.log"
    with log.open("w") as errors:
        process = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", MODEL, "--stages",
                                    "2", "--listen", "127.0.0.1:0", "--token-file", str(token_file)],
                                   stdout=subprocess.PIPE, stderr=errors, text=True, env=environment,
                                   start_new_session=True)  # a process group of its own, as a service's
    try:
        assert process.stdout is not None
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", process.stdout.readline())
        assert match
        client = openai.OpenAI(base_url=match.group(1) + "/v1", api_key="client-secret", max_retries=0, timeout=60)
        stream = client.completions.create(model=MODEL, prompt=[[3, 4, 5]], max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        received = [len(next(stream).choices[0].token_ids)]
        os.killpg(process.pid, signal.SIGTERM)
        received += [len(chunk.choices[0].token_ids) for chunk in stream if chunk.choices]
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert sum(received) == 200
    text = log.read_text()
    assert "draining" in text
    assert "recover" not in text, text[-2000:]


def test_bad_controller_settings_are_refused_before_any_process_starts() -> None:
    with pytest.raises(dv.ConfigError, match="max_body_bytes"):
        dv.Controller(MODEL, max_body_bytes=10)
    with pytest.raises(dv.ConfigError, match="unknown model"):
        dv.Controller("no-such-model")
