"""Chaos: `dejavu serve --journal` SIGKILLed at a random moment while 16 clients stream (greedy and seeded
sampling); a new one started on the same journal and address goes on with every request, and each client,
reconnecting with its `Last-Event-ID`, ends with exactly the tokens of a run without the failure: none missing,
none twice."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

MODEL = "tiny_models:llama_text"
TESTS = str(Path(__file__).parent)
TOKEN = "chaos-token"
CLIENTS, NEW = 16, 40
#: Seconds a client keeps reconnecting while the controller is replaced.
RECONNECT = 120.0


def _serve(port: int, journal: str, tmp_path: Path) -> subprocess.Popen:
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN + "\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", MODEL, "--listen",
                             f"127.0.0.1:{port}", "--token-file", str(token_file), "--journal", journal,
                             "--microbatch", "4"], stdout=subprocess.PIPE, text=True, env=environment)


def _serving(process: subprocess.Popen) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
    assert match, line
    return match.group(1)


def _body(client: int, stream: bool) -> dict:
    sampled = client % 2 == 1
    return {"model": MODEL, "prompt": [5 + client, 17, 33 + client], "max_tokens": NEW, "ignore_eos": True,
            "temperature": 1.0 if sampled else 0, **({"seed": 1000 + client} if sampled else {}), "stream": stream}


class StreamingClient(threading.Thread):
    """One client: streams its request, and on a broken connection reconnects with its last event id (or sends the
    request again if the server never heard of it) until its stream ends."""

    def __init__(self, url: str, client: int, progress: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.client, self.progress = url, client, progress
        self.tokens: list[int] = []
        self.request_id: str | None = None
        self.last: str | None = None
        self.finish: str | None = None
        self.reconnects = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + RECONNECT + 120
            while self.finish is None:
                assert time.monotonic() < deadline, f"client {self.client} did not finish"
                try:
                    self._attempt()
                except (httpx.HTTPError, OSError):
                    self.reconnects += 1
                    time.sleep(0.2)
        except BaseException as error:
            self.error = error

    def _attempt(self) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        if self.request_id is None:
            request = ("POST", f"{self.url}/v1/completions", {"json": _body(self.client, True)})
        else:
            request = ("GET", f"{self.url}/v1/requests/{self.request_id}/stream", {})
            if self.last is not None:
                headers["Last-Event-ID"] = self.last
        method, url, extra = request
        with httpx.stream(method, url, headers=headers, timeout=30, **extra) as response:
            if response.status_code == 404 and not self.tokens:  # admitted, but not journaled: send it again
                self.request_id = None
                return
            if response.status_code in (502, 503):
                raise httpx.HTTPError(f"{response.status_code}: not serving yet")
            assert response.status_code == 200, response.read()
            self.request_id = response.headers["X-Dejavu-Request-Id"]
            event_id = None
            for line in response.iter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for choice in chunk["choices"]:
                        self.tokens += choice["token_ids"]
                        self.progress[self.client] = len(self.tokens)
                        self.finish = choice["finish_reason"] or self.finish
                    self.last = event_id


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_every_stream_resumes_exactly_once_after_the_controller_is_killed(tmp_path) -> None:
    port, journal = _free_port(), f"file://{tmp_path}/journal"
    first = _serve(port, journal, tmp_path)
    processes = [first]
    try:
        url = _serving(first)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        expected = []  # the failure-free run
        for client in range(CLIENTS):
            answer = httpx.post(f"{url}/v1/completions", json=_body(client, False), headers=headers, timeout=120)
            expected.append(answer.json()["choices"][0]["token_ids"])
        progress = [0] * CLIENTS
        clients = [StreamingClient(url, client, progress) for client in range(CLIENTS)]
        for client in clients:
            client.start()
        kill_after = random.Random().randint(CLIENTS, CLIENTS * NEW // 2)  # tokens received by all, before the kill
        deadline = time.monotonic() + 120
        while sum(progress) < kill_after:
            assert time.monotonic() < deadline, f"the clients got {sum(progress)} tokens in 120 s"
            time.sleep(0.005)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        killed_at = sum(progress)
        second = _serve(port, journal, tmp_path)
        processes.append(second)
        second_url = _serving(second)
        for client in clients:
            client.join(timeout=RECONNECT + 150)
        for number, client in enumerate(clients):
            assert client.error is None, f"client {number}: {client.error!r}"
            assert client.tokens == expected[number], f"client {number} (reconnected {client.reconnects} times)"
            assert client.finish == "length"
        assert killed_at < CLIENTS * NEW, "the kill came after every token"
        assert sum(client.reconnects for client in clients) > 0
        adopted = httpx.get(f"{second_url}/v1/status", headers=headers, timeout=30).json()["adopted"]
        assert adopted["going_on"], "the successor took over no request"
        assert adopted["recomputed"], "no request had a token journaled"  # and the report says what it redid
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
