"""`dejavu bench serving`: one model served four ways, side by side, on requests from a real trace.

Requests take their prompt and output lengths, and their arrival gaps, from the shipped sample of the Azure
LLM inference trace 2023 (conversation; CC-BY-4.0, see `dejavu_sdk/data/README.md`), scaled to this CPU:
lengths are scaled so that their medians hit a workload's targets and clipped to [2/3, 3/2] of them, and
gaps are scaled so that requests arrive at a given rate. Each workload is served, at each rate, by:

    static        Hugging Face `model.generate` on batches of up to two microbatches' rows (as many as the
                  pipelines have in flight) of the requests waiting, one process
    continuous    Hugging Face continuous batching (`init_continuous_batching`) of up to as many requests at
                  once, one process
    mixed         `Pipeline(stages=2)`: prompts and tokens share two stage processes
    disaggregated `Pipeline(prompt_stages=1, token_stages=1)`

all on the same cores: each stage process gets its share of the threads, the one-process baselines all of
them. Every variant runs once per repeat and rate, back to back, in turns. The model's end-of-sequence
token is dropped (`bench_model`), so that every request generates exactly its trace length.

Two workloads: `gain`, long prompts and about as many new tokens as the prefill takes decode steps (by
default 256 and 32: the planner predicts 1P+1T ahead of the mixed pipeline), and `loss`, short prompts and
long outputs (64 and 64: the planner predicts it behind). The prediction comes from Y and t measured here,
with a stage's threads. (With one thread per stage, 256-token prompts and 64 new tokens sit at the
planner's break-even on this kind of machine, so they cannot show an order.)
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
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
from .common import machine_description

VARIANTS = ("static", "continuous", "mixed", "disaggregated")
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
    """Requests as the trace gives them, scaled: prompt and output lengths, and arrival gaps of mean 1."""

    name: str
    prompt_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    gaps: tuple[float, ...]

    @classmethod
    def from_trace(cls, name: str, trace: Trace, count: int, prompt_median: int, output_median: int,
                   context: int, start: int = 0) -> Workload:
        """`count` consecutive requests of `trace` from `start`, lengths scaled to the given medians."""
        if count < 1 or start + count > len(trace):
            raise ConfigError(f"the trace has {len(trace)} requests; asked for {count} from {start}")
        window = slice(start, start + count)
        prompts = _scaled(trace.prompt_tokens[window], prompt_median, context // 2)
        outputs = _scaled(trace.output_tokens[window], output_median, context // 2)
        gaps = np.diff(trace.arrivals[start:start + count + 1]) if start + count < len(trace) else \
            np.diff(trace.arrivals[window], prepend=trace.arrivals[start])
        gaps = gaps / gaps.mean() if gaps.mean() > 0 else np.ones(count)
        return cls(name, prompts, outputs, tuple(float(gap) for gap in gaps))

    @property
    def scaling(self) -> str:
        return (f"{len(self.prompt_tokens)} requests, prompts median {statistics.median(self.prompt_tokens):.0f} "
                f"({min(self.prompt_tokens)}-{max(self.prompt_tokens)}) tokens, outputs median "
                f"{statistics.median(self.new_tokens):.0f} ({min(self.new_tokens)}-{max(self.new_tokens)})")

    def arrivals(self, rate: float) -> list[float]:
        """Seconds from the first arrival: the trace's gaps at `rate` requests per second (inf: all at once)."""
        if math.isinf(rate):
            return [0.0] * len(self.gaps)
        return [float(x) for x in np.concatenate(([0.0], np.cumsum(self.gaps[:-1]) / rate))]

    def prompts(self, vocabulary: int, seed: int = 0) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(1, vocabulary, (length,), generator=generator) for length in self.prompt_tokens]

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
    """One request's times in seconds from its arrival: first token, last token; and how many it generated."""

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

    def of(self, variant: str, workload: str, rate: float) -> list[Run]:
        return [run for run in self.runs if (run.variant, run.workload, run.rate) == (variant, workload, rate)]

    def measured_speedups(self, workload: str, rate: float) -> list[float]:
        """Disaggregated over mixed tokens/s, per repeat (both ran back to back); none unless both ran."""
        pairs = zip(self.of("disaggregated", workload, rate), self.of("mixed", workload, rate), strict=False)
        return [dis.tokens_per_second / mixed.tokens_per_second for dis, mixed in pairs]

    def to_markdown(self) -> str:
        lines = [f"Machine: {self.machine}. Microbatch {self.microbatch}; each of the 2 stage processes has "
                 f"{max(1, self.threads // 2)} thread(s), the one-process baselines {self.threads}. Trace: "
                 f"Azure LLM inference 2023 (conversation), CC-BY-4.0.", ""]
        for name, scaling in self.workloads.items():
            prediction = self.predictions[name]
            lines += [f"### Workload `{name}`: {scaling}", ""]
            rows = []
            for rate in self.rates:
                for variant in VARIANTS:
                    runs = self.of(variant, name, rate)
                    if not runs:
                        continue
                    rows.append([_rate(rate), variant, f"{_median([r.tokens_per_second for r in runs]):.1f}",
                                 f"{_median([r.makespan for r in runs]):.1f}",
                                 f"{_median([r.ttft(0.5) for r in runs]):.2f} / "
                                 f"{_median([r.ttft(0.99) for r in runs]):.2f}",
                                 f"{1e3 * _median([r.tpot(0.5) for r in runs]):.0f} / "
                                 f"{1e3 * _median([r.tpot(0.99) for r in runs]):.0f}"])
            lines += [markdown_table(["rate (req/s)", "variant", "tokens/s", "makespan (s)", "TTFT p50 / p99 (s)",
                                      "TPOT p50 / p99 (ms)"], rows), ""]
            lines.append(f"Planner (2 machines, Y = {prediction.prompt_time * 1e3:.0f} ms for a microbatch of "
                         f"{prediction.prompt_tokens:.0f}-token prompts, t = {prediction.token_time * 1e3:.1f} ms, "
                         f"N = {prediction.new_tokens:.0f}): disaggregated/mixed predicted "
                         f"{prediction.speedup:.2f}x.")
            saturated = max(self.rates)
            ratios = self.measured_speedups(name, saturated)
            if ratios:
                lines.append(f"Measured at {_rate(saturated)} req/s: {_median(ratios):.2f}x (repeats "
                             f"{', '.join(f'{r:.2f}' for r in ratios)}); {_median(ratios) / prediction.speedup:.2f} "
                             "of the prediction.")
            lines.append("")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "microbatch": self.microbatch, "threads": self.threads,
                "rates": [_rate(rate) for rate in self.rates], "workloads": self.workloads,
                "predictions": {name: attrs.asdict(p) for name, p in self.predictions.items()},
                "runs": [{**attrs.asdict(run, recurse=False), "rate": _rate(run.rate),
                          "served": [attrs.astuple(s) for s in run.served]} for run in self.runs]}


def _rate(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g}"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


# ---- the four ways to serve ------------------------------------------------------------------------------
def _wait_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def serve_pipeline(pipe: Any, prompts: list[torch.Tensor], new_tokens: Sequence[int],
                   arrivals: Sequence[float]) -> tuple[float, list[Served]]:
    """Submit each request at its arrival; the makespan and each request's times."""
    start = time.monotonic()
    futures = []
    for ids, count, arrival in zip(prompts, new_tokens, arrivals, strict=True):
        _wait_until(start + arrival)
        futures.append(pipe.submit(ids, max_new_tokens=count))
    results = [future.result() for future in futures]
    served = [Served(r.first_token - start - arrival, r.finished - start - arrival, r.tokens.numel())
              for r, arrival in zip(results, arrivals, strict=True)]
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
                 batch: int, pad: int) -> tuple[float, list[Served]]:
    """`model.generate` on up to `batch` waiting requests at a time, left padded, until the longest is done."""
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
        model.generate(ids, attention_mask=mask, do_sample=False, streamer=clock,
                       max_new_tokens=max(new_tokens[i] for i in members))
        steps = clock.times[1:]
        for i in members:
            served[i] = Served(steps[0] - start - arrivals[i], steps[new_tokens[i] - 1] - start - arrivals[i],
                               new_tokens[i])
    done = [request for request in served if request is not None]
    return max(r.last + a for r, a in zip(done, arrivals, strict=True)), done


def serve_continuous(manager: Any, prompts: list[torch.Tensor], new_tokens: Sequence[int],
                     arrivals: Sequence[float]) -> tuple[float, list[Served]]:
    """Hugging Face continuous batching: each request added at its arrival, its token times recorded."""
    start, names = time.perf_counter(), []
    for number, (ids, count, arrival) in enumerate(zip(prompts, new_tokens, arrivals, strict=True)):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
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
    for name, arrival, count in zip(names, arrivals, new_tokens, strict=True):
        stamps = outputs[name].timestamps
        if len(outputs[name].generated_tokens) != count:
            raise ConfigError(f"continuous batching generated {len(outputs[name].generated_tokens)} tokens, "
                              f"asked for {count}")
        served.append(Served(stamps[0] - start - arrival, stamps[-1] - start - arrival, count))
    return max(r.last + a for r, a in zip(served, arrivals, strict=True)), served


# ---- the benchmark -----------------------------------------------------------------------------------------
def workloads(model: Any, count: int, gain: tuple[int, int], loss: tuple[int, int]) -> list[Workload]:
    """The two workloads, each (median prompt tokens, median new tokens), from consecutive trace requests."""
    trace = load_trace()
    context = getattr(model.config, "max_position_embeddings", 2048) or 2048
    return [Workload.from_trace("gain", trace, count, *gain, context),
            Workload.from_trace("loss", trace, count, *loss, context, start=count)]


def predict(model: Any, workload: Workload, microbatch: int, threads: int) -> Prediction:
    """The planner's speed-up of 1P+1T over 2 mixed stages, from Y and t timed with one stage's threads."""
    prompt_tokens, new_tokens = workload.batch_shape(microbatch)
    prompt_time, token_time = measure_times(model, microbatch, round(prompt_tokens), progress=False,
                                            threads=threads)
    answer = plan(2, prompt_time, token_time, new_tokens)
    return Prediction(prompt_time, token_time, prompt_tokens, new_tokens, answer.predicted_speedup)


def run_serving_bench(model_name: str = "smollm2", *, requests: int = 16, microbatch: int = 4,
                      rates: Sequence[float] = (math.inf,), repeats: int = 3, gain: tuple[int, int] = (256, 32),
                      loss: tuple[int, int] = (64, 64), variants: Sequence[str] = VARIANTS, transport: str = "tcp",
                      progress: bool = True) -> ServingReport:
    """Serve both workloads at every rate with every variant, `repeats` times, variants back to back."""
    from ..serving import Pipeline

    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    os.environ[MODEL_VARIABLE] = model_name  # stage processes load the same model through bench_model
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    model = bench_model()
    stage_threads = max(1, threads // 2)
    loads = workloads(model, requests, gain, loss)
    report = ServingReport(machine_description(), microbatch, threads, tuple(rates),
                           {load.name: load.scaling for load in loads}, {})
    for load in loads:
        report.predictions[load.name] = predict(model, load, microbatch, stage_threads)
    spec = f"{__name__}:bench_model"
    pipelines = {}
    if "mixed" in variants:
        pipelines["mixed"] = Pipeline(spec, stages=2, microbatch=microbatch, transport=transport,
                                      threads=stage_threads, timeout=600)
    if "disaggregated" in variants:
        pipelines["disaggregated"] = Pipeline(spec, prompt_stages=1, token_stages=1, microbatch=microbatch,
                                              transport=transport, threads=stage_threads, timeout=600)
    manager = None
    try:
        for pipe in pipelines.values():
            pipe.start()
        if "continuous" in variants:
            manager = _continuous_manager(model, 2 * microbatch, loads)
        servers: dict[str, Callable[[list[torch.Tensor], Sequence[int], Sequence[float]],
                                    tuple[float, list[Served]]]] = {
            "static": lambda p, n, a: serve_static(model, p, n, a, 2 * microbatch, 0),
            "continuous": lambda p, n, a: serve_continuous(manager, p, n, a),
            **{name: _pipeline_server(pipe) for name, pipe in pipelines.items()},
        }
        _warm_up(servers, variants, loads[0], model.config.vocab_size)
        total = len(loads) * len(rates) * repeats * len(variants)
        with tqdm(total=total, desc="serving", unit="run", disable=not progress) as bar:
            for repeat in range(repeats):
                for load in loads:
                    prompts = load.prompts(model.config.vocab_size, seed=repeat)
                    for rate in rates:
                        turn = list(variants)[repeat % len(variants):] + list(variants)[:repeat % len(variants)]
                        for variant in turn:
                            bar.set_postfix_str(f"{load.name} {_rate(rate)} req/s {variant}")
                            makespan, served = servers[variant](prompts, load.new_tokens, load.arrivals(rate))
                            report.runs.append(Run(variant, load.name, rate, repeat, makespan, tuple(served)))
                            bar.update()
    finally:
        if manager is not None:
            manager.stop(block=True, timeout=30)
        for pipe in pipelines.values():
            pipe.close()
    return report


def _pipeline_server(pipe: Any) -> Callable[[list[torch.Tensor], Sequence[int], Sequence[float]],
                                             tuple[float, list[Served]]]:
    return lambda prompts, new_tokens, arrivals: serve_pipeline(pipe, prompts, new_tokens, arrivals)


def _continuous_manager(model: Any, rows: int, loads: list[Workload]) -> Any:
    """A started continuous batching manager, greedy, with at most `rows` requests in a batch (as many as the
    other variants have in flight)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(max(load.new_tokens) for load in loads),
                              eos_token_id=None, pad_token_id=0)
    # A cache for `rows` requests of the longest length, in whole pages: sized from free memory otherwise
    # (most of this machine's RAM)
    longest = max(max(load.prompt_tokens) + max(load.new_tokens) for load in loads)
    page = ContinuousBatchingConfig().page_size
    batching = ContinuousBatchingConfig(max_requests_per_batch=rows, num_blocks=rows * math.ceil(longest / page) + 1)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching)
    manager.start()
    return manager


def _warm_up(servers: dict[str, Callable[..., tuple[float, list[Served]]]], variants: Sequence[str],
             load: Workload, vocabulary: int) -> None:
    """One small request through every variant: first calls pay for lazy set-up, not the figures."""
    prompts = load.prompts(vocabulary, seed=99)[:2]
    for variant in variants:
        servers[variant](prompts, [2, 2], [0.0, 0.0])


def plot_serving_bench(report: ServingReport, path: str) -> None:
    """Tokens/s and p99 latency against the arrival rate, one column per workload, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report.workloads)
    figure, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 7), squeeze=False)
    finite = [rate for rate in report.rates if not math.isinf(rate)]
    burst = 2 * max(finite) if finite else 1.0  # "all at once" drawn to the right of the highest rate
    for column, name in enumerate(names):
        for variant in VARIANTS:
            points = [(rate, report.of(variant, name, rate)) for rate in report.rates]
            points = [(burst if math.isinf(rate) else rate, runs) for rate, runs in points if runs]
            if not points:
                continue
            xs = [x for x, _ in points]
            axes[0][column].plot(xs, [_median([r.tokens_per_second for r in runs]) for _, runs in points], "o-",
                                 label=variant)
            axes[1][column].plot(xs, [_median([r.latency(0.99) for r in runs]) for _, runs in points], "o-",
                                 label=variant)
        axes[0][column].set_title(f"{name}: {report.workloads[name]}", fontsize=8)
        axes[0][column].set_ylabel("generated tokens/s")
        axes[1][column].set_ylabel("p99 request latency (s)")
        axes[1][column].set_xlabel("arrival rate (requests/s; rightmost: all at once)")
        axes[0][column].legend(fontsize=8)
    figure.suptitle("dejavu bench serving (Azure LLM inference trace 2023, CC-BY-4.0)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

