"""`dejavu bench streaming`: what streaming the KV cache costs a real model, and what the optimisations buy.

(a) decode: per-step latency with replication to each store, beside the same generation without it, greedy
    and sampled; (a') the same for a small model whose decode step takes about 10 ms, with a batch of 4;
(b) copies: one decode step's KV leaving as one staged block (buffered) or as one block per layer (naive);
(c) prefill: prompt blocks streamed layer by layer during the forward, or all after it;
(d) a long generation (thousands of steps): what replication adds per step near the start and at the end;
(e) what a user waits for: whole `engine.generate` calls, and the prompt alone, against `model.generate`
    (`dejavu_sdk.bench.whole_call`).
Every repeat measures every variant in turn, back to back, each repeat starting from the next variant;
overheads are the medians of the per-repeat ratios, with their range. The model of (a)-(c) is
SmolLM2-135M-Instruct when installed (a decode step takes tens of milliseconds on a small CPU), else a
random model of its shape.
"""

from __future__ import annotations

import contextlib
import resource
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from tqdm import tqdm
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import CacheLayerMixin

from ..backends import open_store
from ..blocks import KVSpec
from ..cache import STREAMER, CacheManager, StreamingCache
from ..engine import DejaVuEngine
from ..errors import ConfigError
from ..models import random_llama
from ..report import markdown_table
from ..store import Store
from ..stores.memory import MemoryStore
from ..stream import StagingBuffer, scatter
from ..testing.peers import ServedStoreProcess
from .common import machine_description, median, smollm2_or_its_shape
from .whole_call import WholeCallReport, run_whole_calls, whole_call_models, whole_call_runs

TARGETS = ("memory", "lmdb", "lmdb-nosync", "tcp")


#: The replica the long generation (d) streams to unless told otherwise: the cost that does not depend on
#: the disk, so that a growth in what each step writes shows.
LONG_STORE = "lmdb-nosync"
#: (a'): a model whose decode step takes about 10 ms on a fast core, with a batch of 4.
SMALL_MODEL: dict[str, Any] = {"layers": 6, "hidden_size": 512, "intermediate_size": 1024, "heads": 8, "kv_heads": 8,
               "vocab_size": 4096, "max_positions": 4096}
#: (d): a 4-layer model with a batch of 4, generating thousands of tokens.
LONG_MODEL: dict[str, Any] = {"layers": 4, "hidden_size": 256, "intermediate_size": 512, "heads": 4, "kv_heads": 4,
              "vocab_size": 4096, "max_positions": 8192}
BATCH = 4


@attrs.frozen
class StreamingReport:
    machine: str
    models: dict[str, str]  # "main", "small", "long": what each section ran
    prefill_store: str
    long_store: str
    samples: dict[str, list[float]]  # seconds, one per repeat
    long_steps: dict[str, list[list[float]]] = attrs.field(factory=dict)  # "off"/"on": per repeat, each step
    whole: WholeCallReport | None = None  # (e)

    def value(self, what: str) -> float:
        return median(self.samples[what])

    def ratios(self, what: str) -> list[float]:
        """`what` over the same generation unreplicated, repeat by repeat (each pair ran back to back)."""
        return [a / b for a, b in zip(self.samples[what], self.samples[f"{what}, off"], strict=True)]

    def to_json(self) -> dict:
        return {"machine": self.machine, "models": self.models, "prefill_store": self.prefill_store,
                "long_store": self.long_store, "samples_seconds": self.samples,
                "long_step_seconds": self.long_steps, "whole_calls": self.whole.to_json() if self.whole else None}

    def to_markdown(self, targets: tuple[str, ...]) -> str:
        whole = self.whole.to_markdown() if self.whole is not None else ""
        if not self.samples:  # --whole-only
            return f"Machine: {self.machine}\n\n{whole}"
        return self._sections_markdown(targets) + (f"\n{whole}" if whole else "")

    def _sections_markdown(self, targets: tuple[str, ...]) -> str:
        repeats = len(self.samples[f"decode sampled {self.prefill_store}"])
        parts = [f"Machine: {self.machine}\nModel: {self.models['main']}\n{repeats} repeats; each runs every replica "
                 "paired with the same generation unreplicated, back to back. Overheads are the median of the "
                 "per-repeat ratios, with their range; CPU is the whole process's, beyond the unreplicated run's.\n",
                 f"(a) Decode with replication:\n\n{self._decode_table('decode', targets)}\n",
                 "The same, sampling (temperature 0.8, top-p 0.9; the generator's state goes with every durable "
                 f"step):\n\n{self._decode_table('decode sampled', (self.prefill_store,), label='sampled, replica')}\n"]
        if any(what.startswith("small ") for what in self.samples):
            parts.append(f"(a') {self.models['small']}:\n\n{self._decode_table('small', targets)}\n")
        naive, buffered = self.value("copy naive"), self.value("copy buffered")
        copies = markdown_table(["one decode step's KV", "microseconds", "speed-up"],
                                [["naive: one block per layer", f"{naive * 1e6:.0f}", "1.0x"],
                                 ["buffered: staged, one block", f"{buffered * 1e6:.0f}", f"{naive / buffered:.1f}x"]])
        tail_after, tail_layerwise = self.value("prefill tail, after"), self.value("prefill tail, layer-wise")
        hidden = 1 - tail_layerwise / tail_after
        prefill = markdown_table(["prompt of the model", "forward ms", "then until every block is durable, ms"], [
            ["stream after the forward", f"{self.value('prefill forward, after') * 1e3:.1f}",
             f"{tail_after * 1e3:.1f}"],
            ["stream layer by layer", f"{self.value('prefill forward, layer-wise') * 1e3:.1f}",
             f"{tail_layerwise * 1e3:.1f}"]])
        parts += [f"(b) Buffered copies:\n\n{copies}\n",
                  f"(c) Prompt streaming to {self.prefill_store} ({hidden:.0%} of the streaming time hidden behind "
                  f"the forward):\n\n{prefill}\n"]
        if self.long_steps:
            parts.append(f"(d) A long generation, {self.models['long']}, replicating to {self.long_store}, "
                         f"{len(self.long_steps['off'])} repeats:\n\n{self._long_table()}\n")
        return "\n".join(parts)

    def _decode_table(self, prefix: str, targets: tuple[str, ...], label: str = "replica") -> str:
        """Step time and overhead per replica, and the CPU time the process spends per step beyond no
        replication (all threads: the model's, the streamer's, the kernel's work for them)."""
        offs = [seconds for target in targets for seconds in self.samples[f"{prefix} {target}, off"]]
        rows = [["none", f"{median(offs) * 1e3:.2f}", "", "", "", ""]]
        for target in targets:
            what = f"{prefix} {target}"
            ratios = self.ratios(what)
            user, kernel = (median([a - b for a, b in zip(self.samples[f"{what}, {kind} cpu"],
                                                          self.samples[f"{what}, off, {kind} cpu"], strict=True)])
                            for kind in ("user", "kernel"))
            rows.append([target, f"{self.value(what) * 1e3:.2f}", _percent(median(ratios) - 1),
                         f"{_percent(min(ratios) - 1)} to {_percent(max(ratios) - 1)}", f"{user * 1e3:+.2f}",
                         f"{kernel * 1e3:+.2f}"])
        return markdown_table([label, "ms per decode step", "overhead", "range over repeats",
                               "CPU ms per step: user", "kernel"], rows)

    def long_windows(self) -> dict[str, tuple[int, int]]:
        """The steps compared: near the start (after a few warm-up steps) and at the end."""
        steps = len(self.long_steps["off"][0])
        width = max(1, min(200, steps // 4))
        warm = min(5, steps - width)
        return {f"steps {warm}-{warm + width}": (warm, warm + width),
                f"steps {steps - width}-{steps}": (steps - width, steps)}

    def long_overheads(self) -> dict[str, tuple[list[float], list[float], list[float]]]:
        """Per window, one of each per repeat: on - off (seconds per step), on / off, and the CPU seconds the
        streamer thread spent per step (measured inside the replicated run, so no pairing noise)."""
        result = {}
        for window, (low, high) in self.long_windows().items():
            pairs = [(median(on[low:high]), median(off[low:high]))
                     for off, on in zip(self.long_steps["off"], self.long_steps["on"], strict=True)]
            streamer = [sum(steps[low:high]) / (high - low) for steps in self.long_steps["streamer cpu"]]
            result[window] = ([on - off for on, off in pairs], [on / off for on, off in pairs], streamer)
        return result

    def _long_table(self) -> str:
        rows, windows = [], self.long_windows()
        for window, (differences, ratios, streamer) in self.long_overheads().items():
            low, high = windows[window]
            off = median([median(steps[low:high]) for steps in self.long_steps["off"]])
            rows.append([window, f"{off * 1e3:.2f}", f"{median(streamer) * 1e6:.0f} ({min(streamer) * 1e6:.0f} to "
                         f"{max(streamer) * 1e6:.0f})", f"{median(differences) * 1e3:+.2f}",
                         f"{min(differences) * 1e3:+.2f} to {max(differences) * 1e3:+.2f}",
                         _percent(median(ratios) - 1)])
        return markdown_table(["decode steps", "ms per step, no replication", "streamer CPU µs per step",
                               "overhead ms per step", "range over repeats", "overhead"], rows)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:+.1f}%"


def plot_long_generation(report: StreamingReport, path: str, bucket: int = 100) -> None:
    """Per `bucket` steps of the long generation: the step time without replication, and what replication
    adds (one line per repeat); a flat second panel is a per-step cost that does not grow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, overheads, streamer) = plt.subplots(1, 3, figsize=(16, 4))
    for repeat, (off, on, cpu) in enumerate(zip(report.long_steps["off"], report.long_steps["on"],
                                                report.long_steps["streamer cpu"], strict=True)):
        starts = list(range(0, len(off) - bucket + 1, bucket))
        offs = [median(off[start:start + bucket]) * 1e3 for start in starts]
        ons = [median(on[start:start + bucket]) * 1e3 for start in starts]
        times.plot(starts, offs, color="tab:blue", alpha=0.6, label="no replication" if repeat == 0 else None)
        times.plot(starts, ons, color="tab:orange", alpha=0.6, label=report.long_store if repeat == 0 else None)
        overheads.plot(starts, [b - a for a, b in zip(offs, ons, strict=True)], label=f"repeat {repeat + 1}")
        streamer.plot(starts, [sum(cpu[start:start + bucket]) / bucket * 1e6 for start in starts],
                      label=f"repeat {repeat + 1}")
    times.set(xlabel="decode step", ylabel=f"ms per step (median of {bucket})", title="decode step time")
    overheads.axhline(0, color="black", linewidth=0.5)
    overheads.set(xlabel="decode step", ylabel="ms per step", title=f"replication to {report.long_store} adds")
    streamer.set(xlabel="decode step", ylabel=f"µs per step (mean of {bucket})", title="the streamer thread's CPU",
                 ylim=(0, None))
    for axis in (times, overheads, streamer):
        axis.legend()
    figure.suptitle(f"{report.models['long']} ({report.machine.split(',')[0]})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


class _StepClock(LogitsProcessor):
    """Timestamps every decode step, and reads the process's CPU time (user, kernel) at each."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.cpu: list[tuple[float, float]] = []
        self.streamer_cpu: list[float] = []  # the streamer thread's CPU clock at each step, while replicating
        self._streamer_clock: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu.append((usage.ru_utime, usage.ru_stime))
        if self._streamer_clock is None:
            streamer = next((thread for thread in threading.enumerate() if thread.name.startswith(STREAMER)), None)
            self._streamer_clock = time.pthread_getcpuclockid(streamer.ident) if streamer and streamer.ident else -1
        if self._streamer_clock != -1:
            self.streamer_cpu.append(time.clock_gettime(self._streamer_clock))
        return scores

    def streamer_cpu_steps(self) -> list[float]:
        """CPU seconds the stream's streamer thread spent between one decode step and the next."""
        return [b - a for a, b in zip(self.streamer_cpu, self.streamer_cpu[1:], strict=False)]

    def cpu_per_step(self) -> tuple[float, float]:
        """Seconds of user and kernel CPU time the whole process spent per decode step (all its threads)."""
        (user0, kernel0), (user1, kernel1) = self.cpu[0], self.cpu[-1]
        steps = len(self.cpu) - 1
        return (user1 - user0) / steps, (kernel1 - kernel0) / steps

    def durations(self) -> list[float]:
        """Seconds of each decode step (the first call comes after the prefill, so it starts the count)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]

    def step_seconds(self) -> float:
        return median(self.durations()[1:])


@contextlib.contextmanager
def _stores(targets: tuple[str, ...], scratch: str) -> Iterator[dict[str, Store]]:
    with contextlib.ExitStack() as stack:
        stores: dict[str, Store] = {}
        for target in targets:
            if target == "memory":
                stores[target] = MemoryStore()
            elif target in ("lmdb", "lmdb-nosync"):
                stores[target] = stack.enter_context(open_store(f"lmdb://{scratch}/{target}",
                                                                sync=target == "lmdb"))
            else:
                served = stack.enter_context(ServedStoreProcess(target, quiet=True))
                stores[target] = stack.enter_context(open_store(served.url))
        yield stores


#: The sampled variant of (a): nucleus sampling, whose generator state travels with every durable step.
SAMPLED = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}


def _generate(model: Any, ids: torch.Tensor, new_tokens: int, store: Store | None, sampled: bool) -> _StepClock:
    """Generate exactly `new_tokens` tokens, replicated to `store` (None: plain `model.generate`), timed."""
    clock = _StepClock()
    options: dict[str, Any] = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
               "logits_processor": LogitsProcessorList([clock]), **(SAMPLED if sampled else {"do_sample": False})}
    if store is None:
        torch.manual_seed(0)
        model.generate(ids, **options)
    else:
        DejaVuEngine(model, store=store).generate(ids, seed=0 if sampled else None, **options)
    return clock


def _layer_kv(model: Any, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], KVSpec]:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache)
    pairs = _kv_pairs(cache)
    keys = pairs[0][0]
    spec = KVSpec(layers=len(pairs), kv_heads=keys.shape[1], head_dim=keys.shape[-1], dtype=keys.dtype,
                  batch=keys.shape[0])
    return pairs, spec


def _kv_pairs(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) in a cache a forward has filled."""
    pairs = []
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise ConfigError(f"layer {index} of the model's cache holds no keys and values to stream")
        pairs.append((layer.keys, layer.values))
    return pairs


def _copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], spec: KVSpec, position: int) -> dict[str, float]:
    """One decode step's KV, as the model hands it over: one position of every layer, scattered in memory."""
    store, staging, layers = MemoryStore(), StagingBuffer(spec, (0, spec.layers)), (0, spec.layers)
    tokens = (position, position + 1)
    pairs = [(keys[:, :, position:position + 1], values[:, :, position:position + 1]) for keys, values in pairs]
    runs = 20

    def timed(buffered: bool) -> float:
        start = time.perf_counter()
        for _ in range(runs):
            scatter(store, "bench", pairs, layers, tokens, staging if buffered else None)
        return (time.perf_counter() - start) / runs

    return {"copy naive": timed(False), "copy buffered": timed(True)}


def _prefill(model: Any, ids: torch.Tensor, store: Store) -> dict[str, float]:
    """Prompt streaming after the forward (`prompt_streaming="after"`: every layer's block in one write once
    the last is made) vs during it: the time from the forward's end to the last durable block (the tail) is
    what streaming adds to time-to-replica; layer-wise streaming shrinks it, at the forward's expense where
    the streamer has no core of its own."""
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        start = time.perf_counter()
        manager = CacheManager(store, "layerwise", layers, queue_size=layers)
        model(ids, cache=StreamingCache(manager, config=model.config))
        forward_end = time.perf_counter()
        manager.finish()
        layerwise_end = time.perf_counter()

        begin = time.perf_counter()
        manager = CacheManager(store, "after", layers, prompt_streaming="after")
        model(ids, cache=StreamingCache(manager, config=model.config))
        middle = time.perf_counter()
        manager.finish()
        end = time.perf_counter()
    return {"prefill forward, after": middle - begin, "prefill forward, layer-wise": forward_end - start,
            "prefill tail, after": end - middle, "prefill tail, layer-wise": layerwise_end - forward_end}


def run_streaming_bench(targets: tuple[str, ...] = TARGETS, repeats: int = 5, prompt_tokens: int = 512,
                        new_tokens: int = 48, random_model: bool = False, small_tokens: int = 96,
                        long_tokens: int = 2000, long_repeats: int = 3, long_store: str = LONG_STORE,
                        whole_pairs: int = 7, whole_only: bool = False, progress: bool = True) -> StreamingReport:
    """Sections (a)-(c) `repeats` times, (a') with `small_tokens` new tokens (0: skip), (d) a generation
    of `long_tokens` tokens (0: skip) `long_repeats` times, and (e) `whole_pairs` pairs of whole calls for
    every store (0: skip); `whole_only`: (e) alone."""
    if whole_only:
        return _whole_only(targets, prompt_tokens, new_tokens, random_model, whole_pairs, progress)
    model, name = smollm2_or_its_shape(random_model)
    small = random_llama(**SMALL_MODEL, initializer_range=0.02) if small_tokens else None
    long = random_llama(**LONG_MODEL, initializer_range=0.02) if long_tokens else None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=generator)
    small_ids = torch.randint(0, SMALL_MODEL["vocab_size"], (BATCH, 64), generator=generator)
    samples: dict[str, list[float]] = defaultdict(list)
    long_steps: dict[str, list[list[float]]] = defaultdict(list)
    pairs, spec = _layer_kv(model, ids)
    runs = repeats * (2 * (len(targets) + 1) + 2 + (2 * len(targets) if small is not None else 0)) \
        + 2 * long_repeats * bool(long) + whole_call_runs(whole_pairs, len(targets))
    with tempfile.TemporaryDirectory(prefix="dejavu-bench-") as scratch, \
            _stores(tuple(dict.fromkeys((*targets, long_store))), scratch) as stores, \
            tqdm(total=runs, desc="bench streaming", unit="run", disable=not progress) as bar:
        prefill_target = "lmdb" if "lmdb" in targets else (targets[0] if targets else "memory")
        prefill_store = stores.get(prefill_target) or MemoryStore()
        pairs_to_run: list[tuple[str, Any, torch.Tensor, int, Store, bool]] = [
            *((f"decode {target}", model, ids, new_tokens, stores[target], False) for target in targets),
            (f"decode sampled {prefill_target}", model, ids, new_tokens, prefill_store, True)]
        if small is not None:
            pairs_to_run += [(f"small {target}", small, small_ids, small_tokens, stores[target], False)
                             for target in targets]
        for repeat in range(repeats):
            # Each replica runs back to back with the same generation unreplicated ("..., off"), in turns
            # first or second; each repeat starts with another pair, so a drift in the machine's speed
            # favours none.
            shift = repeat % len(pairs_to_run)
            for what, which, inputs, count, store, sampled in pairs_to_run[shift:] + pairs_to_run[:shift]:
                order: list[tuple[str, Store | None]] = [(what, store), (f"{what}, off", None)]
                for name_of_run, sink in order[repeat % 2:] + order[:repeat % 2]:
                    clock = _generate(which, inputs, count, sink, sampled)
                    samples[name_of_run].append(clock.step_seconds())
                    user, kernel = clock.cpu_per_step()
                    samples[f"{name_of_run}, user cpu"].append(user)
                    samples[f"{name_of_run}, kernel cpu"].append(kernel)
                    bar.update()
            for what, seconds in _copies(pairs, spec, prompt_tokens - 1).items():
                samples[what].append(seconds)
            bar.update()
            for what, seconds in _prefill(model, ids, prefill_store).items():
                samples[what].append(seconds)
            bar.update()
        if long is not None:
            long_ids = torch.randint(0, LONG_MODEL["vocab_size"], (BATCH, 32), generator=generator)
            for repeat in range(long_repeats):
                runs_of_long: list[tuple[str, Store | None]] = [("off", None), ("on", stores[long_store])]
                for what, sink in runs_of_long[repeat % 2:] + runs_of_long[:repeat % 2]:
                    clock = _generate(long, long_ids, long_tokens, sink, sampled=False)
                    long_steps[what].append(clock.durations())
                    if sink is not None:
                        long_steps["streamer cpu"].append(clock.streamer_cpu_steps())
                    bar.update()
        whole = run_whole_calls(whole_call_models(random_model, prompt_tokens), {t: stores[t] for t in targets},
                                new_tokens, whole_pairs, machine_description(), bar.update) if whole_pairs else None
    models = {"main": name, "small": _describe(SMALL_MODEL, "random weights"),
              "long": _describe(LONG_MODEL, f"{long_tokens} new tokens")}
    return StreamingReport(machine_description(), models, prefill_target, long_store, dict(samples),
                           dict(long_steps), whole)


def _whole_only(targets: tuple[str, ...], prompt_tokens: int, new_tokens: int, random_model: bool, pairs: int,
                progress: bool) -> StreamingReport:
    models = whole_call_models(random_model, prompt_tokens)
    with tempfile.TemporaryDirectory(prefix="dejavu-bench-") as scratch, _stores(targets, scratch) as stores, \
            tqdm(total=whole_call_runs(pairs, len(targets)), desc="bench streaming (e)", unit="call",
                 disable=not progress) as bar:
        whole = run_whole_calls(models, stores, new_tokens, pairs, machine_description(), bar.update)
    return StreamingReport(whole.machine, {}, "", "", {}, {}, whole)


def _describe(shape: dict[str, int], note: str) -> str:
    return (f"a Llama of {shape['layers']} layers, {shape['hidden_size']} wide, a batch of {BATCH} ({note}, "
            "float32)")
