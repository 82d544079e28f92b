"""`dejavu bench recovery`: a microbatch's latency when a token stage dies mid-generation, recovered from the
replicas the token stages keep of each other against recomputed from the prompt, beside failure-free runs.

Two disaggregated pipelines run side by side, each with a warm standby (a spare worker with the model loaded):
one with `recovery="replicas"`, one with `recovery="recompute"` (which replicates nothing), both with static
microbatches (as the paper's, and as recomputation has them). Each repeat runs,
back to back: a failure-free microbatch on each, then one on each in which the last token stage is killed
(SIGKILL) at decode step `kill_step`. Every request generates exactly `new_tokens` (end-of-sequence ignored).

Reported: each variant's microbatch latency (first request submitted to last token), the ratio of each
failure run to its own failure-free run per repeat (median and range; the paper: +1.24x with replication,
+1.91x recomputing, OPT-66B, 4 stages, a failure at step 1200), the cost of replicating without a failure
(failure-free replicas / failure-free recompute), and the time from the kill to serving again (the first new
token) split into detection, replacement (pausing the survivors, taking the standby, relinking) and cache
transfer (replicas back, rewinds), and for recomputation the steps done again.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from typing import Any

import attrs
import torch
from tqdm import tqdm

from ..errors import ConfigError
from ..report import markdown_table
from ..serving.head.recovery import RecoveryReport
from ..serving.pipeline import Pipeline
from .common import machine_description

#: The paper's microbatch latency under one failure, relative to the failure-free run (OPT-66B, 4 stages).
PAPER = {"replicas": 1.24, "recompute": 1.91}
VARIANTS = ("replicas", "recompute")
#: Seconds a run may take before the bench gives up on it.
RUN_TIMEOUT = 600.0


@attrs.frozen
class KillTiming:
    """One failure: seconds from the kill to its detection, to every stage being ready again (replacement and
    cache transfer as the recovery reports them), and to the first new token."""

    detection: float
    replacing: float
    transferring: float
    serving_again: float
    resumed_at: int | None  # the round the microbatch went on with (None: it started over)


@attrs.frozen
class RecoveryBenchReport:
    machine: str
    model: str
    layout: str
    microbatch: int
    prompt_tokens: int
    new_tokens: int
    kill_step: int
    latency: dict[str, list[float]]  # "<variant> free" / "<variant> failure" -> seconds per repeat
    kills: dict[str, list[KillTiming]]  # variant -> per repeat

    def ratios(self, variant: str) -> list[float]:
        return [failed / free for failed, free in zip(self.latency[f"{variant} failure"],
                                                      self.latency[f"{variant} free"], strict=True)]

    def overheads(self) -> list[float]:
        return [rep / rec for rep, rec in zip(self.latency["replicas free"], self.latency["recompute free"],
                                              strict=True)]

    def to_markdown(self) -> str:
        rows = []
        for variant in VARIANTS:
            ratios, kills = self.ratios(variant), self.kills[variant]
            rows.append([variant, f"{statistics.median(self.latency[f'{variant} free']):.2f} s",
                         f"{statistics.median(self.latency[f'{variant} failure']):.2f} s",
                         f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                         f"{PAPER[variant]:.2f}x",
                         " / ".join(_median_ms(getattr(kill, part) for kill in kills)
                                    for part in ("detection", "replacing", "transferring")),
                         f"{_median_ms(kill.serving_again for kill in kills)}",
                         ", ".join("start" if kill.resumed_at is None else str(kill.resumed_at) for kill in kills)])
        overheads = self.overheads()
        repeats = len(self.latency["replicas free"])
        return "\n".join([
            f"Machine: {self.machine}. Model {self.model}, {self.layout}, one microbatch of {self.microbatch} "
            f"requests of {self.prompt_tokens} prompt and {self.new_tokens} new tokens; the last token stage "
            f"killed (SIGKILL) at step {self.kill_step}; a warm standby replaces it. Medians of {repeats} repeats, "
            "every variant back to back in each.", "",
            markdown_table(["recovery", "failure-free latency", "with a failure", "failure / failure-free (range)",
                            "paper", "kill -> detected / replaced / caches back", "kill -> next new token",
                            "went on at round"], rows), "",
            f"Replicating costs {statistics.median(overheads):.2f}x ({min(overheads):.2f}-{max(overheads):.2f}) "
            "the failure-free latency of the pipeline that does not replicate."])

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _median_ms(values: Any) -> str:
    return f"{statistics.median(list(values)) * 1e3:.0f} ms"


def run_recovery_bench(model_name: str = "smollm2", *, prompt_stages: int = 1, token_stages: int = 2,
                       microbatch: int = 4, prompt_tokens: int = 128, new_tokens: int = 128,
                       kill_step: int | None = None, repeats: int = 3, heartbeat: float = 0.5,
                       progress: bool = True) -> RecoveryBenchReport:
    kill_step = new_tokens // 2 if kill_step is None else kill_step
    if not 1 <= kill_step < new_tokens:
        raise ConfigError(f"--kill-step must lie between 1 and --new-tokens - 1 ({new_tokens - 1}), got {kill_step}")
    if token_stages < 2:
        raise ConfigError("--token-stages must be at least 2: each token stage keeps the next one's replicas")
    pipes = {variant: Pipeline(model_name, prompt_stages=prompt_stages, token_stages=token_stages,
                               microbatch=microbatch, recovery=variant, standby=1, ignore_eos=True, heartbeat=heartbeat,
                               batching="static")
             for variant in VARIANTS}
    latency: dict[str, list[float]] = {f"{variant} {run}": [] for variant in VARIANTS for run in ("free", "failure")}
    kills: dict[str, list[KillTiming]] = {variant: [] for variant in VARIANTS}
    prompts = _prompts(pipes["replicas"].vocabulary, microbatch, prompt_tokens)
    try:
        for pipe in pipes.values():
            pipe.start()
        bar = tqdm(total=repeats * 4, desc="recovery runs", disable=not progress)
        for _ in range(repeats):
            for variant, pipe in pipes.items():
                latency[f"{variant} free"].append(_run(pipe, prompts, new_tokens)[0])
                bar.update()
            for variant, pipe in pipes.items():
                seconds, kill = _run(pipe, prompts, new_tokens, kill_step)
                latency[f"{variant} failure"].append(seconds)
                assert kill is not None  # a run with a kill step reports its kill
                kills[variant].append(kill)
                bar.update()
        bar.close()
    finally:
        for pipe in pipes.values():
            pipe.close()
    layout = f"{prompt_stages} prompt + {token_stages} token stages"
    return RecoveryBenchReport(machine_description(), model_name, layout, microbatch, prompt_tokens, new_tokens,
                               kill_step, latency, kills)


def _prompts(vocabulary: int, rows: int, length: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocabulary, (length,), generator=generator) for _ in range(rows)]


def _run(pipe: Pipeline, prompts: list[torch.Tensor], new_tokens: int,
         kill_step: int | None = None) -> tuple[float, KillTiming | None]:
    """One microbatch's latency; with `kill_step`, the last token stage is killed when the microbatch reaches
    that step, and the failure's timing comes back too."""
    _wait_until_ready(pipe)
    arrivals: list[float] = []  # when each new token of the first request reached the head

    def arrived(index: int, _: int) -> None:
        if index == 0:
            arrivals.append(time.monotonic())

    recoveries = len(pipe.recoveries)
    futures = pipe.submit_all(prompts, new_tokens, on_token=arrived)
    killed_at = None
    if kill_step is not None:
        deadline = time.monotonic() + RUN_TIMEOUT
        while len(arrivals) < kill_step:
            if time.monotonic() > deadline:
                raise ConfigError(f"the microbatch did not reach step {kill_step} within {RUN_TIMEOUT:.0f} s")
            time.sleep(0.001)
        victim = pipe.status()["stages"][-1]
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
    results = [future.result(timeout=RUN_TIMEOUT) for future in futures]
    seconds = max(result.finished for result in results) - min(result.submitted for result in results)
    if killed_at is None:
        return seconds, None
    (report,) = pipe.recoveries[recoveries:]
    # Tokens that arrive between the kill and its detection were on their way before it: the pipeline serves
    # again with the first one after the detection.
    after = next(arrival for arrival in arrivals if arrival > report.detected)
    return seconds, _timing(report, killed_at, after)


def _timing(report: RecoveryReport, killed_at: float, after: float) -> KillTiming:
    resumed = next(iter(report.resumed.values()), None)
    return KillTiming(report.detected - killed_at, report.pausing + report.replacing, report.transferring,
                      after - killed_at, resumed)


def _wait_until_ready(pipe: Pipeline) -> None:
    """No microbatch in flight and the standby back in the pool (after a recovery, a new spare loads)."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while True:
        status = pipe.status()
        if status["failure"]:
            raise ConfigError(f"the pipeline failed: {status['failure']}")
        if not status["microbatches"] and status["standby"] and not status["recovering"]:
            return
        if time.monotonic() > deadline:
            raise ConfigError(f"the pipeline was not ready again within {RUN_TIMEOUT:.0f} s")
        time.sleep(0.05)


def plot_recovery_bench(report: RecoveryBenchReport, path: str) -> None:
    """Latency per variant, failure-free and with a failure, with the paper's ratios marked; and the time from
    the kill to the next new token, split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for offset, run in ((-0.2, "free"), (0.2, "failure")):
        values = [statistics.median(report.latency[f"{variant} {run}"]) for variant in VARIANTS]
        left.bar([index + offset for index in range(len(VARIANTS))], values, width=0.4,
                 label="failure-free" if run == "free" else "one failure")
    for index, variant in enumerate(VARIANTS):
        free = statistics.median(report.latency[f"{variant} free"])
        left.scatter([index + 0.2], [free * PAPER[variant]], marker="_", s=500, color="black",
                     label="paper's ratio" if index == 0 else None)
    left.set_xticks(range(len(VARIANTS)), VARIANTS)
    left.set_ylabel("microbatch latency, s")
    left.legend()
    parts: dict[str, list[float]] = {"detection": [], "replacement": [], "caches back": [],
                                     "until the next new token": []}
    for variant in VARIANTS:
        kills = report.kills[variant]
        detection = statistics.median(kill.detection for kill in kills)
        replacing = statistics.median(kill.replacing for kill in kills)
        transferring = statistics.median(kill.transferring for kill in kills)
        serving = statistics.median(kill.serving_again for kill in kills)
        for name, value in zip(parts, (detection, replacing, transferring,
                                       max(0.0, serving - detection - replacing - transferring)), strict=True):
            parts[name].append(value)
    bottom = [0.0] * len(VARIANTS)
    for name, values in parts.items():
        right.bar(VARIANTS, values, bottom=bottom, label=name)
        bottom = [base + value for base, value in zip(bottom, values, strict=True)]
    right.set_ylabel("seconds from the kill")
    right.legend()
    figure.suptitle(f"{report.model}, {report.layout}: a token stage killed at step {report.kill_step} of "
                    f"{report.new_tokens}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
