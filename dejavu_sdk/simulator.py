"""A discrete-event simulator of three ways to serve with D machines, after the DejaVu paper's appendix.

Strategies:
    pipeline       one pipeline of depth D; prompts and tokens share every stage
    pipeline+dp    k pipelines of depth D/k (data parallelism), fed from one queue; the best k is kept
    disaggregated  a prompt pipeline of D_p machines and a token pipeline of D_t machines (the planner's
                   split); prefill runs `stream_overhead` times slower because it streams its KV cache

Requests arrive (Poisson, or all at once) and wait; a free pipeline slot takes up to `microbatch` of them.
A microbatch is batched statically, as in FasterTransformer: its prefill gives each request its first
token, then it runs decode steps until its longest request is done (early-stopping requests finish
sooner but keep their slot busy). A pipeline of depth d holds d microbatches, one per stage.

Each pass (a prefill or a decode step of one microbatch) takes Y/d or t/d on each of the d stages, and
stages serve passes first come, first served. Because every stage of a pipeline takes the same time for
a given pass, passes leave each stage in the order they entered the first, so one pass is simulated in
O(d) steps: that keeps a sweep over 16 machine counts and thousands of requests to seconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence

import attrs
import numpy as np

from .errors import ConfigError
from .planner import MemoryModel, best_split

STRATEGIES = ("pipeline", "pipeline+dp", "disaggregated")


@attrs.frozen
class Workload:
    """The requests to serve and the model's speed, one microbatch on the whole model."""

    prompt_time: float  # Y: one microbatch's prefill
    token_time: float  # t: one microbatch's decode step
    output_lengths: tuple[int, ...]  # tokens each request generates (>= 1)
    arrivals: tuple[float, ...]  # when each request arrives, sorted
    microbatch: int = 8
    stream_overhead: float = 1.0

    @property
    def steps_per_microbatch(self) -> float:
        """N for the planner: a statically batched microbatch decodes until its longest request is done."""
        lengths = self.output_lengths
        maxima = [max(lengths[i:i + self.microbatch]) for i in range(0, len(lengths), self.microbatch)]
        return float(np.mean(maxima))

    def __attrs_post_init__(self) -> None:
        if not self.prompt_time > 0 or not self.token_time > 0:
            raise ConfigError("prompt_time and token_time must be positive")
        if len(self.output_lengths) != len(self.arrivals) or not self.output_lengths:
            raise ConfigError("give one arrival time per request, and at least one request")
        if min(self.output_lengths) < 1:
            raise ConfigError("every request generates at least one token")
        if any(b < a for a, b in itertools.pairwise(self.arrivals)):
            raise ConfigError("arrival times must be sorted")
        if not isinstance(self.microbatch, int) or self.microbatch < 1:
            raise ConfigError(f"microbatch must be a positive integer, got {self.microbatch!r}")
        if not 1 <= self.stream_overhead < 2:
            raise ConfigError(f"stream_overhead must be in [1, 2), got {self.stream_overhead!r}")


def poisson_arrivals(count: int, rate: float | None, seed: int = 0) -> tuple[float, ...]:
    """`count` arrival times of a Poisson process of `rate` requests per second; all at 0 when rate is None."""
    if rate is None:
        return (0.0,) * count
    if not rate > 0:
        raise ConfigError(f"the arrival rate must be positive, got {rate!r}")
    gaps = np.random.default_rng(seed).exponential(1 / rate, count)
    return tuple(float(x) for x in np.cumsum(gaps) - gaps[0])


@attrs.frozen
class Outcome:
    """What one simulated run gives: makespan (first arrival to last token) and cost (machine-seconds)."""

    strategy: str
    machines: int
    makespan: float
    mean_latency: float
    layout: str  # e.g. "1 x 8 stages", "2 x 4 stages", "3 prompt + 5 token"

    @property
    def cost(self) -> float:
        return self.makespan * self.machines


class _Pipeline:
    """`depth` stages, each free from `free[s]` on; a pass occupies each stage in turn."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.free = [0.0] * depth

    def run(self, ready: float, stage_time: float) -> float:
        """Run one pass that can enter the first stage at `ready`; return when it leaves the last."""
        time = ready
        free = self.free
        for stage in range(self.depth):
            time = (time if time > free[stage] else free[stage]) + stage_time
            free[stage] = time
        return time


class _Requests:
    """The arrival queue: microbatches are taken from it in order, by whichever slot asks first."""

    def __init__(self, workload: Workload) -> None:
        self.arrivals = workload.arrivals
        self.lengths = workload.output_lengths
        self.next = 0
        self.finish = [math.nan] * len(self.arrivals)

    @property
    def exhausted(self) -> bool:
        return self.next >= len(self.arrivals)

    def take(self, time: float, size: int) -> list[int]:
        """The requests that have arrived by `time`, at most `size` (the caller waits for the first)."""
        end = self.next
        while end < len(self.arrivals) and end - self.next < size and self.arrivals[end] <= time:
            end += 1
        taken = list(range(self.next, end))
        self.next = end
        return taken

    def record(self, batch: list[int], prompt_done: float, steps_done: Sequence[float]) -> None:
        """Finish times of a microbatch's requests: prefill gives the first token, decode step k the k+1-th."""
        for request in batch:
            length = self.lengths[request]
            self.finish[request] = prompt_done if length == 1 else steps_done[length - 2]


@attrs.define
class _Slot:
    """A slot of a prompt (or mixed) pipeline is free to start a microbatch."""

    line: _Pipeline


@attrs.define
class _Prompted:
    """Disaggregated: a microbatch is prefilled and waits for a slot of the token pipeline `line`."""

    line: _Pipeline
    batch: list[int]
    steps: int


@attrs.define
class _TokenSlot:
    """Disaggregated: a slot of the token pipeline `line` may be free for a waiting microbatch."""

    line: _Pipeline


@attrs.define
class _Step:
    """A microbatch's next decode step may enter `line`; `done` holds when each earlier step finished."""

    line: _Pipeline
    batch: list[int]
    prompt_done: float
    steps: int
    done: list[float]


_Event = _Slot | _Prompted | _TokenSlot | _Step


def _simulate(workload: Workload, prompt_lines: Sequence[_Pipeline], token_lines: Sequence[_Pipeline] | None,
              ) -> tuple[float, float]:
    """Run the workload; return (makespan, mean latency).

    With `token_lines` None, each pipeline in `prompt_lines` does prefill and decode for its microbatches.
    Otherwise prefill runs on `prompt_lines[0]` and decode on `token_lines[0]` (disaggregated).
    """
    requests = _Requests(workload)
    counter = itertools.count()
    events: list[tuple[float, int, _Event]] = []  # (time, tie-break, event)
    if token_lines is None:
        token_line, prompt_scale, token_slots = None, 1.0, 0
    else:
        token_line, prompt_scale = token_lines[0], workload.stream_overhead
        token_slots = token_line.depth
    waiting_for_tokens: deque[tuple[float, list[int], int]] = deque()
    for line in prompt_lines:
        for _ in range(line.depth):
            heapq.heappush(events, (0.0, next(counter), _Slot(line)))
    while events:
        time, _, event = heapq.heappop(events)
        if isinstance(event, _Step):  # a decode step, or the microbatch is done and frees its slot
            done = event.done
            if len(done) == event.steps:
                requests.record(event.batch, event.prompt_done, done)
                if token_line is None:
                    heapq.heappush(events, (time, next(counter), _Slot(event.line)))
                else:
                    token_slots += 1
                    heapq.heappush(events, (time, next(counter), _TokenSlot(token_line)))
                continue
            line = event.line
            finished = line.run(time, workload.token_time / line.depth)
            done.append(finished)
            heapq.heappush(events, (finished, next(counter), event))
        elif isinstance(event, _Slot):  # a prompt slot is free: start the next microbatch, or wait for one to arrive
            line = event.line
            if requests.exhausted:
                continue
            if requests.arrivals[requests.next] > time:
                heapq.heappush(events, (requests.arrivals[requests.next], next(counter), event))
                continue
            batch = requests.take(time, workload.microbatch)
            prompt_done = line.run(time, prompt_scale * workload.prompt_time / line.depth)
            steps = max(requests.lengths[r] for r in batch) - 1
            if token_line is None:
                heapq.heappush(events, (prompt_done, next(counter), _Step(line, batch, prompt_done, steps, [])))
            else:
                heapq.heappush(events, (prompt_done, next(counter), event))
                heapq.heappush(events, (prompt_done, next(counter), _Prompted(token_line, batch, steps)))
        elif isinstance(event, _Prompted):
            waiting_for_tokens.append((time, event.batch, event.steps))
            heapq.heappush(events, (time, next(counter), _TokenSlot(event.line)))
        else:  # a token slot
            if token_slots == 0 or not waiting_for_tokens:
                continue
            token_slots -= 1
            prompt_done, batch, steps = waiting_for_tokens.popleft()
            heapq.heappush(events, (time, next(counter), _Step(event.line, batch, prompt_done, steps, [])))
    finish = np.asarray(requests.finish)
    arrivals = np.asarray(workload.arrivals)
    return float(finish.max() - arrivals.min()), float((finish - arrivals).mean())


def simulate_pipeline(workload: Workload, machines: int, replicas: int = 1) -> Outcome:
    """`replicas` pipelines of `machines // replicas` stages each (1 replica: the plain pipeline)."""
    if machines < 1 or replicas < 1 or machines % replicas:
        raise ConfigError(f"{machines} machines do not split into {replicas} equal pipelines")
    depth = machines // replicas
    makespan, latency = _simulate(workload, [_Pipeline(depth) for _ in range(replicas)], None)
    strategy = "pipeline" if replicas == 1 else "pipeline+dp"
    return Outcome(strategy, machines, makespan, latency, f"{replicas} x {depth} stages")


def simulate_disaggregated(workload: Workload, prompt_machines: int, token_machines: int) -> Outcome:
    """A prompt pipeline of `prompt_machines` stages feeding a token pipeline of `token_machines` stages."""
    if prompt_machines < 1 or token_machines < 1:
        raise ConfigError("a disaggregated deployment needs at least one prompt and one token machine")
    makespan, latency = _simulate(workload, [_Pipeline(prompt_machines)], [_Pipeline(token_machines)])
    return Outcome("disaggregated", prompt_machines + token_machines, makespan, latency,
                   f"{prompt_machines} prompt + {token_machines} token")


def compare(workload: Workload, machines: int, memory: MemoryModel | None = None) -> dict[str, Outcome | None]:
    """Each strategy's outcome on `machines` machines (None where memory or the machine count rules it out).

    pipeline+dp keeps the best number of replicas (at least 2) whose depth fits in memory; disaggregated
    uses the planner's best split for the workload's decode steps per microbatch, even where it would
    not split, so that a sweep shows what splitting costs there.
    """
    min_depth: float = 1
    if memory is not None:
        min_depth = memory.min_token_machines or math.inf
    results: dict[str, Outcome | None] = dict.fromkeys(STRATEGIES)
    if machines >= min_depth:
        results["pipeline"] = simulate_pipeline(workload, machines)
    replicated = [simulate_pipeline(workload, machines, k) for k in range(2, machines + 1)
                  if machines % k == 0 and machines // k >= min_depth]
    if replicated:
        results["pipeline+dp"] = min(replicated, key=lambda outcome: outcome.makespan)
    if machines >= 2:
        try:
            split = best_split(machines, workload.prompt_time, workload.token_time, workload.steps_per_microbatch,
                               workload.stream_overhead, memory=memory)
        except ConfigError:  # the token pipeline cannot fit on this few machines
            split = None
        if split is not None:
            results["disaggregated"] = simulate_disaggregated(workload, *split)
    return results
