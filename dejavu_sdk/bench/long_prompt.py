"""`dejavu bench long-prompt`: what a long prompt's prefill costs a short request sent while it runs.

One pipeline per layout (one stage, mixed two stages, disaggregated 1 prompt + 1 token stage), each with the
serving defaults otherwise: continuous batching (or `batching="static"`), `max_prefill_tokens` 256, no
recovery, the machine's cores shared between its stages (unless `threads` gives each stage process its number of
torch threads). In each
repeat, every layout in turn runs, back to back: a short request alone (nothing else in the pipeline), then a
long prompt and, once a stage says it computes it (its heartbeat counts layers run since the prompt was sent,
or the prompt's first chunk came back), the same short request. Every request generates `new_tokens`
(end-of-sequence ignored).

Reported per layout: the long prompt's prefill (its time to first token), the short request's time to first
token beside it and alone, and the ratio beside / alone; each the median of the per-repeat figures, with the
least and most. Both batchings chunk the long prompt, so the short request should get a slot beside it and its
first token within a few chunks; a layout that prefills a prompt in one step makes it wait for the rest of that
step.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from tqdm import tqdm

from ..errors import ConfigError
from ..generation.batching import check_batching
from ..report import markdown_table
from ..serving.pipeline import Pipeline
from .common import Spread, machine_description

#: The layouts, by name: what `Pipeline` is given for each, and how the report describes it.
LAYOUTS: dict[str, dict[str, int]] = {
    "one-stage": {"stages": 1},
    "mixed": {"stages": 2},
    "disaggregated": {"prompt_stages": 1, "token_stages": 1},
}
DESCRIPTIONS = {"one-stage": "one stage", "mixed": "mixed, 2 stages", "disaggregated": "1 prompt + 1 token stage"}
#: Seconds any one wait of the bench (a pipeline's start, a request, the pipeline going idle) may take.
RUN_TIMEOUT = 600.0
#: Seconds between two looks at whether the long prompt is being computed, or the pipeline is idle.
POLL = 0.005


@attrs.frozen
class Trial:
    """One repeat on one layout, in seconds: the long prompt's time to first token (its prefill), the short
    request's time to first token beside it and alone, and how long after the long prompt it was sent."""

    prefill: float
    beside: float
    alone: float
    sent_after: float

    @property
    def ratio(self) -> float:
        return self.beside / self.alone


@attrs.frozen
class LongPromptReport:
    machine: str
    model: str
    prompt_tokens: int
    short_tokens: int
    new_tokens: int
    max_prefill_tokens: int | None
    microbatch: int
    batching: str
    threads: dict[str, int]  # layout -> torch threads per stage process
    trials: dict[str, list[Trial]]  # layout -> one per repeat

    def spread(self, layout: str, figure: str) -> Spread:
        """The median, least and most over the repeats of one figure (a `Trial` field, or `ratio`)."""
        return Spread.of([getattr(trial, figure) for trial in self.trials[layout]])

    def to_markdown(self) -> str:
        rows = [[f"{layout} ({DESCRIPTIONS[layout]}, {_count(self.threads[layout], 'thread')} each)",
                 f"{self.spread(layout, 'prefill').text()} s", f"{self.spread(layout, 'beside').text(3)} s",
                 f"{self.spread(layout, 'alone').text(3)} s",
                 f"{self.spread(layout, 'ratio').text(1)}x", f"{self.spread(layout, 'sent_after').text()} s"]
                for layout in self.trials]
        repeats = len(next(iter(self.trials.values())))
        budget = "none" if self.max_prefill_tokens is None else f"{self.max_prefill_tokens} positions a step"
        return "\n".join([
            f"Machine: {self.machine}. Model {self.model}: a prompt of {self.prompt_tokens} tokens and, once a stage "
            f"computes it, a request of {self.short_tokens} tokens; each generates {self.new_tokens} tokens "
            f"(end-of-sequence ignored). {self.batching.capitalize()} batching, slots of up to {self.microbatch} rows, "
            f"prefill budget "
            f"{budget}. Medians of {_count(repeats, 'repeat')} (least-most), every layout's runs back to back in "
            "each.", "",
            markdown_table(["layout", "long prompt's prefill (its TTFT)", "short request's TTFT beside it",
                            "short request's TTFT alone", "beside / alone", "short request sent after"], rows)])

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self, filter=lambda field, _: field.name != "trials"),
                "trials": {layout: [{**attrs.asdict(trial), "ratio": trial.ratio} for trial in trials]
                           for layout, trials in self.trials.items()}}


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def check_layouts(layouts: Sequence[str]) -> tuple[str, ...]:
    """The layouts asked for, in the order `LAYOUTS` has them, once each; ConfigError for an unknown one."""
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or not layouts:
        raise ConfigError(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}" if unknown else
                          f"name at least one layout of {', '.join(LAYOUTS)}")
    return tuple(layout for layout in LAYOUTS if layout in layouts)


def run_long_prompt_bench(model_name: str = "smollm2", *, layouts: Sequence[str] = tuple(LAYOUTS),
                          prompt_tokens: int = 8000, short_tokens: int = 16, new_tokens: int = 4, repeats: int = 3,
                          threads: int | None = None, batching: str = "continuous",
                          progress: bool = True) -> LongPromptReport:
    """Time a short request beside a long prompt's prefill and alone, on every layout, `repeats` times;
    `threads`: torch threads per stage process (None: the pipelines' default); `batching` the pipelines'."""
    layouts = check_layouts(layouts)
    batching = check_batching(batching)
    for option, value in (("prompt_tokens", prompt_tokens), ("short_tokens", short_tokens),
                          ("new_tokens", new_tokens), ("repeats", repeats), ("threads", threads)):
        if value is not None and value < 1:
            raise ConfigError(f"{option} must be positive, got {value}")
    pipes: dict[str, Pipeline] = {}
    try:
        first = pipes[layouts[0]] = _pipeline(model_name, layouts[0], threads, batching)
        longest = max(prompt_tokens, short_tokens) + new_tokens
        if first.context is not None and longest > first.context:  # said before the other layouts load the model
            raise ConfigError(f"a prompt of {max(prompt_tokens, short_tokens)} tokens and {new_tokens} new ones do "
                              f"not fit the model's context of {first.context} positions")
        for layout in layouts[1:]:
            pipes[layout] = _pipeline(model_name, layout, threads, batching)
        for pipe in pipes.values():
            pipe.start()
        trials: dict[str, list[Trial]] = {layout: [] for layout in layouts}
        with tqdm(total=repeats * len(layouts) * 2, desc="long-prompt", unit="run", disable=not progress) as bar:
            for layout, pipe in pipes.items():  # first calls pay for lazy set-up, not the figures
                bar.set_postfix_str(f"warming up {layout}")
                _first_token(pipe, _prompt(pipe.vocabulary, short_tokens, seed=99), new_tokens)
            for repeat in range(repeats):
                long, short = (_prompt(first.vocabulary, length, seed=2 * repeat + offset)
                               for offset, length in enumerate((prompt_tokens, short_tokens)))
                for layout, pipe in pipes.items():
                    step = f"repeat {repeat + 1}/{repeats}, {layout}"
                    bar.set_postfix_str(f"{layout}: short alone")
                    alone = _first_token(pipe, short, new_tokens)
                    _say(bar, progress, f"{step}: the short request alone, first token in {alone:.3f} s")
                    bar.update()
                    bar.set_postfix_str(f"{layout}: short beside the long prompt")
                    prefill, beside, sent_after = _beside(pipe, long, short, new_tokens)
                    _say(bar, progress, f"{step}: {prompt_tokens}-token prompt prefilled in {prefill:.2f} s; the "
                         f"short request sent {sent_after:.2f} s after it, first token in {beside:.3f} s")
                    bar.update()
                    trials[layout].append(Trial(prefill, beside, alone, sent_after))
    finally:
        for pipe in pipes.values():
            pipe.close()
    return LongPromptReport(machine_description(), model_name, prompt_tokens, short_tokens, new_tokens,
                            first.options.max_prefill_tokens, first.microbatch, batching,
                            {layout: pipe.options.threads for layout, pipe in pipes.items()}, trials)


def _pipeline(model_name: str, layout: str, threads: int | None, batching: str) -> Pipeline:
    """A pipeline of `layout` with `batching` and the serving defaults otherwise; every request runs to its
    `max_new_tokens`, and any one wait for a stage may take as long as the bench's."""
    return Pipeline(model_name, **LAYOUTS[layout], batching=batching, ignore_eos=True, timeout=RUN_TIMEOUT,
                    threads=threads)


def _prompt(vocabulary: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, vocabulary, (length,), generator=torch.Generator().manual_seed(seed))


def _say(bar: tqdm, progress: bool, line: str) -> None:
    if progress:
        bar.write(line, file=sys.stderr)


def _first_token(pipe: Pipeline, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds to the first token of `prompt` served alone by an idle `pipe`."""
    _wait_until_idle(pipe)
    result = pipe.submit(prompt, new_tokens).result(timeout=RUN_TIMEOUT)
    return result.first_token - result.submitted


def _beside(pipe: Pipeline, long: torch.Tensor, short: torch.Tensor, new_tokens: int) -> tuple[float, float, float]:
    """The long prompt's time to first token, the short one's sent once a stage computes the long one, and how
    long after the long one it was sent."""
    _wait_until_idle(pipe)
    layers_before = _layers_run(pipe)
    long_future = pipe.submit(long, new_tokens)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (_layers_run(pipe) > layers_before or any(batch["steps"] for batch in pipe.status()["microbatches"])):
        if long_future.done():
            long_future.result()  # its failure, if it failed
            raise ConfigError("the long prompt was served before any stage said it computes it: give a longer "
                              "--prompt-tokens")
        if time.monotonic() > deadline:
            raise ConfigError(f"no stage said it computes the long prompt within {RUN_TIMEOUT:.0f} s")
        time.sleep(POLL)
    short_future = pipe.submit(short, new_tokens)
    long_result = long_future.result(timeout=RUN_TIMEOUT)
    short_result = short_future.result(timeout=RUN_TIMEOUT)
    if short_result.submitted >= long_result.first_token:
        raise ConfigError("the long prompt's prefill ended before the short request was sent: give a longer "
                          "--prompt-tokens")
    return (long_result.first_token - long_result.submitted, short_result.first_token - short_result.submitted,
            short_result.submitted - long_result.submitted)


def _layers_run(pipe: Pipeline) -> int:
    """The layers the pipeline's stages had run at their last heartbeats, all together."""
    return sum(dict(pipe.fleet.work).values())


def _wait_until_idle(pipe: Pipeline) -> None:
    """No request waiting and no microbatch (or slot) in flight: the next run has the pipeline to itself."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while not pipe.idle():
        failure = pipe.status()["failure"]
        if failure:
            raise ConfigError(f"the pipeline failed: {failure}")
        if time.monotonic() > deadline:
            raise ConfigError(f"the pipeline was not idle within {RUN_TIMEOUT:.0f} s")
        time.sleep(POLL)


def plot_long_prompt_bench(report: LongPromptReport, path: str) -> None:
    """Per layout: the long prompt's prefill and the short request's time to first token beside it and alone
    (log scale), and the ratio beside / alone; medians, bars from the least to the most repeat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(report.trials)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    figures = (("prefill", "long prompt's prefill"), ("beside", "short request's TTFT beside it"),
               ("alone", "short request's TTFT alone"))
    for number, (figure_name, label) in enumerate(figures):
        spreads = [report.spread(layout, figure_name) for layout in layouts]
        _bars(left, [index + (number - 1) * 0.27 for index in range(len(layouts))], spreads, 0.27, label)
    left.set_yscale("log")
    left.set_ylabel("seconds (log scale)")
    left.set_xticks(range(len(layouts)), layouts)
    left.legend(fontsize=8)
    ratios = [report.spread(layout, "ratio") for layout in layouts]
    _bars(right, list(range(len(layouts))), ratios, 0.5, "beside / alone")
    for index, spread in enumerate(ratios):
        right.annotate(f"{spread.median:.1f}x", (index, spread.high), ha="center", va="bottom", fontsize=9)
    right.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    right.set_yscale("log")
    right.set_ylabel("short request's TTFT, beside / alone (log scale)")
    right.set_xticks(range(len(layouts)), layouts)
    figure.suptitle(f"dejavu bench long-prompt: {report.model}, a {report.prompt_tokens}-token prompt and a "
                    f"{report.short_tokens}-token request sent while it prefills", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _bars(axis: Any, positions: Sequence[float], spreads: Sequence[Spread], width: float, label: str) -> None:
    below = [spread.median - spread.low for spread in spreads]
    above = [spread.high - spread.median for spread in spreads]
    axis.bar(positions, [spread.median for spread in spreads], width=width, label=label, yerr=[below, above],
             capsize=3)
