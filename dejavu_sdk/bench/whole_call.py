"""(e) of `dejavu bench streaming`: what replication costs a user, measured on whole calls.

A user waits for a whole `engine.generate` call, prompt included, not for a decode step. Each model is
called through a `DejaVuEngine` (default settings) and through plain `model.generate`, in alternating pairs
after a warm-up of each: every pair runs both back to back, in turns first or second, so a drift in the
machine's speed favours neither. The figures are the median of the per-pair ratios, with their range, both
of wall time and of the process's CPU time (every thread: the model's, the streamer's, the kernel's work
for them): a streamer that hides behind the forward in wall time still shows in CPU time.

Two models: SmolLM2-135M (a prompt of `prompt_tokens`, when installed; else random weights of its shape),
and a Qwen2 of 6 layers, hidden 512, 8 heads with 2 KV heads, intermediate 1024 (random weights) with a
batch of 4 prompts half as long; each for the whole call (`new_tokens` new tokens) and the prompt alone
(one new token).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ..engine import DejaVuEngine
from ..report import markdown_table
from ..store import Store
from .common import median, smollm2_or_its_shape

#: The 6-layer Qwen2 of the comparison (a decode step of a few tens of ms on a small CPU).
QWEN2_SHAPE: dict[str, int] = {"num_hidden_layers": 6, "hidden_size": 512, "num_attention_heads": 8,
                               "num_key_value_heads": 2, "intermediate_size": 1024, "vocab_size": 32000}
QWEN2_BATCH = 4
PHASES = ("whole call", "prompt alone")


@attrs.frozen
class WholeCallReport:
    """Per (model, phase, store): seconds of each call, replicated and plain, wall and CPU, pair by pair."""

    machine: str
    models: dict[str, str]  # short name: what it is
    samples: dict[str, list[float]]  # "<model> | <phase> | <store> | on|off | wall|cpu": seconds per pair

    def ratios(self, model: str, phase: str, store: str, clock: str) -> list[float]:
        """Replicated over plain, pair by pair (each pair ran back to back)."""
        on, off = (self.samples[f"{model} | {phase} | {store} | {side} | {clock}"] for side in ("on", "off"))
        return [a / b for a, b in zip(on, off, strict=True)]

    def cases(self) -> list[tuple[str, str, str]]:
        return list(dict.fromkeys(tuple(key.split(" | ")[:3]) for key in self.samples))  # type: ignore[misc]

    def to_json(self) -> dict:
        return {"machine": self.machine, "models": self.models, "samples_seconds": self.samples}

    def to_markdown(self) -> str:
        rows = []
        for model, phase, store in self.cases():
            plain = median(self.samples[f"{model} | {phase} | {store} | off | wall"])
            cells = []
            for clock in ("wall", "cpu"):
                ratios = self.ratios(model, phase, store, clock)
                cells += [f"{median(ratios):.3f}", f"{min(ratios):.3f}-{max(ratios):.3f}"]
            rows.append([model, phase, store, f"{plain * 1e3:.0f}", *cells])
        pairs = len(next(iter(self.samples.values()))) if self.samples else 0
        models = "; ".join(f"{name}: {what}" for name, what in self.models.items())
        table = markdown_table(["model", "call", "replica", "plain call ms", "wall ratio", "range",
                                "CPU ratio", "range"], rows)
        return (f"(e) Whole calls, `engine.generate` (default settings) over `model.generate`, {pairs} alternating "
                f"pairs each, median of the per-pair ratios (CPU: the whole process's). {models}\n\n{table}\n")


def whole_call_models(random_model: bool, prompt_tokens: int) -> dict[str, tuple[Any, torch.Tensor, str]]:
    """Each model of the comparison, with its prompts and a description."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    generator = torch.Generator().manual_seed(0)
    smol, smol_name = smollm2_or_its_shape(random_model)
    smol_ids = torch.randint(0, smol.config.vocab_size, (1, prompt_tokens), generator=generator)
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(**QWEN2_SHAPE, max_position_embeddings=4096)).eval()
    qwen_ids = torch.randint(0, QWEN2_SHAPE["vocab_size"], (QWEN2_BATCH, max(2, prompt_tokens // 2)),
                             generator=generator)
    return {"smollm2": (smol, smol_ids, f"{smol_name}, 1 x {prompt_tokens} tokens"),
            "qwen2-6l": (qwen, qwen_ids, f"a Qwen2 of 6 layers, hidden 512, 8 heads (2 KV), intermediate 1024, "
                                         f"random weights, {QWEN2_BATCH} x {qwen_ids.shape[1]} tokens")}


def run_whole_calls(models: dict[str, tuple[Any, torch.Tensor, str]], stores: dict[str, Store], new_tokens: int,
                    pairs: int, machine: str, tick: Callable[[], None] = lambda: None) -> WholeCallReport:
    """`pairs` alternating pairs of every (model, phase, store), after a warm-up of each."""
    samples: dict[str, list[float]] = defaultdict(list)
    for model_name, (model, ids, _) in models.items():
        for phase, count in zip(PHASES, (new_tokens, 1), strict=True):
            settings: dict[str, Any] = {"max_new_tokens": count, "min_new_tokens": count, "do_sample": False}
            plain = _call(functools.partial(model.generate, ids, **settings))
            for store_name, store in stores.items():
                engine = DejaVuEngine(model, store=store)
                replicated = _call(functools.partial(engine.generate, ids, **settings))
                replicated()  # warm-up: first calls pay for lazy initialisation
                plain()
                for pair in range(pairs):
                    order = [("on", replicated), ("off", plain)]
                    for side, call in order[pair % 2:] + order[:pair % 2]:
                        wall, cpu = call()
                        samples[f"{model_name} | {phase} | {store_name} | {side} | wall"].append(wall)
                        samples[f"{model_name} | {phase} | {store_name} | {side} | cpu"].append(cpu)
                        tick()
    return WholeCallReport(machine, {name: what for name, (_, _, what) in models.items()}, dict(samples))


def _call(action: Callable[[], object]) -> Callable[[], tuple[float, float]]:
    """`action` timed: (wall seconds, process CPU seconds) of one call."""

    def timed() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        action()
        return time.perf_counter() - wall, time.process_time() - cpu

    return timed


def whole_call_runs(pairs: int, stores: int, models: int = 2) -> int:
    """How many timed calls `run_whole_calls` makes (for a progress bar)."""
    return models * len(PHASES) * stores * pairs * 2


#: What the whole-call ratios should stay under, by (model, call): the targets set for LMDB with sync.
TARGETS: dict[tuple[str, str], float] = {("smollm2", "whole call"): 1.02, ("qwen2-6l", "whole call"): 1.05,
                                         ("smollm2", "prompt alone"): 1.03, ("qwen2-6l", "prompt alone"): 1.03}


def plot_whole_calls(report: WholeCallReport, path: str) -> None:
    """Every pair's wall and CPU ratio per (model, call, replica), the medians, and the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report.cases()
    figure, axis = plt.subplots(figsize=(max(8, 0.9 * len(cases)), 4.5))
    for index, (model, phase, store) in enumerate(cases):
        for offset, clock, color in ((-0.15, "wall", "tab:blue"), (0.15, "cpu", "tab:orange")):
            ratios = report.ratios(model, phase, store, clock)
            axis.scatter([index + offset] * len(ratios), ratios, s=12, color=color, alpha=0.5,
                         label=f"{clock}, each pair" if index == 0 else None)
            axis.hlines(median(ratios), index + offset - 0.12, index + offset + 0.12, color=color, linewidth=2.5,
                        label=f"{clock}, median" if index == 0 else "_")
        target = TARGETS.get((model, phase))
        if target is not None:
            axis.hlines(target, index - 0.4, index + 0.4, color="black", linestyle=":",
                        label="target" if index == 0 else "_")
    axis.axhline(1.0, color="grey", linewidth=0.5)
    axis.set_xticks(range(len(cases)), [f"{model}\n{phase}\n{store}" for model, phase, store in cases], fontsize=7)
    axis.set(ylabel="engine.generate / model.generate", title=f"Whole calls, replicated over plain "
             f"({report.machine.split(',')[0]})")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
