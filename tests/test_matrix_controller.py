"""The option matrix's third kill: the controller. Each pairwise cell with recovery on (`test_matrix.pairwise`) is
served by `dejavu serve --journal` with the cell's options; six clients stream the cell's requests (greedy, seeded
sampling, log-probabilities, stop token ids, or n choices of one prompt), the controller is SIGKILLed while they
decode, a successor starts on the same journal and address, and every client, reconnecting with its
`Last-Event-ID`, ends with exactly the tokens of the failure-free run (and its log-probabilities, up to the float
noise of rows batched otherwise); once the successor stops, no stage worker is left running.

Behind `pytest -m matrix` (two `dejavu serve` starts a cell); the controller's own chaos tests run in the slow
tier (tests/test_controller_chaos.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import expectations
import httpx
import pytest
from resuming_clients import ResumingClient
from test_controller_chaos import RECONNECT, TOKEN, _free_port, _running, _serving, _stop
from test_matrix import FACTORS, LAYOUTS, _cell_id, _decodings, pairwise

TESTS = str(Path(__file__).parent)
NEW = 40  # tokens each request asks for: the kill comes while they decode
FLAGS = {"stages": "--stages", "prompt_stages": "--prompt-stages", "token_stages": "--token-stages"}


def _serve(cell: dict, port: int, journal: str, tmp_path: Path) -> subprocess.Popen:
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN + "\n")
    layout = [argument for name, count in LAYOUTS[cell["layout"]].items() for argument in (FLAGS[name], str(count))]
    recovery = "replicas" if cell["recovery"] == "replicas+store" else cell["recovery"]
    store = ["--replica-store", f"file://{tmp_path}/replicas"] if cell["recovery"] == "replicas+store" else []
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", f"tiny_models:{cell['family']}", "--listen",
         f"127.0.0.1:{port}", "--token-file", str(token_file), "--journal", journal, "--microbatch", "3",
         "--batching", cell["batching"], "--recovery", recovery, *store, "--swapping",
         "on" if cell["swapping"] else "off", "--max-prefill-tokens", "6", *layout],
        stdout=subprocess.PIPE, stderr=(tmp_path / "serve.log").open("a"), text=True, env=environment)


def _bodies(cell: dict) -> list[dict]:
    """The cell's requests as completions bodies: each decoding of `test_matrix._decodings` (the "n" cell's last
    three rows: one request of three sampled choices)."""
    prompts = [prompt.clamp(max=90).tolist() for prompt in expectations.prompts(6, seed=57)]
    decodings = _decodings(cell["decoding"])
    bodies = []
    for prompt, decoding in zip(prompts[:4] if cell["decoding"] == "n" else prompts, decodings, strict=False):
        body = {"model": f"tiny_models:{cell['family']}", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
        if decoding.get("do_sample"):
            body.update(temperature=1.0, seed=decoding["seed"], top_k=decoding["top_k"])
        body.update({name: decoding[name] for name in ("logprobs", "stop_token_ids") if name in decoding})
        bodies.append(body)
    if cell["decoding"] == "n":
        bodies[3].update(n=3, temperature=1.0, seed=200, top_k=20)
    return bodies


def _cells() -> list:
    """The pairwise cells with recovery, less the one the pipeline refuses (replicas with one decoding stage and
    no store: test_matrix checks the refusal)."""
    return [pytest.param(cell, id=_cell_id(cell)) for cell in pairwise(FACTORS) if cell["recovery"] is not None
            and not (cell["recovery"] == "replicas" and cell["layout"] == "one stage")]


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("cell", _cells())
def test_every_pair_of_options_goes_on_exactly_after_the_controller_is_killed(cell, tmp_path) -> None:
    port, journal = _free_port(), f"file://{tmp_path}/journal"
    first = _serve(cell, port, journal, tmp_path)
    processes = [first]
    pids: list[int] = []
    try:
        url = _serving(first)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        bodies = _bodies(cell)
        answers = [httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).json()["choices"]
                   for body in bodies]
        progress = [0] * len(bodies)
        clients = [ResumingClient(url, TOKEN, body, progress, number, RECONNECT + 120)
                   for number, body in enumerate(bodies)]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 120
        while max(progress) < 8:
            assert time.monotonic() < deadline, f"the clients got {progress} tokens in 120 s"
            time.sleep(0.002)
        first.kill()
        first.wait(timeout=30)
        second = _serve(cell, port, journal, tmp_path)
        processes.append(second)
        second_url = _serving(second)
        for client in clients:
            client.join(timeout=RECONNECT + 150)
        for number, (client, answer) in enumerate(zip(clients, answers, strict=True)):
            assert client.error is None, f"client {number}: {client.error!r}"
            assert client.choices == {choice["index"]: choice["token_ids"] for choice in answer}, f"client {number}"
            if "logprobs" in bodies[number]:  # (rows batched otherwise than in the failure-free run: float noise)
                want = answer[0]["logprobs"]["token_logprobs"]
                assert client.logprobs == pytest.approx(want, abs=1e-4), f"client {number}"
        status = httpx.get(f"{second_url}/v1/status", headers=headers, timeout=30).json()
        pids = [stage["pid"] for stage in status["stages"]]
        assert status["adopted"]["going_on"], "the successor took over no request"
    finally:
        _stop(processes)
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids):  # nothing left running once the successor stopped
        assert time.monotonic() < deadline, [pid for pid in pids if _running(pid)]
        time.sleep(0.1)

