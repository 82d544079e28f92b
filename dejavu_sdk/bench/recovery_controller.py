"""`dejavu bench recovery --kill controller`: what a client waits when the controller itself dies.

Each repeat starts `dejavu serve --journal` (LMDB on local disk, every request generating exactly `new_tokens`),
streams `rows` requests from clients of their own, and SIGKILLs the controller when the first client has
`kill_step` tokens. A new `dejavu serve` is started at once on the same journal and address (as a supervisor
would; its own detection of the death comes on top), and each client reconnects with its `Last-Event-ID` until
its stream goes on. Reported, from the kill to the first new token a reconnected client gets: detection (the
process gone), start (the new process until it reads its journal: interpreter, imports, model and tokenizer),
journal lease (watching the killed controller's lease on the journal lapse), journal read, rejoin (the stage
workers of the killed controller, which wait as orphans, take their stages back; a stage without one gets a new
worker, which loads the model), adoption (the requests queued again, and the
static microbatches the workers still hold taken over) and resume (from serving to that first token: the next
step of a microbatch taken over, else the prompts and the tokens the journal held, computed again).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import attrs
from tqdm import tqdm

from ..errors import ConfigError
from ..report import markdown_table
from .common import machine_description

#: Seconds a step of the bench (a start, a stream) may take before it gives up.
STEP_TIMEOUT = 300.0
TOKEN = "bench-recovery-controller"


@attrs.frozen
class ControllerKill:
    """One controller killed: seconds of each part from the kill to the first new token, the tokens the journal held
    that the successor went on from in its workers' caches (`taken_over`) and those it computed again."""

    detection: float
    start: float
    journal_lease: float
    journal_read: float
    rejoin: float
    adoption: float
    resume: float
    total: float
    taken_over: int
    recomputed: int
    rejoined: int  # stages whose worker rejoined (the others started a new one)


@attrs.define
class ControllerRecoveryReport:
    machine: str
    model: str
    stages: int
    rows: int
    prompt_tokens: int
    new_tokens: int
    kill_step: int
    kills: list[ControllerKill] = attrs.field(factory=list)

    def to_markdown(self) -> str:
        parts = ("detection", "start", "journal_lease", "journal_read", "rejoin", "adoption", "resume", "total")
        rows = [[part.replace("_", " "), f"{statistics.median(getattr(kill, part) for kill in self.kills):.2f}",
                 ", ".join(f"{getattr(kill, part):.2f}" for kill in self.kills)] for part in parts]
        taken_over = ", ".join(str(kill.taken_over) for kill in self.kills)
        recomputed = ", ".join(str(kill.recomputed) for kill in self.kills)
        rejoined = ", ".join(str(kill.rejoined) for kill in self.kills)
        return "\n".join([
            f"Machine: {self.machine}. `dejavu serve --model {self.model} --stages {self.stages} --journal "
            f"lmdb://...`, {self.rows} "
            f"streamed requests of {self.prompt_tokens} prompt tokens and {self.new_tokens} new ones; the "
            f"controller SIGKILLed when the first client had {self.kill_step} tokens, a new one started at once.", "",
            markdown_table(["from the kill to the first new token", "median (s)", "per repeat (s)"], rows), "",
            f"Tokens the journal held that went on from the workers' caches, per repeat: {taken_over}; computed "
            f"again from the prompts: {recomputed}. Stages whose worker rejoined, per repeat: {rejoined}.", ""])

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class _Server:
    """A `dejavu serve` process, and when it said it serves."""

    def __init__(self, model: str, stages: int, port: int, journal: str, token_file: str, rows: int) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", model, "--listen", f"127.0.0.1:{port}",
             "--token-file", token_file, "--journal", journal, "--microbatch", str(rows), "--ignore-eos",
             "--stages", str(stages)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.serving: float | None = None
        self._said = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if self.serving is None and re.search(r"serving .* at http", line):
                self.serving = time.monotonic()
                self._said.set()
        self._said.set()

    def wait_serving(self) -> float:
        if not self._said.wait(STEP_TIMEOUT) or self.serving is None:
            raise ConfigError(f"dejavu serve did not start within {STEP_TIMEOUT:.0f} s (exit {self.process.poll()})")
        return self.serving

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class _Client(threading.Thread):
    """Streams one request, and after a broken connection reconnects with its last event id; `resumed` is when
    the first token after a reconnection arrived."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.tokens = 0
        self.request_id: str | None = None
        self.last: str | None = None
        self.done = False
        self.broken = False
        self.resumed: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        import httpx

        deadline = time.monotonic() + STEP_TIMEOUT
        while not self.done and time.monotonic() < deadline:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            if self.request_id is None:
                request: dict[str, Any] = {"method": "POST", "url": f"{self.url}/v1/completions", "json": self.body}
            else:
                request = {"method": "GET", "url": f"{self.url}/v1/requests/{self.request_id}/stream"}
                headers.update({"Last-Event-ID": self.last} if self.last else {})
            try:
                with httpx.stream(**request, headers=headers, timeout=STEP_TIMEOUT) as response:
                    if response.status_code != 200:
                        raise httpx.HTTPError(f"{response.status_code}")
                    self.request_id = response.headers["X-Dejavu-Request-Id"]
                    self._read(response.iter_lines())
            except (httpx.HTTPError, OSError):
                self.broken = True
                time.sleep(0.02)
        if not self.done:
            self.error = ConfigError(f"a client's stream did not end within {STEP_TIMEOUT:.0f} s")

    def _read(self, lines: Any) -> None:
        event_id = None
        for line in lines:
            if line.startswith("id: "):
                event_id = line[4:]
            elif line == "data: [DONE]":
                self.done = True
            elif line.startswith("data: "):
                count = sum(len(choice["token_ids"]) for choice in json.loads(line[6:])["choices"])
                if count and self.broken and self.resumed is None:
                    self.resumed = time.monotonic()
                self.tokens += count
                self.last = event_id


def run_controller_recovery_bench(model: str = "smollm2", *, rows: int = 4, prompt_tokens: int = 128,
                                  new_tokens: int = 128, kill_step: int | None = None, repeats: int = 3,
                                  stages: int = 1, progress: bool = True) -> ControllerRecoveryReport:
    kill_step = new_tokens // 2 if kill_step is None else kill_step
    if not 1 <= kill_step < new_tokens:
        raise ConfigError(f"--kill-step must lie between 1 and --new-tokens - 1 ({new_tokens - 1}), got {kill_step}")
    report = ControllerRecoveryReport(machine_description(), model, stages, rows, prompt_tokens, new_tokens,
                                      kill_step)
    prompts = [[10 + (row * 7 + position) % 1000 for position in range(prompt_tokens)] for row in range(rows)]
    for _ in tqdm(range(repeats), desc="controller kills", disable=not progress):
        report.kills.append(_one_kill(model, stages, prompts, new_tokens, kill_step))
    return report


def _one_kill(model: str, stages: int, prompts: list[list[int]], new_tokens: int, kill_step: int) -> ControllerKill:
    """Serve `prompts` streamed, kill the controller when the first client has `kill_step` tokens, start
    another on its journal, and time the way back to a new token."""
    import httpx

    folder = tempfile.mkdtemp(prefix="dejavu-bench-controller-")
    servers: list[_Server] = []
    try:
        token_file = os.path.join(folder, "tokens")
        with open(token_file, "w") as file:
            file.write(TOKEN + "\n")
        port, journal = _free_port(), f"lmdb://{folder}/journal"
        servers.append(_Server(model, stages, port, journal, token_file, len(prompts)))
        servers[0].wait_serving()
        url = f"http://127.0.0.1:{port}"
        clients = [_Client(url, {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                                 "stream": True}) for prompt in prompts]
        for client in clients:
            client.start()
        deadline = time.monotonic() + STEP_TIMEOUT
        while clients[0].tokens < kill_step:
            if time.monotonic() > deadline:
                raise ConfigError(f"the first client did not get {kill_step} tokens in {STEP_TIMEOUT:.0f} s")
            time.sleep(0.001)
        killed = time.monotonic()
        os.kill(servers[0].process.pid, signal.SIGKILL)
        servers[0].process.wait()
        gone = time.monotonic()
        servers.append(_Server(model, stages, port, journal, token_file, len(prompts)))
        serving = servers[1].wait_serving()
        for client in clients:
            client.join(STEP_TIMEOUT)
        failed = [client.error for client in clients if client.error is not None]
        if failed:
            raise ConfigError(str(failed[0]))
        adopted = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"},
                            timeout=60).json()["adopted"]
        resumed = min(client.resumed for client in clients if client.resumed is not None)
        serving = min(serving, resumed)  # a client may get its token before its "serving" line is read here
        inside = adopted["lease_seconds"] + adopted["read_seconds"] + adopted["workers_seconds"] + \
            adopted["adopt_seconds"]
        return ControllerKill(detection=gone - killed, start=serving - servers[1].started - inside,
                              journal_lease=adopted["lease_seconds"], journal_read=adopted["read_seconds"],
                              rejoin=adopted["workers_seconds"],
                              adoption=adopted["adopt_seconds"], resume=resumed - serving, total=resumed - killed,
                              taken_over=sum(adopted["taken_over"].values()),
                              recomputed=sum(adopted["recomputed"].values()), rejoined=len(adopted["rejoined"]))
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
