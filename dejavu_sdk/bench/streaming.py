"""`dejavu bench streaming`: what streaming the KV cache costs a real model, and what the optimisations buy.

(a) decode: per-step latency with replication to each store, beside the same generation without it;
(b) copies: one decode step's KV leaving as one staged block (buffered) or as one block per layer (naive);
(c) prefill: prompt blocks streamed layer by layer during the forward, or all after it.
Every repeat measures every variant in turn, each repeat starting from the next variant; figures are
medians. The model is SmolLM2-135M-Instruct
when installed (a decode step takes tens of milliseconds on a small CPU), else a random model of its shape.
"""

from __future__ import annotations

import contextlib
import tempfile
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
from ..cache import CacheManager, StreamingCache
from ..engine import DejaVuEngine
from ..errors import ConfigError
from ..report import markdown_table
from ..store import Store
from ..stores.memory import MemoryStore
from ..stream import StagingBuffer, scatter
from ..testing.peers import ServedStoreProcess
from .common import machine_description, median

TARGETS = ("memory", "lmdb", "lmdb-nosync", "tcp")


@attrs.frozen
class StreamingReport:
    machine: str
    model: str
    prefill_store: str
    samples: dict[str, list[float]]  # seconds

    def value(self, what: str) -> float:
        return median(self.samples[what])

    def to_json(self) -> dict:
        return {"machine": self.machine, "model": self.model, "prefill_store": self.prefill_store,
                "samples_seconds": self.samples}

    def to_markdown(self, targets: tuple[str, ...]) -> str:
        off = self.value("decode off")
        rows = [["none", f"{off * 1e3:.2f}", "1.000"]]
        for target in targets:
            step = self.value(f"decode {target}")
            rows.append([target, f"{step * 1e3:.2f}", f"{step / off:.3f}"])
        decode = markdown_table(["replica", "ms per decode step", "vs no replication"], rows)
        sampled_off = self.value("decode sampled off")
        sampled = markdown_table(["sampled, replica", "ms per decode step", "vs no replication"], [
            ["none", f"{sampled_off * 1e3:.2f}", "1.000"],
            *([self.prefill_store, f"{self.value(what) * 1e3:.2f}", f"{self.value(what) / sampled_off:.3f}"]
              for what in (f"decode sampled {self.prefill_store}",))])
        naive, buffered = self.value("copy naive"), self.value("copy buffered")
        copies = markdown_table(["one decode step's KV", "microseconds", "speed-up"],
                                [["naive: one block per layer", f"{naive * 1e6:.0f}", "1.0x"],
                                 ["buffered: staged, one block", f"{buffered * 1e6:.0f}", f"{naive / buffered:.1f}x"]])
        tail_after, tail_layerwise = self.value("prefill tail, after"), self.value("prefill tail, layer-wise")
        hidden = 1 - tail_layerwise / tail_after
        prefill = markdown_table(["prompt of the model", "forward ms", "then until every block is durable, ms"], [
            ["stream after the forward", f"{self.value('prefill forward, plain') * 1e3:.1f}",
             f"{tail_after * 1e3:.1f}"],
            ["stream layer by layer", f"{self.value('prefill forward, layer-wise') * 1e3:.1f}",
             f"{tail_layerwise * 1e3:.1f}"]])
        return (f"Machine: {self.machine}\nModel: {self.model}\nMedians of {len(self.samples['decode off'])} "
                f"repeats.\n\n(a) Decode with replication:\n\n{decode}\n\nThe same, sampling (temperature 0.8, "
                f"top-p 0.9; the generator's state goes with every durable step):\n\n{sampled}\n\n"
                f"(b) Buffered copies:\n\n{copies}\n\n"
                f"(c) Prompt streaming to {self.prefill_store} ({hidden:.0%} of the streaming time hidden behind the "
                f"forward):\n\n{prefill}\n")


class _StepClock(LogitsProcessor):
    """Timestamps every decode step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores

    def step_seconds(self) -> float:
        return median([b - a for a, b in zip(self.stamps[1:], self.stamps[2:], strict=False)])


def _model(random_model: bool) -> tuple[Any, str]:
    from ..models import load_smollm2, random_llama, smollm2_available

    if not random_model and smollm2_available():
        return load_smollm2()[0], "SmolLM2-135M-Instruct (float32)"
    model = random_llama(layers=30, hidden_size=576, intermediate_size=1536, heads=9, kv_heads=3, vocab_size=49152,
                         max_positions=2048, initializer_range=0.02, pad_token_id=None, tie_embeddings=True)
    return model, "random weights in SmolLM2-135M's shape"


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


def _decode_step(model: Any, ids: torch.Tensor, new_tokens: int, store: Store | None, sampled: bool = False) -> float:
    clock = _StepClock()
    processors = LogitsProcessorList([clock])
    decoding = SAMPLED if sampled else {"do_sample": False}
    if store is None:
        torch.manual_seed(0)
        model.generate(ids, max_new_tokens=new_tokens, logits_processor=processors, **decoding)
    else:
        DejaVuEngine(model, store=store).generate(ids, max_new_tokens=new_tokens, logits_processor=processors,
                                                  seed=0 if sampled else None, **decoding)
    return clock.step_seconds()


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
    """Prompt streaming after the forward vs during it: the time from the forward's end to the last durable
    block (the tail) is what streaming adds to time-to-replica; layer-wise streaming shrinks it."""
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        start = time.perf_counter()
        manager = CacheManager(store, "layerwise", layers, queue_size=layers)
        model(ids, cache=StreamingCache(manager, config=model.config))
        forward_end = time.perf_counter()
        manager.finish()
        layerwise_end = time.perf_counter()

        cache = DynamicCache(config=model.config)
        begin = time.perf_counter()
        model(ids, cache=cache)
        middle = time.perf_counter()
        manager = CacheManager(store, "after", layers, queue_size=layers)
        for layer, (keys, values) in enumerate(_kv_pairs(cache)):
            manager.observe(layer, keys, values, 0)
        manager.finish()
        end = time.perf_counter()
    return {"prefill forward, plain": middle - begin, "prefill forward, layer-wise": forward_end - start,
            "prefill tail, after": end - middle, "prefill tail, layer-wise": layerwise_end - forward_end}


def run_streaming_bench(targets: tuple[str, ...] = TARGETS, repeats: int = 5, prompt_tokens: int = 512,
                        new_tokens: int = 48, random_model: bool = False, progress: bool = True) -> StreamingReport:
    model, name = _model(random_model)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    samples: dict[str, list[float]] = defaultdict(list)
    pairs, spec = _layer_kv(model, ids)
    with tempfile.TemporaryDirectory(prefix="dejavu-bench-") as scratch, _stores(targets, scratch) as stores, \
            tqdm(total=repeats * (len(targets) + 5), desc="bench streaming", unit="run", disable=not progress) as bar:
        prefill_target = "lmdb" if "lmdb" in stores else next(iter(stores), "memory")
        prefill_store = stores.get(prefill_target) or MemoryStore()
        variants: list[tuple[str, Store | None, bool]] = [
            ("off", None, False), *((target, store, False) for target, store in stores.items()),
            ("sampled off", None, True), (f"sampled {prefill_target}", prefill_store, True)]
        for repeat in range(repeats):
            # Each repeat starts with another variant, so a drift in the machine's speed favours none.
            for target, store, sampled in variants[repeat % len(variants):] + variants[:repeat % len(variants)]:
                samples[f"decode {target}"].append(_decode_step(model, ids, new_tokens, store, sampled))
                bar.update()
            for what, seconds in _copies(pairs, spec, prompt_tokens - 1).items():
                samples[what].append(seconds)
            bar.update()
            for what, seconds in _prefill(model, ids, prefill_store).items():
                samples[what].append(seconds)
            bar.update()
    return StreamingReport(machine_description(), name, prefill_target, dict(samples))
