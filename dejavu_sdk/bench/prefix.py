"""`dejavu bench prefix`: what prompt prefixes read from the KV tiers save a user of `DejaVuEngine`.

Three workloads, each run in every repeat by two engines back to back on the same model, one without a prefix
cache and one with `prefix_cache="memory://"` (fresh each repeat), alternating which goes first:
- chat: conversations built from the shipped Azure LLM inference trace 2023 (conversation; Microsoft Azure,
  CC-BY-4.0, see `dejavu_sdk/data/README.md`): consecutive trace rows are a conversation's turns, each turn's
  prompt the conversation so far (earlier messages and answers) followed by a new message of the row's
  `ContextTokens` (at most `message_tokens`), its answer `new_tokens` long; a conversation ends before its prompt
  would pass `context_tokens`. Token ids are drawn at random (seeded), answers included, so that both engines see
  the very same prompts whatever they generate.
- system: `requests` requests sharing one system prompt of `system_tokens` tokens, each with its own question.
- unique: `requests` prompts of `system_tokens` tokens sharing nothing: what keeping chunks costs when none is read.
Reported per workload: each request's time to first token (p50 over the requests; for chat, over the turns that
read at least `long_hit` positions from the cache, and over all of them) and the workload's tokens/s over its
whole run, each as the per-repeat ratio (without / with for times, with / without for tokens/s: above 1 is
better), median with the least and most. Beside them, each tier's cost to read a chunk (`chunk` positions of this
model's KV), per 1,000 positions, against computing those positions (the unique workload's prefill).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
from tqdm import tqdm

from ..backends import serve
from ..blocks import BlockKey
from ..engine import DejaVuEngine
from ..errors import ConfigError
from ..models import load_model
from ..prefix import CHUNK_POSITIONS, PrefixCache
from ..prefix.reuse import kv_spec_of
from ..report import markdown_table
from ..traces import load_trace
from .common import Spread, machine_description
from .prefix_runs import Run, Turn

WORKLOADS = ("chat", "system", "unique")
#: Chunks each tier reads in the tier measurement.
TIER_CHUNKS = 8


def chat_turns(vocab: int, message_tokens: int, context_tokens: int, new_tokens: int, conversations: int,
               seed: int = 0) -> list[Turn]:
    """The chat workload's requests, conversation after conversation (see the module)."""
    trace = load_trace()
    generator = torch.Generator().manual_seed(seed)
    turns, row = [], 0
    for _ in range(conversations):
        so_far: list[int] = []
        while True:
            message = max(8, min(message_tokens, int(trace.prompt_tokens[row % len(trace)])))
            row += 1
            if so_far and len(so_far) + message > context_tokens:
                break
            so_far += torch.randint(1, vocab, (message,), generator=generator).tolist()
            turns.append(Turn(tuple(so_far)))
            so_far += torch.randint(1, vocab, (new_tokens,), generator=generator).tolist()  # its answer
    return turns


def shared_turns(vocab: int, system_tokens: int, question_tokens: int, requests: int, shared: bool,
                 seed: int = 0) -> list[Turn]:
    """The system workload's requests (one system prompt, each its own question), or the unique one's."""
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(1, vocab, (system_tokens,), generator=generator).tolist()
    turns = []
    for _ in range(requests):
        head = system if shared else torch.randint(1, vocab, (system_tokens,), generator=generator).tolist()
        turns.append(Turn(tuple(head + torch.randint(1, vocab, (question_tokens,), generator=generator).tolist())))
    return turns


class _FirstToken:
    """A `model.generate` streamer that notes when the first new token comes (the prompt comes first)."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def run_workload(engine: DejaVuEngine, turns: Sequence[Turn], new_tokens: int) -> Run:
    """Send `turns` one after another to `engine` (greedy, `new_tokens` each, end-of-sequence ignored)."""
    first, cached, tokens = [], [], 0
    started = time.perf_counter()
    for turn in turns:
        streamer = _FirstToken()
        sent = time.perf_counter()
        out = engine.generate(torch.tensor([turn.ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              streamer=streamer)
        first.append((streamer.at or time.perf_counter()) - sent)
        cached.append(engine.cached_positions)
        tokens += out.shape[1] - len(turn.ids)
    return Run(tuple(first), tuple(cached), time.perf_counter() - started, tokens)


@attrs.define
class PrefixReport:
    """Per workload, per repeat, the run without and with the cache; each tier's read cost; the setting."""

    machine: str
    model: str
    settings: dict[str, Any]
    runs: dict[str, list[tuple[Run, Run]]] = attrs.field(factory=dict)
    tier_ms_per_1000: dict[str, list[float]] = attrs.field(factory=dict)
    compute_ms_per_1000: list[float] = attrs.field(factory=list)

    def ttft_ratios(self, workload: str, long_hit: int | None = None) -> Spread | None:
        """Per repeat, the p50 time to first token without the cache over with it, over the requests that read at
        least `long_hit` positions with it (all where None); None where no request did."""
        ratios = []
        for without, with_cache in self.runs[workload]:
            chosen = [index for index, cached in enumerate(with_cache.cached)
                      if long_hit is None or cached >= long_hit]
            if not chosen:
                return None
            ratios.append(statistics.median(without.first_token[i] for i in chosen)
                          / statistics.median(with_cache.first_token[i] for i in chosen))
        return Spread.of(ratios)

    def throughput_ratios(self, workload: str) -> Spread:
        return Spread.of([(with_cache.tokens / with_cache.seconds) / (without.tokens / without.seconds)
                          for without, with_cache in self.runs[workload]])

    def to_markdown(self) -> str:
        long_hit = self.settings["long_hit"]
        rows = []
        for workload, pairs in self.runs.items():
            long = self.ttft_ratios(workload, long_hit) if workload == "chat" else None
            last_without, last_with = pairs[-1]
            rows.append([workload, len(last_with.first_token),
                         f"{statistics.median(last_without.first_token):.2f} s / "
                         f"{statistics.median(last_with.first_token):.2f} s",
                         _text(self.ttft_ratios(workload)), _text(long), self.throughput_ratios(workload).text()])
        table = markdown_table(["workload", "requests", "TTFT p50 without / with (last repeat)",
                                "TTFT p50 ratio without/with", f"same, turns with >= {long_hit} cached positions",
                                "tokens/s ratio with/without"], rows)
        compute = Spread.of(self.compute_ms_per_1000).text(1) if self.compute_ms_per_1000 else "-"
        tiers = markdown_table(["tier", "reading 1,000 positions (ms)", "computing them (ms)"],
                               [[tier, Spread.of(values).text(1), compute]
                                for tier, values in self.tier_ms_per_1000.items()])
        return f"{self.machine}; {self.model}\n\n{table}\n\n{tiers}"

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "model": self.model, "settings": self.settings,
                "runs": {workload: [{"without": attrs.asdict(a), "with": attrs.asdict(b)} for a, b in pairs]
                         for workload, pairs in self.runs.items()},
                "tier_ms_per_1000": self.tier_ms_per_1000, "compute_ms_per_1000": self.compute_ms_per_1000}


def _text(spread: Spread | None) -> str:
    return "-" if spread is None else spread.text()


def tier_costs(model: Any, folder: str, chunk: int) -> dict[str, float]:
    """Milliseconds to read 1,000 positions of `model`'s KV from each tier (TIER_CHUNKS chunks of `chunk`)."""
    spec = kv_spec_of(model)
    blocks = [(BlockKey(f"prefix-bench{index}-L0-{spec.layers}", layers=(0, spec.layers),
                        tokens=(0, chunk)), torch.randn(spec.shape(spec.layers, chunk)).to(spec.torch_dtype))
              for index in range(TIER_CHUNKS)]
    costs = {}
    with serve("tcp://127.0.0.1:0", "memory://") as server:
        for name, url in (("memory://", "memory://"), ("lmdb://", f"lmdb://{folder}/lmdb"),
                          ("file://", f"file://{folder}/files"), ("tcp:// store server", server.url)):
            with PrefixCache(url, spec) as cache:
                cache.write(blocks)
                cache.drain()
                started = time.perf_counter()
                found = cache.read([key for key, _ in blocks])
                elapsed = time.perf_counter() - started
            if len(found) != TIER_CHUNKS:
                raise ConfigError(f"the {name} tier returned {len(found)} of {TIER_CHUNKS} chunks")
            costs[name] = 1000 * elapsed / (TIER_CHUNKS * chunk) * 1000
    return costs


def run_prefix_bench(model: Any, model_name: str, *, workloads: Sequence[str] = WORKLOADS, repeats: int = 3,
                     new_tokens: int = 8, message_tokens: int = 600, context_tokens: int = 2600,
                     conversations: int = 2, system_tokens: int = 1024, question_tokens: int = 32, requests: int = 4,
                     chunk: int = CHUNK_POSITIONS, long_hit: int = 2000, serve_stages: int | None = None,
                     progress: bool = True) -> PrefixReport:
    """Run the workloads (see the module) `repeats` times on `model` (loaded, or named as `load_model` names it);
    the report. `serve_stages`: send them to `dejavu serve` of `model_name` in that many mixed stages, started
    without and with `--prefix-cache memory://` for each workload (`prefix_served`), instead of `DejaVuEngine`."""
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown or not workloads:
        raise ConfigError(f"workloads are some of {', '.join(WORKLOADS)}, got {list(workloads)!r}")
    counts = {"repeats": repeats, "new_tokens": new_tokens, "message_tokens": message_tokens,
              "context_tokens": context_tokens, "conversations": conversations, "system_tokens": system_tokens,
              "question_tokens": question_tokens, "requests": requests, "chunk": chunk}
    if serve_stages is not None:
        counts["serve_stages"] = serve_stages
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(model, str):
        model = load_model(model)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    built: dict[str, Callable[[], list[Turn]]] = {
        "chat": lambda: chat_turns(vocab, message_tokens, context_tokens, new_tokens, conversations),
        "system": lambda: shared_turns(vocab, system_tokens, question_tokens, requests, shared=True),
        "unique": lambda: shared_turns(vocab, system_tokens, question_tokens, requests, shared=False)}
    settings = {"new_tokens": new_tokens, "message_tokens": message_tokens, "context_tokens": context_tokens,
                "conversations": conversations, "system_tokens": system_tokens, "question_tokens": question_tokens,
                "requests": requests, "chunk": chunk, "long_hit": long_hit, "repeats": repeats}
    if serve_stages is not None:
        settings["serve_stages"] = serve_stages
    report = PrefixReport(machine_description(), model_name, settings)
    runner = _engine_runner(model, chunk) if serve_stages is None else _served_runner(model_name, chunk, serve_stages)
    with tqdm(total=repeats * len(workloads) * 2, desc="prefix", unit="run", disable=not progress) as bar, \
            tempfile.TemporaryDirectory(prefix="dejavu-bench-prefix-") as folder:
        for repeat in range(repeats):
            for workload in workloads:
                turns = built[workload]()
                runs = {}
                for name in ("without", "with") if repeat % 2 == 0 else ("with", "without"):
                    with runner(name == "with") as run:
                        runs[name] = run(turns, new_tokens)
                    bar.update(1)
                    bar.set_postfix_str(f"{workload} {name}: {runs[name].seconds:.1f} s")
                report.runs.setdefault(workload, []).append((runs["without"], runs["with"]))
                if workload == "unique":
                    first = runs["without"].first_token
                    report.compute_ms_per_1000.append(1e6 * statistics.median(first) / len(turns[0].ids))
            for tier, cost in tier_costs(model, folder, chunk).items():
                report.tier_ms_per_1000.setdefault(tier, []).append(cost)
    return report


Runner = Callable[[bool], contextlib.AbstractContextManager[Callable[[Sequence[Turn], int], Run]]]


def _engine_runner(model: Any, chunk: int) -> Runner:
    """Workloads run by `DejaVuEngine` on `model`: one without a cache for every run, one with a fresh
    `prefix_cache="memory://"` for each."""
    plain = DejaVuEngine(model)

    @contextlib.contextmanager
    def runner(cached: bool) -> Iterator[Callable[[Sequence[Turn], int], Run]]:
        if not cached:
            yield functools.partial(run_workload, plain)
            return
        with DejaVuEngine(model, prefix_cache="memory://", prefix_chunk=chunk) as engine:
            yield functools.partial(run_workload, engine)

    return runner


def _served_runner(model_name: str, chunk: int, stages: int) -> Runner:
    """Workloads sent to `dejavu serve` of `model_name`, started for each run without or with
    `--prefix-cache memory://`."""
    from .prefix_served import served

    return lambda cached: served(model_name, "memory://" if cached else None, chunk, stages)


def plot_prefix_bench(report: PrefixReport, path: str) -> None:
    """Time to first token per chat turn without and with the cache (last repeat), against the positions read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    for axis, workload in zip(axes, ("chat", "system"), strict=True):
        if workload not in report.runs:
            axis.set_visible(False)
            continue
        without, with_cache = report.runs[workload][-1]
        turns = range(1, len(with_cache.first_token) + 1)
        axis.plot(turns, without.first_token, "o-", label="without prefix cache")
        axis.plot(turns, with_cache.first_token, "s-", label="prefix_cache='memory://'")
        for turn, cached, value in zip(turns, with_cache.cached, with_cache.first_token, strict=True):
            axis.annotate(str(cached), (turn, value), textcoords="offset points", xytext=(0, 6), fontsize=7)
        axis.set_xlabel("request (label: positions read from the cache)")
        axis.set_ylabel("time to first token (s)")
        axis.set_title(f"{workload} workload")
        axis.legend()
    stages = report.settings.get("serve_stages")
    through = "DejaVuEngine" if stages is None else f"dejavu serve, {stages} stage{'s' if stages > 1 else ''}"
    figure.suptitle(f"dejavu bench prefix: {report.model} ({through})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
