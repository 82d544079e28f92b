"""`dejavu bench swapping`: twice the batch in the same device memory, with microbatch swapping, against without.

The device budget holds the KV caches of `depth` microbatches of `microbatch` rows (as a pipeline of that
depth keeps in flight). The same requests are served two ways, back to back in every repeat, by
`RoundRobin` (one process, microbatches decoded in turn):

    off   microbatches of B rows, every cache on the device: `depth` of them fit the budget
    on    microbatches of 2B rows, swapped: two on the device at a time (2 x 2B rows fit the budget when
          `depth` >= 4), the others in host memory, each brought in while the previous one computes

Reported per prompt length: generated tokens/s of each, their ratio per repeat (median and spread), the
shares of the swapped run spent waiting for swap-ins and issuing copies, and the planner's view from
quantities measured here (a prefill and a decode step of B and of 2B rows, the host-to-device bandwidth):
the appendix condition (`planner.swapping_pays_off`), the decode ratio it implies, 2 t(B) / max(t(2B),
swap-in time), and the end-to-end ratio with the prefills. The gain comes from a decode step of 2B rows
costing little more than one of B rows, as on a GPU (and on a CPU whose decode steps are bound by reading
the weights). On a CPU the host is the device: the swapped run's caches all sit in the same memory, so the
budget there is an accounting limit, not memory saved.

Every request generates exactly `new_tokens` (the model's end-of-sequence token is dropped).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import attrs
import torch
from tqdm import tqdm

from ..errors import ConfigError
from ..generation.decoding import Decoding
from ..generation.roundrobin import RoundRobin
from ..models import load_model
from ..planner import swapping_pays_off
from ..report import format_size, markdown_table
from ..swapping import kv_bytes_per_token, measure_host_bandwidth, positions_needed
from ..timing import measure_times
from .common import machine_description

VARIANTS = ("off", "on")


@attrs.frozen
class Prediction:
    """What the planner sees for one prompt length, measured here: a prefill (Y) and a decode step (t) of B and
    of 2B rows, the host-to-device bandwidth and what it makes of a 2B-row cache of average length; whether
    the appendix condition holds."""

    prefill_b: float
    prefill_2b: float
    step_b: float
    step_2b: float
    host_bandwidth: float
    swap_in: float
    pays_off: bool
    new_tokens: int

    @property
    def decode_ratio(self) -> float:
        """Decode tokens/s with swapping (2B rows a step, waiting for copies that outlast a step) over without."""
        return 2 * self.step_b / max(self.step_2b, self.swap_in)

    @property
    def ratio(self) -> float:
        """The same, end to end: per B rows, a prefill and `new_tokens - 1` steps each way."""
        steps = self.new_tokens - 1
        off = self.prefill_b + steps * self.step_b
        on = (self.prefill_2b + steps * max(self.step_2b, self.swap_in)) / 2
        return off / on


@attrs.frozen
class SwappingReport:
    machine: str
    device: str
    model: str
    microbatch: int
    depth: int
    new_tokens: int
    prompt_lengths: tuple[int, ...]
    budget: dict[int, int]  # per prompt length: the device budget for KV, bytes
    tokens_per_second: dict[str, list[float]]  # "<prompt> <variant>" -> per repeat
    wait_share: dict[int, list[float]]  # per prompt length: share of the swapped run spent waiting for swap-ins
    copy_share: dict[int, list[float]]  # per prompt length: share of the swapped run spent issuing copies
    in_flight: dict[str, int]  # "<prompt> <variant>" -> the most microbatches in flight at once
    predictions: dict[int, Prediction]

    def ratios(self, prompt: int) -> list[float]:
        return [on / off for on, off in zip(self.tokens_per_second[f"{prompt} on"],
                                            self.tokens_per_second[f"{prompt} off"], strict=True)]

    def to_markdown(self) -> str:
        rows = []
        for prompt in self.prompt_lengths:
            ratios, prediction = self.ratios(prompt), self.predictions[prompt]
            rows.append([str(prompt), format_size(self.budget[prompt]),
                         f"{statistics.median(self.tokens_per_second[f'{prompt} off']):.1f} "
                         f"({self.in_flight[f'{prompt} off']} x {self.microbatch})",
                         f"{statistics.median(self.tokens_per_second[f'{prompt} on']):.1f} "
                         f"({self.in_flight[f'{prompt} on']} x {2 * self.microbatch})",
                         f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                         f"{100 * statistics.median(self.wait_share[prompt]):.1f}% / "
                         f"{100 * statistics.median(self.copy_share[prompt]):.1f}%",
                         f"{prediction.step_b * 1e3:.1f} / {prediction.step_2b * 1e3:.1f} ms",
                         f"{prediction.swap_in * 1e3:.2f} ms at {prediction.host_bandwidth / 1e9:.1f} GB/s",
                         f"{'yes' if prediction.pays_off else 'no'}, {prediction.decode_ratio:.2f}x",
                         f"{prediction.ratio:.2f}x"])
        repeats = len(next(iter(self.tokens_per_second.values())))
        return "\n".join([
            f"Machine: {self.machine}; device {self.device}. Model {self.model}; microbatches of B = "
            f"{self.microbatch} rows without swapping, 2B = {2 * self.microbatch} with, a device budget of "
            f"{self.depth} B-row caches; {self.new_tokens} new tokens per request; medians of {repeats} repeats, "
            "both variants back to back in each.", "",
            markdown_table(["prompt tokens", "KV budget", "off: tokens/s (in flight x rows)",
                            "on: tokens/s (in flight x rows)", "on / off (range)",
                            "on: waiting for swap-ins / issuing copies", "step B / 2B", "swap-in of a 2B cache",
                            "planner: pays off, decode ratio", "predicted on / off"], rows)])

    def to_json(self) -> dict[str, Any]:
        predictions = {prompt: {**attrs.asdict(p), "decode_ratio": p.decode_ratio, "ratio": p.ratio}
                       for prompt, p in self.predictions.items()}
        return {**attrs.asdict(self, recurse=False), "predictions": predictions}


def run_swapping_bench(model_name: str = "smollm2", *, device: str = "cpu", microbatch: int = 4, depth: int = 4,
                       prompt_lengths: tuple[int, ...] = (64, 256), new_tokens: int = 32, repeats: int = 3,
                       progress: bool = True) -> SwappingReport:
    if depth < 4:
        raise ConfigError("--depth must be at least 4: the budget of `depth` B-row caches must hold two 2B-row slots")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda needs a CUDA GPU; none is visible here")
    model = load_model(model_name).to(device)
    model.generation_config.eos_token_id = None  # every request runs to its length
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    dtype = next(model.parameters()).dtype
    per_token = kv_bytes_per_token(model.config, dtype)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples: dict[str, list[float]] = defaultdict(list)
    waits: dict[int, list[float]] = defaultdict(list)
    copies: dict[int, list[float]] = defaultdict(list)
    in_flight: dict[str, int] = {}
    budgets, predictions = {}, {}
    for prompt in prompt_lengths:
        prompts = [torch.randint(1, vocab, (prompt,), generator=generator) for _ in range(2 * depth * microbatch)]
        budgets[prompt] = depth * microbatch * positions_needed(prompt, new_tokens) * per_token
        predictions[prompt] = _predict(model, microbatch, prompt, new_tokens, per_token, progress)
        bar = tqdm(total=repeats * 2, desc=f"bench swapping, {prompt}-token prompts", unit="run",
                   disable=not progress)
        with bar:
            for _ in range(repeats):
                for variant in VARIANTS:
                    swapped = variant == "on"
                    runner = RoundRobin(model, microbatch=2 * microbatch if swapped else microbatch,
                                        kv_budget_bytes=budgets[prompt], swapping=swapped)
                    requests = runner.requests(prompts, new_tokens, Decoding())
                    _synchronize(device)
                    start = time.perf_counter()
                    results = runner.run(requests)
                    _synchronize(device)
                    elapsed = time.perf_counter() - start
                    samples[f"{prompt} {variant}"].append(sum(r.tokens.numel() for r in results) / elapsed)
                    in_flight[f"{prompt} {variant}"] = runner.most_in_flight
                    if swapped and runner.caches is not None:
                        waits[prompt].append(runner.caches.wait_seconds / elapsed)
                        copies[prompt].append(runner.caches.copy_seconds / elapsed)
                    bar.update()
    return SwappingReport(machine_description(), device, model_name, microbatch, depth, new_tokens,
                          tuple(prompt_lengths), budgets, dict(samples), dict(waits), dict(copies), in_flight,
                          predictions)


def _predict(model: Any, microbatch: int, prompt: int, new_tokens: int, per_token: int, progress: bool) -> Prediction:
    """The planner's inputs, measured: a prefill and a decode step of B and of 2B rows, the host bandwidth."""
    prefill_b, step_b = measure_times(model, microbatch, prompt, repeats=3, progress=progress)
    prefill_2b, step_2b = measure_times(model, 2 * microbatch, prompt, repeats=3, progress=progress)
    average_cache = 2 * microbatch * (prompt + new_tokens / 2) * per_token
    bandwidth = measure_host_bandwidth(next(model.parameters()).device, int(average_cache))
    pays = swapping_pays_off(new_tokens, prompt, step_2b, 2 * microbatch, per_token, bandwidth)
    return Prediction(prefill_b, prefill_2b, step_b, step_2b, bandwidth, average_cache / bandwidth, pays, new_tokens)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def plot_swapping_bench(report: SwappingReport, path: str) -> None:
    """Tokens/s off and on per prompt length, and the measured ratio beside the planner's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    positions = np.arange(len(report.prompt_lengths))
    for offset, variant, label in ((-0.2, "off", f"off: B = {report.microbatch} rows"),
                                   (0.2, "on", f"on: 2B = {2 * report.microbatch} rows, swapped")):
        values = [statistics.median(report.tokens_per_second[f"{p} {variant}"]) for p in report.prompt_lengths]
        left.bar(positions + offset, values, width=0.4, label=label)
    left.set_xticks(positions, [str(p) for p in report.prompt_lengths])
    left.set_xlabel("prompt tokens")
    left.set_ylabel("generated tokens/s")
    left.set_title("same device budget for KV")
    left.legend(fontsize=8)
    measured = [statistics.median(report.ratios(p)) for p in report.prompt_lengths]
    lows = [measured[i] - min(report.ratios(p)) for i, p in enumerate(report.prompt_lengths)]
    highs = [max(report.ratios(p)) - measured[i] for i, p in enumerate(report.prompt_lengths)]
    right.errorbar(report.prompt_lengths, measured, yerr=[lows, highs], fmt="o-", label="measured (range)")
    right.plot(report.prompt_lengths, [report.predictions[p].ratio for p in report.prompt_lengths], "s--",
               label="planner, from measured steps and bandwidth")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("prompt tokens")
    right.set_ylabel("tokens/s, on / off")
    right.legend(fontsize=8)
    figure.suptitle(f"dejavu bench swapping: {report.model} on {report.device}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
