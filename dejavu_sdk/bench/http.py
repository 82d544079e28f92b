"""`dejavu bench http`: `dejavu serve` beside `transformers serve --continuous-batching` on the same weights,
measured the way users measure a server: over HTTP, by clients that stream `/v1/completions`.

Each repeat starts both servers in turn (the order alternating between repeats, so that neither always runs on
a warmer or quieter machine), and drives each with the same loads (`Load`): `streams` clients at once, each
sending `rounds` requests one after another, and requests arriving at random (Poisson) at the mean rate of the
shipped Azure conversation trace (`rate`). The client is guidellm (`bench.guidellm_driver`: the load generator
users run; synthetic prompts of `prompt_tokens` tokens) or, with `client="builtin"`, this module's own streaming
clients (text prompts of about `prompt_tokens` tokens; concurrent loads only). Requests ask for `max_tokens` new
tokens, greedy, without `ignore_eos` (transformers serve refuses it). A load's figures are what the clients saw:
output tokens/s, time to first token and inter-token latency (p50, p99). The comparison is the median of the
per-repeat ratios (dejavu / transformers) with their spread. `busy=True` keeps a process spinning on one core
meanwhile (the server then shares the machine, as it often does).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..errors import ConfigError, DejaVuError
from ..traces import load_trace
from .guidellm_driver import guidellm_command, guidellm_load

#: The servers compared, in the order of the first repeat.
SERVERS = ("transformers", "dejavu")
#: The clients that drive them: guidellm, or this module's own.
CLIENTS = ("guidellm", "builtin")
#: Seconds a server may take to answer `/health` after it starts.
START_TIMEOUT = 300.0
#: Seconds one load may take.
LOAD_TIMEOUT = 900.0
#: Words a prompt is made of (about a token each).
WORDS = ("river", "mountain", "story", "engine", "garden", "letter", "market", "window", "silver", "planet")


@attrs.frozen
class LoadFigures:
    """What the clients of one load saw of one server."""

    tokens_per_second: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    tokens: int
    seconds: float


@attrs.frozen
class Load:
    """One load both servers are driven with: `streams` clients at once, each sending requests one after another,
    or (`rate` > 0) requests arriving at random, `rate` a second on average; `requests` in all."""

    streams: int
    rate: float
    requests: int

    @property
    def label(self) -> str:
        return f"Poisson {self.rate:.2f}/s" if self.rate else f"{self.streams} stream(s)"


@attrs.frozen
class HttpReport:
    """Every repeat's figures, by load (its label) and server, and how the run was made."""

    runs: list[dict[str, Any]]
    settings: dict[str, Any]

    def figures(self, load: str, server: str) -> list[LoadFigures]:
        return [LoadFigures(**run["figures"]) for run in self.runs if run["load"] == load and run["server"] == server]

    def ratios(self, load: str, field: str) -> list[float]:
        """dejavu's figure over transformers', a ratio per repeat."""
        ours, theirs = self.figures(load, "dejavu"), self.figures(load, "transformers")
        return [getattr(mine, field) / getattr(other, field) for mine, other in zip(ours, theirs, strict=True)
                if getattr(other, field) > 0]

    def to_json(self) -> dict[str, Any]:
        return {"runs": self.runs, "settings": self.settings}

    def to_markdown(self) -> str:
        lines = ["| load | dejavu tokens/s | transformers tokens/s | ratio (median, min-max) | TTFT p50 dejavu / "
                 "transformers | TTFT p99 | ITL p50 dejavu / transformers | ITL p99 |",
                 "|---|---|---|---|---|---|---|---|"]
        for load in self.settings["loads"]:
            ours, theirs = self.figures(load, "dejavu"), self.figures(load, "transformers")
            ratios = self.ratios(load, "tokens_per_second")
            if not ours or not theirs or not ratios:
                continue

            def median(figures: list[LoadFigures], field: str) -> float:
                return statistics.median(getattr(figure, field) for figure in figures)

            lines.append(f"| {load} | {median(ours, 'tokens_per_second'):.1f} | "
                         f"{median(theirs, 'tokens_per_second'):.1f} | {statistics.median(ratios):.2f}x "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) | {median(ours, 'ttft_p50'):.2f} s / "
                         f"{median(theirs, 'ttft_p50'):.2f} s | {median(ours, 'ttft_p99'):.2f} s / "
                         f"{median(theirs, 'ttft_p99'):.2f} s | {1000 * median(ours, 'itl_p50'):.0f} ms / "
                         f"{1000 * median(theirs, 'itl_p50'):.0f} ms | {1000 * median(ours, 'itl_p99'):.0f} ms / "
                         f"{1000 * median(theirs, 'itl_p99'):.0f} ms |")
        return "\n".join(lines)


def run_http_bench(model: str, streams: Sequence[int] = (1, 8, 32), repeats: int = 3, rounds: int = 2,
                   max_tokens: int = 64, prompt_tokens: int = 128, dejavu_args: Sequence[str] = (),
                   busy: bool = False, client: str = "guidellm", rate: float | None = None, rate_requests: int = 32,
                   progress: Callable[[str], None] | None = print) -> HttpReport:
    """Both servers on the model directory `model`, each load in turn, `repeats` times (see the module); `rate`:
    the Poisson load's requests a second (None: the shipped trace's mean rate; 0: no Poisson load), `rate_requests`
    its requests."""
    if not Path(model, "config.json").is_file():
        raise ConfigError(f"--model {model!r}: a Hugging Face model directory (with config.json and a tokenizer), "
                          "which both servers load; dejavu_sdk.load_smollm2() writes one")
    if repeats < 1 or rounds < 1 or max_tokens < 1 or prompt_tokens < 8 or rate_requests < 1 or \
            (streams and min(streams) < 1):
        raise ConfigError("repeats, rounds, max_tokens, rate_requests and every streams count must be positive, "
                          "and prompt_tokens at least 8")
    if client not in CLIENTS:
        raise ConfigError(f"client must be one of {', '.join(CLIENTS)}, got {client!r}")
    if rate is None:
        rate = trace_rate() if client == "guidellm" else 0.0
    if rate < 0 or (rate and client != "guidellm"):
        raise ConfigError(f"a Poisson load (rate {rate}) needs a positive rate and the guidellm client")
    loads = [Load(count, 0.0, count * rounds) for count in streams] + ([Load(0, rate, rate_requests)] if rate else [])
    if not loads:
        raise ConfigError("no load to run: give streams, or a Poisson rate")
    if client == "guidellm":
        guidellm_command()  # installed, before any server starts
    runs: list[dict[str, Any]] = []
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        for repeat in range(repeats):
            for server in SERVERS if repeat % 2 == 0 else SERVERS[::-1]:
                with _started(server, model, dejavu_args) as (url, token):
                    asyncio.run(_warm_up(url, model, token, max_tokens, prompt_tokens))
                    for load in loads:
                        figures = _drive(client, url, model, token, load, max_tokens, prompt_tokens)
                        runs.append({"repeat": repeat, "server": server, "load": load.label, **attrs.asdict(load),
                                     "figures": attrs.asdict(figures)})
                        if progress is not None:
                            progress(f"repeat {repeat + 1}/{repeats}, {server}, {load.label}: "
                                     f"{figures.tokens_per_second:.1f} tokens/s, TTFT p50 {figures.ttft_p50:.2f} s, "
                                     f"ITL p50 {1000 * figures.itl_p50:.0f} ms")
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    settings = {"model": model, "loads": [load.label for load in loads], "repeats": repeats, "rounds": rounds,
                "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "dejavu_args": list(dejavu_args),
                "busy": busy, "client": client, "cores": os.cpu_count()}
    return HttpReport(runs, settings)


def trace_rate() -> float:
    """The mean arrival rate (requests a second) of the shipped sample of the Azure conversation trace."""
    trace = load_trace()
    return (len(trace) - 1) / float(trace.arrivals[-1])


def _drive(client: str, url: str, model: str, token: str, load: Load, max_tokens: int,
           prompt_tokens: int) -> LoadFigures:
    if client == "guidellm":
        figures = guidellm_load(url, model, token, load.streams, load.rate, load.requests, prompt_tokens, max_tokens)
        return LoadFigures(figures["tokens_per_second"], figures["ttft_p50"], figures["ttft_p99"], figures["itl_p50"],
                           figures["itl_p99"], int(figures["tokens"]), figures["seconds"])
    return asyncio.run(_drive_builtin(url, model, token, load.streams, load.requests // load.streams, max_tokens,
                                      prompt_tokens))


@contextlib.contextmanager
def _started(server: str, model: str, dejavu_args: Sequence[str]) -> Any:
    """A server on a free loopback port, until the block ends: its URL and the token its clients present."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="dejavu-bench-http-") as folder:
        token = "bench-token"
        if server == "dejavu":
            Path(folder, "tokens").write_text(token + "\n")
            command = [sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", model, "--token-file",
                       str(Path(folder, "tokens")), "--listen", f"127.0.0.1:{port}", *dejavu_args]
        else:
            command = ["transformers", "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                       "--log-level", "warning", model]
        log = open(Path(folder, "log"), "w")  # noqa: SIM115 - closed below, after the process
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except FileNotFoundError as error:
            log.close()
            raise ConfigError(f"{command[0]} is not installed: pip install 'dejavu-sdk[bench]'") from error
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_healthy(url, process, Path(folder, "log"))
            yield url, token
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.close()


def _wait_until_healthy(url: str, process: subprocess.Popen[Any], log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DejaVuError(f"the server exited with status {process.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise DejaVuError(f"the server did not answer /health within {START_TIMEOUT:.0f} s: {log.read_text()[-2000:]}")


async def _warm_up(url: str, model: str, token: str, max_tokens: int, prompt_tokens: int) -> None:
    """One request alone, not counted: the server's first pays for its lazy set-up."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=LOAD_TIMEOUT,
                                 headers={"Authorization": f"Bearer {token}"}) as client:
        await _stream(client, model, 0, max_tokens, prompt_tokens)


async def _drive_builtin(url: str, model: str, token: str, streams: int, rounds: int, max_tokens: int,
                         prompt_tokens: int) -> LoadFigures:
    """`streams` clients at once, each streaming `rounds` requests one after another."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=LOAD_TIMEOUT,
                                 headers={"Authorization": f"Bearer {token}"}) as client:
        started = time.perf_counter()

        async def client_of(number: int) -> list[tuple[float, list[float]]]:
            return [await _stream(client, model, 1 + number * rounds + turn, max_tokens, prompt_tokens)
                    for turn in range(rounds)]

        done = await asyncio.wait_for(asyncio.gather(*(client_of(number) for number in range(streams))),
                                      LOAD_TIMEOUT)
        seconds = time.perf_counter() - started
    requests = [request for per_client in done for request in per_client]
    ttft = [request[0] for request in requests]
    itl = [later - earlier for _, times in requests for earlier, later in itertools.pairwise(times)]
    tokens = sum(len(times) for _, times in requests)
    return LoadFigures(tokens / seconds, _quantile(ttft, 0.5), _quantile(ttft, 0.99), _quantile(itl, 0.5),
                       _quantile(itl, 0.99), tokens, seconds)


async def _stream(client: Any, model: str, seed: int, max_tokens: int, prompt_tokens: int) -> tuple[float, list[float]]:
    """One streamed request of a text prompt of about `prompt_tokens` tokens (a word each): its time to first token,
    and when each token came (a chunk's `token_ids` where the server lists them, else a chunk with text counts
    one token)."""
    prompt = "Write a long story about " + " ".join(WORDS[(seed * 3 + index * 7) % len(WORDS)]
                                                    for index in range(prompt_tokens - 6))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    sent, times = time.perf_counter(), []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise DejaVuError(f"the server answered {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            for choice in json.loads(line[6:]).get("choices", []):  # its token ids where the server lists them
                times += [now] * (len(choice.get("token_ids") or ()) or int(bool(choice.get("text"))))
    if not times:
        raise DejaVuError("a request got no token")
    return times[0] - sent, times


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def plot_http_bench(report: HttpReport, path: str) -> None:
    """Tokens/s of both servers per load (each repeat a dot, the median a bar), and the ratio per load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = report.settings["loads"]
    figure, (speeds, ratios) = plt.subplots(1, 2, figsize=(11, 4))
    for offset, server in ((-0.2, "transformers"), (0.2, "dejavu")):
        for index, load in enumerate(loads):
            values = [figures.tokens_per_second for figures in report.figures(load, server)]
            if values:
                speeds.bar(index + offset, statistics.median(values), width=0.4,
                           label=server if index == 0 else None, color="C0" if server == "dejavu" else "C1")
                speeds.scatter([index + offset] * len(values), values, color="black", s=8, zorder=3)
    speeds.set(xticks=range(len(loads)), xticklabels=loads, ylabel="output tokens/s",
               title=f"{Path(report.settings['model']).name}, {report.settings['cores']} cores"
               + (", one core busy" if report.settings["busy"] else "") + f", {report.settings['client']} client")
    speeds.legend()
    for index, load in enumerate(loads):
        values = report.ratios(load, "tokens_per_second")
        if values:
            ratios.scatter([index] * len(values), values, color="C0")
            ratios.plot([index - 0.2, index + 0.2], [statistics.median(values)] * 2, color="C0")
    ratios.axhline(1.0, color="grey", linestyle="--")
    ratios.set(xticks=range(len(loads)), xticklabels=loads,
               ylabel="tokens/s: dejavu / transformers", title="ratio per repeat (line: median)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
