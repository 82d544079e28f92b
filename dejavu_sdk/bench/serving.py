"""`dejavu bench serving`: one model served several ways, side by side, on requests from a real trace.

Requests take their prompt and output lengths, and their arrival gaps, from the shipped sample of the Azure
LLM inference trace 2023 (conversation; CC-BY-4.0, see `dejavu_sdk/data/README.md`), scaled to this CPU:
lengths are scaled so that their medians hit a workload's targets and clipped to [2/3, 3/2] of them, and
gaps are scaled so that requests arrive at a given rate. Each workload is served, at each rate, by some of:

    static                    Hugging Face `model.generate` on batches of up to `rows` waiting requests, one
                              process
    continuous                Hugging Face continuous batching (`init_continuous_batching`, the engine behind
                              `generate_batch`) of at most `rows` requests per batch, one process
    one-stage-static          `Pipeline(stages=1, batching="static", microbatch=rows)`: the serving machinery
    one-stage-continuous      (head, stage process, links) without a split; `batching="continuous"` beside it
    mixed-static              `Pipeline(stages=2, batching="static")`: prompts and tokens share two stage
    mixed-continuous          processes; `batching="continuous"` beside it
    disaggregated-static      `Pipeline(prompt_stages=1, token_stages=1, batching="static")`: a prompt stage
    disaggregated-continuous  process streams each prompt's KV to a token stage process; `batching="continuous"`
                              beside it
    controller                one-stage-continuous behind `dv.Controller`, each request streamed over HTTP by a
    controller-journal        client of its own; with a journal in LMDB beside it (`bench/serving_http.py`):
                              their ratio is what the journal costs

where `rows` is two microbatches' rows: every variant keeps at most as many rows in flight (a mixed pipeline
two microbatches, or slots, of `microbatch` rows, disaggregated static two microbatches on its token side; one
stage, and disaggregated continuous on its one token stage, one slot of `rows`). All run on the same cores:
each stage process of a two-stage pipeline gets half the threads, one stage and the one-process baselines all
of them. Every variant runs once per repeat and rate, back to back, in turns, so that ratios are taken per
repeat. The model's end-of-sequence token is dropped (`bench_model`), so that every request generates exactly
its trace length.

Three workloads: `gain`, long prompts and about as many new tokens as the prefill takes decode steps (by
default 256 and 32: the planner predicts 1P+1T ahead of the mixed pipeline), `loss`, short prompts and long
outputs (64 and 64: the planner predicts it behind), both greedy; and `openai`, what an OpenAI client sends by
default (128 and 64): sampled with the API's defaults (temperature 1, top_p 1, no top-k), each request with a
seed of its own. The pipelines draw each row from its own generator; Hugging Face's continuous batching draws
every row from the process's generator (seeded once per manager: it takes no per-request seed) and
`model.generate` from one seeded per batch. The bench checks no tokens: what it measures is speed. The
planner's prediction comes from Y and t measured here, with a stage's threads, and is set beside the measured
disaggregated/mixed ratio of like batching (`PLANNER_PAIRS`).
"""

from __future__ import annotations

import math
import os
import statistics
import textwrap
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from tqdm import tqdm

from ..errors import ConfigError
from ..generation.batching import left_pad
from ..models import load_model
from ..planner import plan
from ..report import markdown_table
from ..timing import measure_times
from ..traces import Trace, load_trace
from .common import Spread, machine_description
from .serving_http import CONTROLLERS, JOURNAL_TARGET, ControllerServer

#: The pipelines, by variant: the layout and the batching asked for.
PIPELINES: dict[str, tuple[dict[str, int], str]] = {
    "one-stage-static": ({"stages": 1}, "static"),
    "one-stage-continuous": ({"stages": 1}, "continuous"),
    "mixed-static": ({"stages": 2}, "static"),
    "mixed-continuous": ({"stages": 2}, "continuous"),
    "disaggregated-static": ({"prompt_stages": 1, "token_stages": 1}, "static"),
    "disaggregated-continuous": ({"prompt_stages": 1, "token_stages": 1}, "continuous"),
}
#: Hugging Face's ways, in one process.
BASELINES = ("static", "continuous")
VARIANTS = (*BASELINES, *PIPELINES, *CONTROLLERS)
#: What runs unless `variants` says otherwise: the ones the targets are about, in about 50 minutes here.
DEFAULT_VARIANTS = ("continuous", "one-stage-continuous", "mixed-continuous", "disaggregated-continuous",
                    "disaggregated-static")
#: The baseline every variant's tokens/s is divided by.
REFERENCE = "continuous"
#: The least tokens/s each pipeline should reach against `REFERENCE`, with the same row cap.
TARGETS = {"one-stage-continuous": 1.0, "mixed-static": 0.95, "mixed-continuous": 0.95, "disaggregated-static": 0.95,
           "disaggregated-continuous": 0.95}
#: The (disaggregated, mixed) variants whose ratio is set beside the planner's prediction, preferred first: like
#: batching on both sides, so that the ratio measures the layout alone.
PLANNER_PAIRS = (("disaggregated-continuous", "mixed-continuous"), ("disaggregated-static", "mixed-static"))
WORKLOADS = ("gain", "loss", "openai")
#: The OpenAI API's sampling defaults (temperature 1, top_p 1) and no top-k (transformers' default would be 50).
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
#: Cores kept busy by other processes above which a run is reported as disturbed.
BUSY = 0.25
#: The environment variable naming the model `bench_model` loads (stage processes inherit it).
MODEL_VARIABLE = "DEJAVU_BENCH_MODEL"


def bench_model() -> Any:
    """The model named by `DEJAVU_BENCH_MODEL` (default smollm2) without end-of-sequence tokens: requests run
    to their trace lengths in every variant. Stage processes load it as `dejavu_sdk.bench.serving:bench_model`."""
    model = load_model(os.environ.get(MODEL_VARIABLE, "smollm2"))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    return model


@attrs.frozen
class Workload:
    """Requests as the trace gives them, scaled: prompt and output lengths, and arrival gaps of mean 1; greedy,
    or `sampled` with `OPENAI_SAMPLING` and a seed per request."""

    name: str
    prompt_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    gaps: tuple[float, ...]
    sampled: bool = False

    @classmethod
    def from_trace(cls, name: str, trace: Trace, count: int, prompt_median: int, output_median: int,
                   context: int, start: int = 0, sampled: bool = False) -> Workload:
        """`count` consecutive requests of `trace` from `start`, lengths scaled to the given medians."""
        if count < 1 or start + count > len(trace):
            raise ConfigError(f"the trace has {len(trace)} requests; asked for {count} from {start}")
        window = slice(start, start + count)
        prompts = _scaled(trace.prompt_tokens[window], prompt_median, context // 2)
        outputs = _scaled(trace.output_tokens[window], output_median, context // 2)
        gaps = np.diff(trace.arrivals[start:start + count + 1]) if start + count < len(trace) else \
            np.diff(trace.arrivals[window], prepend=trace.arrivals[start])
        gaps = gaps / gaps.mean() if gaps.mean() > 0 else np.ones(count)
        return cls(name, prompts, outputs, tuple(float(gap) for gap in gaps), sampled)

    @property
    def scaling(self) -> str:
        return (f"{len(self.prompt_tokens)} requests, prompts median {statistics.median(self.prompt_tokens):.0f} "
                f"({min(self.prompt_tokens)}-{max(self.prompt_tokens)}) tokens, outputs median "
                f"{statistics.median(self.new_tokens):.0f} ({min(self.new_tokens)}-{max(self.new_tokens)})"
                + (", sampled (temperature 1, top_p 1, a seed per request)" if self.sampled else ", greedy"))

    def arrivals(self, rate: float) -> list[float]:
        """Seconds from the first arrival: the trace's gaps at `rate` requests per second (inf: all at once)."""
        if math.isinf(rate):
            return [0.0] * len(self.gaps)
        return [float(x) for x in np.concatenate(([0.0], np.cumsum(self.gaps[:-1]) / rate))]

    def prompts(self, vocabulary: int, seed: int = 0) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(1, vocabulary, (length,), generator=generator) for length in self.prompt_tokens]

    def seeds(self, repeat: int) -> list[int] | None:
        """Each request's sampling seed in a repeat (None: greedy)."""
        return [1000 * repeat + number for number in range(len(self.prompt_tokens))] if self.sampled else None

    def batch_shape(self, microbatch: int) -> tuple[float, float]:
        """The mean longest prompt and the mean longest output of microbatches taken in arrival order: the
        prefill length and the steps a microbatch runs."""
        cuts = range(0, len(self.prompt_tokens), microbatch)
        return (statistics.mean(max(self.prompt_tokens[i:i + microbatch]) for i in cuts),
                statistics.mean(max(self.new_tokens[i:i + microbatch]) for i in cuts))


def _scaled(lengths: np.ndarray, median: int, most: int) -> tuple[int, ...]:
    """`lengths` scaled to `median`, then clipped to [2/3, 3/2] of it: the trace's order and spread within
    that band, without the tail (a 4,000-token prompt would take a minute to prefill on a CPU)."""
    factor = median / float(np.median(lengths))
    low, high = max(1, round(median * 2 / 3)), min(most, round(median * 3 / 2))
    return tuple(int(x) for x in np.clip(np.round(lengths * factor), low, high))


@attrs.frozen
class Served:
    """One request's times in seconds from its submission (its arrival): first token, last token; and how many
    it generated."""

    first: float
    last: float
    tokens: int


@attrs.frozen
class Run:
    """One variant serving one workload at one rate."""

    variant: str
    workload: str
    rate: float
    repeat: int
    makespan: float  # from the first arrival to the last token
    served: tuple[Served, ...]
    #: Cores other processes (outside the bench and its stage processes) kept busy during the run, on average;
    #: None where it cannot be read (not Linux). This machine may be shared: a busy neighbour slows every variant,
    #: and a process of two threads far more than one of one (each step waits for its slower thread).
    foreign: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return sum(request.tokens for request in self.served) / self.makespan

    def ttft(self, quantile: float) -> float:
        return float(np.quantile([request.first for request in self.served], quantile))

    def tpot(self, quantile: float) -> float:
        return float(np.quantile([(request.last - request.first) / (request.tokens - 1)
                                  for request in self.served if request.tokens > 1], quantile))

    def latency(self, quantile: float) -> float:
        return float(np.quantile([request.last for request in self.served], quantile))


@attrs.frozen
class Prediction:
    """The planner's disaggregated/mixed speed-up for a workload, from Y and t measured here."""

    prompt_time: float
    token_time: float
    prompt_tokens: float
    new_tokens: float
    speedup: float


@attrs.define
class ServingReport:
    machine: str
    microbatch: int
    threads: int
    rates: tuple[float, ...]
    workloads: dict[str, str]  # name -> its scaling
    predictions: dict[str, Prediction]
    runs: list[Run] = attrs.field(factory=list)
    max_prefill_tokens: int | None = None
    notes: list[str] = attrs.field(factory=list)  # what the baselines were set up with

    @property
    def rows(self) -> int:
        """The rows every variant keeps in flight at most."""
        return 2 * self.microbatch

    def of(self, variant: str, workload: str, rate: float) -> list[Run]:
        return [run for run in self.runs if (run.variant, run.workload, run.rate) == (variant, workload, rate)]

    def variants(self) -> list[str]:
        ran = {run.variant for run in self.runs}
        return [variant for variant in VARIANTS if variant in ran]

    def ratios(self, variant: str, workload: str, rate: float, reference: str = REFERENCE) -> list[float]:
        """`variant`'s tokens/s over `reference`'s, per repeat (both ran back to back in it)."""
        theirs = {run.repeat: run.tokens_per_second for run in self.of(reference, workload, rate)}
        return [run.tokens_per_second / theirs[run.repeat] for run in self.of(variant, workload, rate)
                if run.repeat in theirs]

    def planner_pair(self) -> tuple[str, str] | None:
        """The (disaggregated, mixed) variants set beside the planner's prediction (`pick_planner_pair`)."""
        return pick_planner_pair(self.variants())

    def measured_speedups(self, workload: str, rate: float) -> list[float]:
        """Disaggregated over mixed tokens/s of `planner_pair`, per repeat (both ran back to back); none without
        a pair."""
        pair = self.planner_pair()
        if pair is None:
            return []
        disaggregated, mixed = pair
        return self.ratios(disaggregated, workload, rate, reference=mixed)

    def target_rows(self) -> list[list[str]]:
        """Each pipeline variant with a target, per workload and rate: its median ratio to `REFERENCE` and
        whether it meets the target."""
        rows = []
        for variant, target in TARGETS.items():
            for name in self.workloads:
                for rate in self.rates:
                    ratios = self.ratios(variant, name, rate)
                    if ratios:
                        spread = Spread.of(ratios)
                        verdict = "met" if spread.median >= target else \
                            f"missed by {100 * (target - spread.median) / target:.1f}%"
                        rows.append([variant, name, _rate(rate), f">= {target:.2f}x", spread.text(), verdict])
        return rows

    def journal_rows(self) -> list[list[str]]:
        """Per workload and rate: the journal's tokens/s ratio (`controller-journal` over `controller`, paired by
        repeat) against `JOURNAL_TARGET`."""
        rows = []
        for name in self.workloads:
            for rate in self.rates:
                ratios = self.ratios("controller-journal", name, rate, reference="controller")
                if ratios:
                    spread = Spread.of(ratios)
                    verdict = "met" if spread.median >= JOURNAL_TARGET else \
                        f"missed by {100 * (JOURNAL_TARGET - spread.median) / JOURNAL_TARGET:.1f}%"
                    rows.append([name, _rate(rate), f">= {JOURNAL_TARGET:.2f}x", spread.text(3),
                                 ", ".join(f"{r:.3f}" for r in ratios), verdict])
        return rows

    def to_markdown(self) -> str:
        lines = [f"Machine: {self.machine}. At most {self.rows} rows in flight in every variant (microbatch "
                 f"{self.microbatch}; one-stage pipelines, and disaggregated continuous ones on their token stage, "
                 f"one slot of {self.rows}); each stage process of a two-stage pipeline has "
                 f"{max(1, self.threads // 2)} thread(s), one-stage pipelines and the one-process baselines "
                 f"{self.threads}; continuous pipelines prefill at most "
                 f"{self.max_prefill_tokens} prompt positions a step beside decoding. Trace: Azure LLM inference "
                 "2023 (conversation), CC-BY-4.0.", *self.notes, ""]
        header = ["rate (req/s)", "variant", "tokens/s", f"vs {REFERENCE}", "makespan (s)", "TTFT p50 / p99 (s)",
                  "TPOT p50 / p99 (ms)"]
        for name, scaling in self.workloads.items():
            lines += [f"### Workload `{name}`: {scaling}", ""]
            rows = []
            for rate in self.rates:
                for variant in VARIANTS:
                    runs = self.of(variant, name, rate)
                    if not runs:
                        continue
                    ratios = self.ratios(variant, name, rate) if variant != REFERENCE else []
                    rows.append([_rate(rate), variant, Spread.of([r.tokens_per_second for r in runs]).text(1),
                                 Spread.of(ratios).text() if ratios else "",
                                 f"{_median([r.makespan for r in runs]):.1f}",
                                 f"{_median([r.ttft(0.5) for r in runs]):.2f} / "
                                 f"{_median([r.ttft(0.99) for r in runs]):.2f}",
                                 f"{1e3 * _median([r.tpot(0.5) for r in runs]):.0f} / "
                                 f"{1e3 * _median([r.tpot(0.99) for r in runs]):.0f}"])
            lines += [markdown_table(header, rows), ""]
            prediction = self.predictions.get(name)
            if prediction is not None:
                lines.append(f"Planner (2 machines, Y = {prediction.prompt_time * 1e3:.0f} ms for a microbatch of "
                             f"{prediction.prompt_tokens:.0f}-token prompts, t = {prediction.token_time * 1e3:.1f} "
                             f"ms, N = {prediction.new_tokens:.0f}): disaggregated/mixed predicted "
                             f"{prediction.speedup:.2f}x.")
                pair = self.planner_pair()
                for rate in self.rates:
                    ratios = self.measured_speedups(name, rate)
                    if pair is not None and ratios:
                        spread = Spread.of(ratios)
                        lines.append(f"Measured {'/'.join(pair)} at {_rate(rate)} req/s: "
                                     f"{spread.text()} (repeats {', '.join(f'{r:.2f}' for r in ratios)}); "
                                     f"{spread.median / prediction.speedup:.2f} of the prediction.")
            lines.append("")
        busy = [run for run in self.runs if run.foreign is not None and run.foreign > BUSY]
        measured = [run for run in self.runs if run.foreign is not None]
        if measured:
            lines += [f"Other processes kept more than {BUSY} of a core busy during {len(busy)} of {len(measured)} "
                      "runs" + (": " + "; ".join(f"repeat {run.repeat} {run.workload} {_rate(run.rate)} "
                                                  f"{run.variant} {run.foreign:.2f}" for run in busy) if busy else "")
                      + ".", ""]
        journal = self.journal_rows()
        if journal:
            lines += ["### The journal's cost: `controller-journal` tokens/s over `controller`'s (median of the "
                      "per-repeat ratios, least-most in brackets)", "",
                      markdown_table(["workload", "rate (req/s)", "target", "measured", "per repeat", "verdict"],
                                     journal), ""]
        targets = self.target_rows()
        if targets:
            lines += [f"### Targets: tokens/s against Hugging Face `{REFERENCE}` with the same row cap "
                      "(median of the per-repeat ratios, least-most in brackets)", "",
                      markdown_table(["variant", "workload", "rate (req/s)", "target", "measured", "verdict"],
                                     targets), ""]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "microbatch": self.microbatch, "rows": self.rows, "threads": self.threads,
                "max_prefill_tokens": self.max_prefill_tokens, "notes": self.notes,
                "rates": [_rate(rate) for rate in self.rates], "workloads": self.workloads,
                "predictions": {name: attrs.asdict(p) for name, p in self.predictions.items()},
                "ratios": [{"variant": variant, "workload": name, "rate": _rate(rate), "reference": REFERENCE,
                            "per_repeat": self.ratios(variant, name, rate)}
                           for name in self.workloads for rate in self.rates for variant in self.variants()
                           if variant != REFERENCE and self.ratios(variant, name, rate)],
                "targets": [dict(zip(("variant", "workload", "rate", "target", "measured", "verdict"), row,
                                     strict=True)) for row in self.target_rows()],
                "runs": [{**attrs.asdict(run, recurse=False), "rate": _rate(run.rate),
                          "served": [attrs.astuple(s) for s in run.served]} for run in self.runs]}


def _rate(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g}"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


# ---- the ways to serve -------------------------------------------------------------------------------------
#: A way to serve: (prompts, new tokens, arrivals, seeds or None for greedy) -> (makespan, each request's times).
Server = Callable[[list[torch.Tensor], Sequence[int], Sequence[float], Sequence[int] | None],
                  tuple[float, list[Served]]]


def _wait_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def serve_pipeline(pipe: Any, prompts: list[torch.Tensor], new_tokens: Sequence[int], arrivals: Sequence[float],
                   seeds: Sequence[int] | None = None) -> tuple[float, list[Served]]:
    """Submit each request at its arrival (sampled with its seed when `seeds` are given); the makespan and each
    request's times from its submission (`Result.submitted`, `first_token`, `finished`)."""
    start = time.monotonic()
    futures = []
    for number, (ids, count, arrival) in enumerate(zip(prompts, new_tokens, arrivals, strict=True)):
        _wait_until(start + arrival)
        decoding = {} if seeds is None else {"do_sample": True, "seed": seeds[number], **OPENAI_SAMPLING}
        futures.append(pipe.submit(ids, max_new_tokens=count, **decoding))
    results = [future.result() for future in futures]
    served = [Served(r.first_token - r.submitted, r.finished - r.submitted, r.tokens.numel()) for r in results]
    return max(r.finished for r in results) - start, served


class _StepClock:
    """A `generate` streamer that notes when each step's tokens came out (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, _value: torch.Tensor) -> None:
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def serve_static(model: Any, prompts: list[torch.Tensor], new_tokens: Sequence[int], arrivals: Sequence[float],
                 batch: int, pad: int, seeds: Sequence[int] | None = None) -> tuple[float, list[Served]]:
    """`model.generate` on up to `batch` waiting requests at a time, left padded, until the longest is done;
    sampled (from the process's generator seeded with the batch's first seed) when `seeds` are given."""
    start = time.monotonic()
    served: list[Served | None] = [None] * len(prompts)
    waiting = 0
    while waiting < len(prompts):
        _wait_until(start + arrivals[waiting])
        now = time.monotonic() - start
        members = [i for i in range(waiting, min(waiting + batch, len(prompts))) if arrivals[i] <= now]
        waiting = members[-1] + 1
        ids, mask = left_pad([prompts[i] for i in members], pad)
        clock = _StepClock()
        decoding: dict[str, Any] = {"do_sample": False}
        if seeds is not None:
            torch.manual_seed(seeds[members[0]])
            decoding = {"do_sample": True, **OPENAI_SAMPLING}
        model.generate(ids, attention_mask=mask, streamer=clock, max_new_tokens=max(new_tokens[i] for i in members),
                       **decoding)
        steps = clock.times[1:]
        for i in members:
            served[i] = Served(steps[0] - start - arrivals[i], steps[new_tokens[i] - 1] - start - arrivals[i],
                               new_tokens[i])
    done = [request for request in served if request is not None]
    return max(r.last + a for r, a in zip(done, arrivals, strict=True)), done


def serve_continuous(manager: Any, prompts: list[torch.Tensor], new_tokens: Sequence[int],
                     arrivals: Sequence[float]) -> tuple[float, list[Served]]:
    """Hugging Face continuous batching: each request added at its arrival, its token times recorded (the
    manager's generation config says greedy or sampled)."""
    start, names, submitted = time.perf_counter(), [], []
    for number, (ids, count, arrival) in enumerate(zip(prompts, new_tokens, arrivals, strict=True)):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submitted.append(time.perf_counter())
        names.append(manager.add_request(ids.tolist(), request_id=f"r{number}-{start}", max_new_tokens=count,
                                         record_timestamps=True))
    outputs: dict[str, Any] = {}
    while len(outputs) < len(names):
        output = manager.get_result(timeout=60)
        if output is None:
            raise ConfigError("continuous batching returned nothing for 60 s")
        if output.error:
            raise ConfigError(f"continuous batching failed a request: {output.error}")
        outputs[output.request_id] = output
    served = []
    for name, sent, count in zip(names, submitted, new_tokens, strict=True):
        stamps = outputs[name].timestamps
        if len(outputs[name].generated_tokens) != count:
            raise ConfigError(f"continuous batching generated {len(outputs[name].generated_tokens)} tokens, "
                              f"asked for {count}")
        served.append(Served(stamps[0] - sent, stamps[-1] - sent, count))
    return max(max(outputs[name].timestamps) for name in names) - start, served


class HFContinuous:
    """Hugging Face continuous batching with at most `rows` requests per batch, greedy or sampling: one started
    manager at a time (they share the model), a new one started (and warmed up) when a workload asks for the
    other decoding. Its generation config says greedy or sampled for every request; it samples every row from
    the process's generator, seeded once per manager (`add_request` takes no seed)."""

    def __init__(self, model: Any, rows: int, loads: list[Workload], seed: int = 0) -> None:
        self.model, self.rows, self.seed = model, rows, seed
        self.new_tokens = max(max(load.new_tokens) for load in loads)
        self.longest = max(max(load.prompt_tokens) + max(load.new_tokens) for load in loads)
        self.manager: Any = None
        self.sampled: bool | None = None
        self.settings = ""

    def serve(self, prompts: list[torch.Tensor], new_tokens: Sequence[int], arrivals: Sequence[float],
              seeds: Sequence[int] | None) -> tuple[float, list[Served]]:
        self._ready(seeds is not None)
        return serve_continuous(self.manager, prompts, new_tokens, arrivals)

    def _ready(self, sampled: bool) -> None:
        if self.manager is not None and self.sampled == sampled:
            return
        self.close()
        from transformers import ContinuousBatchingConfig, GenerationConfig

        decoding = {"do_sample": True, **OPENAI_SAMPLING} if sampled else {"do_sample": False}
        config = GenerationConfig(max_new_tokens=self.new_tokens, eos_token_id=None, pad_token_id=0, **decoding)
        # A cache for `rows` requests of the longest length, in whole pages: sized from free memory otherwise
        # (most of this machine's RAM)
        page = ContinuousBatchingConfig().page_size
        batching = ContinuousBatchingConfig(max_requests_per_batch=self.rows, seed=self.seed,
                                            num_blocks=self.rows * math.ceil(self.longest / page) + 1)
        self.manager = self.model.init_continuous_batching(generation_config=config,
                                                           continuous_batching_config=batching)
        self.manager.start()
        self.sampled = sampled
        ids = torch.arange(1, 5) % max(2, self.model.config.vocab_size - 1) + 1  # lazy set-up outside the figures
        serve_continuous(self.manager, [ids, ids], [2, 2], [0.0, 0.0])
        resolved = self.manager.continuous_batching_config
        processor = getattr(self.manager, "batch_processor", None)
        tokens = getattr(getattr(processor, "cache", None), "max_batch_tokens", resolved.max_batch_tokens)
        self.settings = (f"Hugging Face continuous batching: at most {resolved.max_requests_per_batch} requests and "
                         f"{tokens} tokens per batch, {resolved.num_blocks} pages of {resolved.page_size} "
                         f"positions, {resolved.scheduler_type} scheduler, attention "
                         f"{self.model.config._attn_implementation}.")

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=30)
            self.manager = None


def foreign_cores(start: tuple[float, float, float] | None) -> float | None:
    """How much CPU other processes took since `start` (`_cpu_seconds()`): the machine's busy time (`/proc/stat`)
    less that of this process and its descendants (the stage processes), in cores on average. Linux only (None
    elsewhere, or over less than a second: clock ticks are 10 ms)."""
    end = _cpu_seconds()
    if start is None or end is None:
        return None
    wall, busy, ours = (after - before for after, before in zip(end, start, strict=True))
    return max(0.0, busy - ours) / wall if wall >= 1 else None


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds the machine was busy, CPU seconds this process tree used), or None."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        busy = sum(fields[:3]) / tick  # user, nice, system: what processes' utime and stime count
        parents: dict[int, int] = {}
        used: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as process:
                    text = process.read()
            except OSError:
                continue  # gone meanwhile
            rest = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
            parents[int(entry)] = int(rest[1])
            used[int(entry)] = int(rest[11]) + int(rest[12])  # utime, stime
        tree, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
            tree.update(children)
            frontier += children
        return time.monotonic(), busy, sum(used.get(pid, 0) for pid in tree) / tick
    except (OSError, ValueError, IndexError, AttributeError):
        return None


# ---- the benchmark -----------------------------------------------------------------------------------------
def workloads(model: Any, count: int, gain: tuple[int, int], loss: tuple[int, int],
              openai: tuple[int, int] = (128, 64), names: Sequence[str] = WORKLOADS) -> list[Workload]:
    """The workloads named, each (median prompt tokens, median new tokens), from consecutive trace requests: each
    its own stretch of the trace."""
    trace = load_trace()
    context = getattr(model.config, "max_position_embeddings", 2048) or 2048
    made = {"gain": Workload.from_trace("gain", trace, count, *gain, context),
            "loss": Workload.from_trace("loss", trace, count, *loss, context, start=count),
            "openai": Workload.from_trace("openai", trace, count, *openai, context, start=2 * count, sampled=True)}
    return [made[name] for name in WORKLOADS if name in names]


def pick_planner_pair(variants: Collection[str]) -> tuple[str, str] | None:
    """The first of `PLANNER_PAIRS` whose variants are both among `variants`, or None."""
    return next((pair for pair in PLANNER_PAIRS if set(pair) <= set(variants)), None)


def pipeline_shape(variant: str, rows: int, threads: int) -> tuple[int, int]:
    """A pipeline variant's microbatch and threads per stage process: `rows` split over the microbatches (or
    slots) its token side keeps in flight, `threads` over its stage processes."""
    layout, batching = PIPELINES[variant]
    processes = sum(layout.values())
    # static: one microbatch per stage process (disaggregated: the default `token_slots`); continuous: one slot
    # per stage that decodes
    in_flight = processes if batching == "static" else layout.get("stages", layout.get("token_stages", 1))
    return rows // in_flight, max(1, threads // processes)


def predict(model: Any, workload: Workload, microbatch: int, threads: int) -> Prediction:
    """The planner's speed-up of 1P+1T over 2 mixed stages, from Y and t timed with one stage's threads."""
    prompt_tokens, new_tokens = workload.batch_shape(microbatch)
    prompt_time, token_time = measure_times(model, microbatch, round(prompt_tokens), progress=False,
                                            threads=threads)
    answer = plan(2, prompt_time, token_time, new_tokens)
    return Prediction(prompt_time, token_time, prompt_tokens, new_tokens, answer.predicted_speedup)


def check_choices(variants: Sequence[str], names: Sequence[str]) -> None:
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise ConfigError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    if not variants or not names:
        raise ConfigError("name at least one variant and one workload")


def run_serving_bench(model_name: str = "smollm2", *, requests: int = 12, microbatch: int = 4,
                      rates: Sequence[float] = (math.inf,), repeats: int = 3, gain: tuple[int, int] = (256, 32),
                      loss: tuple[int, int] = (64, 64), openai: tuple[int, int] = (128, 64),
                      variants: Sequence[str] = DEFAULT_VARIANTS, names: Sequence[str] = WORKLOADS,
                      max_prefill_tokens: int = 256, transport: str = "tcp",
                      progress: bool = True) -> ServingReport:
    """Serve the workloads at every rate with every variant, `repeats` times, variants back to back."""
    from ..serving import Pipeline

    check_choices(variants, names)
    variants = [variant for variant in VARIANTS if variant in variants]
    os.environ[MODEL_VARIABLE] = model_name  # stage processes load the same model through bench_model
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    model = bench_model()
    stage_threads = max(1, threads // 2)
    rows = 2 * microbatch
    loads = workloads(model, requests, gain, loss, openai, names)
    report = ServingReport(machine_description(), microbatch, threads, tuple(rates),
                           {load.name: load.scaling for load in loads}, {}, max_prefill_tokens=max_prefill_tokens)
    if pick_planner_pair(variants) is not None:
        for load in loads:
            report.predictions[load.name] = predict(model, load, microbatch, stage_threads)
    spec = f"{__name__}:bench_model"
    pipelines: dict[str, Any] = {}
    controllers: dict[str, ControllerServer] = {}
    hf = HFContinuous(model, rows, loads)
    try:
        for name in variants:
            if name not in PIPELINES:
                continue
            layout, batching = PIPELINES[name]
            rows_each, threads_each = pipeline_shape(name, rows, threads)
            pipe = Pipeline(spec, **layout, batching=batching, microbatch=rows_each,
                            max_prefill_tokens=max_prefill_tokens, transport=transport, threads=threads_each,
                            timeout=600)
            if pipe.batching != batching:
                raise ConfigError(f"{name}: the pipeline runs {pipe.batching} batching, not {batching}")
            pipelines[name] = pipe
        for name in variants:
            if name in CONTROLLERS:
                controllers[name] = ControllerServer(spec, name, rows, threads, max_prefill_tokens, transport)
        for pipe in pipelines.values():
            pipe.start()
        for server in controllers.values():
            server.start()
        servers: dict[str, Server] = {
            "static": lambda p, n, a, s: serve_static(model, p, n, a, rows, 0, s),
            "continuous": hf.serve,
            **{name: _pipeline_server(pipe) for name, pipe in pipelines.items()},
            **{name: _controller_server(server) for name, server in controllers.items()},
        }
        _warm_up(servers, variants, loads, model.config.vocab_size)
        total = len(loads) * len(rates) * repeats * len(variants)
        with tqdm(total=total, desc="serving", unit="run", disable=not progress) as bar:
            for repeat in range(repeats):
                for load in loads:
                    prompts = load.prompts(model.config.vocab_size, seed=repeat)
                    for rate in rates:
                        turn = variants[repeat % len(variants):] + variants[:repeat % len(variants)]
                        for variant in turn:
                            bar.set_postfix_str(f"{load.name} {_rate(rate)} req/s {variant}")
                            start = _cpu_seconds()
                            makespan, served = servers[variant](prompts, load.new_tokens, load.arrivals(rate),
                                                                load.seeds(repeat))
                            report.runs.append(Run(variant, load.name, rate, repeat, makespan, tuple(served),
                                                   foreign_cores(start)))
                            bar.update()
        if hf.settings:
            report.notes.append(hf.settings)
    finally:
        hf.close()
        for pipe in pipelines.values():
            pipe.close()
        for server in controllers.values():
            server.close()
    return report


def _pipeline_server(pipe: Any) -> Server:
    return lambda prompts, new_tokens, arrivals, seeds: serve_pipeline(pipe, prompts, new_tokens, arrivals, seeds)


def _controller_server(server: ControllerServer) -> Server:
    def serve(prompts: list[torch.Tensor], new_tokens: Sequence[int], arrivals: Sequence[float],
              seeds: Sequence[int] | None) -> tuple[float, list[Served]]:
        makespan, times = server.serve(prompts, new_tokens, arrivals, seeds)
        return makespan, [Served(*each) for each in times]

    return serve


def _warm_up(servers: dict[str, Server], variants: Sequence[str], loads: list[Workload], vocabulary: int) -> None:
    """Two small requests through every variant, greedy and (if a workload samples) sampled: first calls pay for
    lazy set-up, not the figures."""
    prompts = loads[0].prompts(vocabulary, seed=99)[:2]
    for sampled in sorted({load.sampled for load in loads}):
        for variant in variants:
            servers[variant](prompts, [2, 2], [0.0, 0.0], [7, 8] if sampled else None)


def plot_serving_bench(report: ServingReport, path: str) -> None:
    """Against the arrival rate, one column per workload, one line per variant: tokens/s, the ratio to Hugging
    Face continuous batching (medians, bars from the least to the most repeat; the targets dotted), and p99
    request latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report.workloads)
    figure, axes = plt.subplots(3, len(names), figsize=(5.5 * len(names), 10), squeeze=False)
    finite = [rate for rate in report.rates if not math.isinf(rate)]
    burst = 2 * max(finite) if finite else 1.0  # "all at once" drawn to the right of the highest rate
    variants = report.variants()
    styles = {variant: ("s--" if variant in BASELINES else "o-") for variant in variants}
    for column, name in enumerate(names):
        for number, variant in enumerate(variants):
            points = [(rate, report.of(variant, name, rate)) for rate in report.rates]
            points = [(rate, runs) for rate, runs in points if runs]
            if not points:
                continue
            xs = [burst if math.isinf(rate) else rate for rate, _ in points]
            color = f"C{number}"
            speeds = [Spread.of([r.tokens_per_second for r in runs]) for _, runs in points]
            _spread_line(axes[0][column], xs, speeds, styles[variant], color, variant)
            if variant != REFERENCE:
                found = [(x, report.ratios(variant, name, rate)) for x, (rate, _) in zip(xs, points, strict=True)]
                pairs = [(x, Spread.of(ratios)) for x, ratios in found if ratios]
                if pairs:
                    # a small shift per variant keeps the bars apart
                    shift = 1 + 0.02 * (number - len(variants) / 2)
                    _spread_line(axes[1][column], [x * shift for x, _ in pairs], [s for _, s in pairs],
                                 styles[variant], color, variant)
            axes[2][column].plot(xs, [_median([r.latency(0.99) for r in runs]) for _, runs in points],
                                 styles[variant], color=color, label=variant)
        for target in sorted(set(TARGETS.values())):
            axes[1][column].axhline(target, color="grey", linestyle=":", linewidth=1)
        axes[0][column].set_title(textwrap.fill(f"{name}: {report.workloads[name]}", 70), fontsize=8)
        axes[0][column].set_ylabel("generated tokens/s")
        axes[1][column].set_ylabel(f"tokens/s / HF {REFERENCE} (per repeat)")
        axes[2][column].set_ylabel("p99 request latency (s)")
        axes[2][column].set_xlabel("arrival rate (requests/s; rightmost: all at once)")
        for row in axes:
            row[column].set_xscale("log")
            row[column].set_xticks([burst if math.isinf(rate) else rate for rate in report.rates],
                                   [_rate(rate) for rate in report.rates])
            row[column].minorticks_off()
        axes[0][column].legend(fontsize=7)
    figure.suptitle(f"dejavu bench serving: at most {report.rows} rows in flight in every variant (Azure LLM "
                    "inference trace 2023, CC-BY-4.0)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _spread_line(axis: Any, xs: Sequence[float], spreads: Sequence[Spread], style: str, color: str,
                 label: str) -> None:
    medians = [s.median for s in spreads]
    axis.errorbar(xs, medians, yerr=[[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]],
                  fmt=style, color=color, label=label, capsize=3, markersize=4)
