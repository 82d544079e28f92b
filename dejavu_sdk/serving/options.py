"""Every option of a `Pipeline` (and the controller's own), checked once, here, before any process starts.

`PipelineOptions.check(...)` hands each group of options to its record's check (`option_groups`), loads the
model once to read what the options depend on (its layers, tokens, KV geometry), asks the planner for a layout
when `machines=` is given, decides swapping when it is "auto", and returns one frozen record that the
pipeline's parts read. Every refusal is a `ConfigError` that says what to change.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..errors import ConfigError
from ..generation.adapters import adapter_for
from ..generation.batching import check_batching, check_max_prefill_tokens
from ..generation.decoding import TokenRules
from ..models import load_model
from ..planner import Plan
from ..planner import plan as make_plan
from ..swapping import (
    SwapChoice,
    check_budget,
    check_swapping,
    choose_swapping,
    kv_bytes_per_token,
    measure_host_bandwidth,
    positions_needed,
)
from ..timing import measure_times
from .defaults import Defaults, Machine
from .layout import Layout, pipelines_for
from .option_groups import Links, Memory, Prefixes, Resilience, Watch, positive_integer
from .processes.launchers import Launcher, LocalProcesses

log = logging.getLogger(__name__)

#: A joining prompt's positions run per step beside decoding rows, by default (vLLM's chunked-prefill budget).
DEFAULT_PREFILL_TOKENS = 256
#: The smallest body cap a controller takes.
MIN_BODY_BYTES = 1024


@attrs.frozen
class PipelineOptions:
    """A pipeline's checked options, grouped: its links (`links`), failure detection (`watch`), recovery
    (`resilience`) and KV memory (`memory`), beside the layout and the batching. The layout's (`stages`,
    `layers`, `prompt_stages`, `token_stages`, `token_slots`, `machines`, `plan`, `workload`) and `microbatch`
    are described on `Pipeline`; the others, as `Pipeline` takes them:

    `kv_budget_bytes`: device memory each stage may give its microbatches' KV caches (None: no cap); a new
    microbatch starts only once its cache fits (as many of its rows as fit) beside those in flight, and a request
    that could never fit, even alone, is refused as it is submitted (`RequestTooLarge`).
    `swapping=True` keeps the decoding stages' caches in host memory with two on the device, brought in while
    the previous microbatch computes, so about twice as many fit; `"auto"` swaps when the in-flight
    microbatches of the `workload` would not fit, the stages run on a GPU and the planner's condition says
    the copies keep up, from a step time and host bandwidth measured here (`memory.swap_choice` says what it
    chose and why).

    `transport`: how activations and KV move (`tcp`, `gloo`, `nccl`, `ucx`). `timeout`: seconds any one wait
    for a worker may take (to start, to answer, to take a message). `progress_timeout`: seconds a microbatch in
    flight may go without a new token while no stage computes (a stage dead or stuck somewhere: its requests
    fail with `TransportError`, or a recovery starts); a stage deep in a long prompt says so in its heartbeats
    (the layers it has run), so slow work is never taken for a failure.
    `heartbeat`: seconds between each worker's heartbeats (sent from a thread of their own); a worker that
    misses `missed_beats` in a row (a process stopped or hung, or gone) fails the requests in flight.
    `recovery`: what a dead or hung stage costs. None (default): the requests in flight fail with
    `TransportError`. `"replicas"`: each decoding stage writes its slots' caches to the next decoding stage's
    memory (a ring; needs two decoding stages or more), and a dead stage is replaced by a new process that gets its
    caches back from there: every slot resumes from its last reported round (`recoveries` describes each
    recovery). `"recompute"`: the stage is replaced and the slots it held are computed again (below). Either way
    every request completes with the tokens it would have had without the failure.
    `"auto"`: from replicas where the layout allows it, else by recomputing, else None.
    `replica_store`: with recovery from replicas, a store every stage process reaches (`file://` on a shared
    file system, `s3://`, ...) that keeps the replicas instead of the next decoding stage: they outlive any
    stage, so even two neighbouring stages lost at once resume from there (and one decoding stage is enough).
    `standby`: spare worker processes kept with the model loaded, so that a replacement starts at once (the
    pool is topped up after each recovery; 0: a replacement process starts when needed).
    `on_recovery(report)` is called after each recovery (on its thread).
    `batching`: `"continuous"` (the default) refills each microbatch, a slot of up to `microbatch` rows,
    between steps: a row that ended leaves at the next step and a waiting request joins, its prompt prefilled
    beside the slot's decode steps, at most `max_prefill_tokens` positions (rows x prompt columns) a step while
    rows decode (None: all at once); each `Result.schedule` records the slot's rounds. `"static"`: a slot takes
    one microbatch at once, its prompts prefilled `max_prefill_tokens` positions a step too (so that a long
    prompt never holds a stage for long), and keeps its ended rows as padding until its last row ends, as
    `model.generate(..., prefill_chunk_size=max_prefill_tokens // rows)` runs a batch (one step, as plain
    `generate`, when the prompts fit or with None; its results carry no schedule). With `recovery="replicas"` a
    slot goes on from right after its last round the head heard of, as it stood then (each stage writes a round to its
    replica before passing it on); with `"recompute"` a lost continuous slot's rows run again from their prompts
    and the tokens already streamed (each still equals the replay of its `Result.schedule`), and a lost static
    slot's microbatch starts over, each row where it sat (each still equals `model.generate` on it).
    `prefix_cache`: tiers (store URLs, fastest first, such as `["memory://?max_bytes=2GiB", "lmdb:///var/kv"]`)
    where each stage keeps its layers' KV of every prompt in chunks of `prefix_chunk` positions keyed by their
    tokens (`dejavu_sdk.prefix`), and from which a prompt prefilled alone starts (continuous batching then takes
    waiting prompts into a slot one at a time): the stages read the chunks every one of them holds, and prefill the
    rest a chunk a round (`max_prefill_tokens` is `prefix_chunk`). Each `Result.cached_positions` says what its
    prompt read, and `replay` of its schedule computes those chunks as they were kept. `submit(...,
    cache_salt=...)` keeps tenants apart. A slot's replica does not hold the positions read yet: `recovery="auto"`
    recovers by recomputing, and `"replicas"` is refused.
    `ignore_eos`: every request generates its `max_new_tokens` (benchmarks, as vLLM's `ignore_eos`).
    `threads`: torch threads per stage process, fixed (default: this machine's cores shared between the stages,
    each following the cores the other processes leave idle: `serving.defaults`).
    `launch`: True starts the stage workers as processes of this machine; a `Launcher` starts them its way
    (`dejavu_sdk.cluster.ray.RayWorkers`: Ray actors); False starts none (workers join from elsewhere).
    `orphan_timeout`: seconds a worker whose head is gone keeps its stage loaded, asking the head's address to
    take it back (a successor started there, as a controller with a journal is), before it stops (0: at once).
    `replica_prefix`: what the names of its replica streams start with (default: drawn, so that pipelines can
    share a replica store); a successor head takes its predecessor's, to find the replicas its workers hold.
    `host`/`port`: where the head listens for its workers. `token`: the shared secret of every link (default:
    `DEJAVU_TOKEN`, else a random one handed to the workers it launches). `link_tls_cert`, `link_tls_key`,
    `link_tls_ca`: TLS on every link of the pipeline (`links.tls`; tcp only).
    """

    model: str
    layout: Layout
    plan: Plan | None
    microbatch: int
    token_slots: int
    threads: int
    launcher: Launcher | None
    rules: TokenRules
    eos: list[int]
    links: Links
    watch: Watch
    resilience: Resilience
    memory: Memory
    batching: str
    max_prefill_tokens: int | None
    defaults: Defaults
    prefixes: Prefixes

    @classmethod
    def check(cls, model: str, stages: int | None = None, *, layers: Sequence[tuple[int, int]] | None = None,
              prompt_stages: int | None = None, token_stages: int | None = None, token_slots: int | None = None,
              machines: int | None = None, plan: str = "auto", workload: tuple[int, int] = (256, 64),
              microbatch: int | None = None, kv_budget_bytes: int | None = None, swapping: bool | str = "auto",
              ignore_eos: bool = False, threads: int | None = None, launch: bool | Launcher = True,
              batching: str | None = None, max_prefill_tokens: int | None = DEFAULT_PREFILL_TOKENS,
              **grouped: Any) -> PipelineOptions:
        """The options, checked; `grouped` are the keywords of `Links`, `Watch` and `Resilience`, each group
        checking its own."""
        links_given, watch_given, resilience_given, prefixes_given = _split(grouped, Links.check, Watch.check,
                                                                            Resilience.check, Prefixes.check)
        prefixes = Prefixes.check(**prefixes_given)
        if prefixes.tiers:
            resilience_given = _recovery_with_prefixes(resilience_given)
        links = Links.check(launch, **links_given)
        if microbatch is not None:
            positive_integer(microbatch, "microbatch")
        if threads is not None:
            positive_integer(threads, "threads")
        watch = Watch.check(**watch_given)
        budget = check_budget(kv_budget_bytes)
        check_swapping(swapping)
        reference = load_model(model, weights=False)  # ConfigError for a bad name, before any process starts
        weighted = functools.cache(lambda: load_model(model))  # what is measured here needs the weights
        total = len(adapter_for(reference).decoder_layers())  # ConfigError for an architecture without an adapter
        machine = Machine.here()
        dtype = next(reference.parameters()).dtype
        chosen: Plan | None = None
        if machines is not None:
            if stages is not None or layers is not None or prompt_stages is not None or token_stages is not None:
                raise ConfigError("machines= lets the planner choose the stages: give it alone, or give stages= "
                                  "(mixed) or prompt_stages= and token_stages= (disaggregated) instead")
            plan_threads: int | None = threads  # the planner times the threads the stages start with
            if isinstance(machines, int) and not isinstance(machines, bool) and machines > 0:
                # the planner times a microbatch of the rows and threads the stages will have
                share = -(-total // machines)
                planned = Defaults.of(machine, threads, microbatch, kv_bytes_per_token(reference.config, dtype, share),
                                      positions_needed(*check_workload(workload)), 2 * machines, machines, budget)
                microbatch, plan_threads = planned.rows, planned.threads
            chosen = plan_for(weighted(), machines, plan, workload, microbatch or 1, plan_threads)
            if chosen.disaggregate:
                prompt_stages, token_stages = chosen.prompt_machines, chosen.token_machines
            else:
                stages = machines
        pipelines = pipelines_for(stages, layers, prompt_stages, token_stages, total)
        slots = _token_slots(token_slots, pipelines)
        processes = sum(map(len, pipelines))
        widest = max(stop - start for start, stop in pipelines[-1])
        per_token = kv_bytes_per_token(reference.config, dtype, widest)
        defaults = Defaults.of(machine, threads, microbatch, per_token, positions_needed(*check_workload(workload)),
                               2 * len(pipelines[-1]), processes, budget)
        threads, microbatch = defaults.threads, defaults.rows
        choice: SwapChoice | None = None
        if swapping == "auto":
            limit = slots if len(pipelines) == 2 else len(pipelines[0])
            choice = _choose_swapping(weighted, workload, microbatch, widest / total, budget, per_token, limit,
                                      threads)
            log.info("swapping %s: %s", "on" if choice.swapping else "off", choice.reason)
        memory = Memory(budget, choice.swapping if choice is not None else bool(swapping), choice, per_token)
        resilience = Resilience.check(links.transport, pipelines, launch, **resilience_given)
        rules = TokenRules.of(reference)
        chosen_batching = check_batching("continuous" if batching is None else batching)
        prefill_tokens = check_max_prefill_tokens(max_prefill_tokens)
        if prefixes.tiers:
            _check_prefixes(prefixes, prefill_tokens, len(pipelines) == 2)
        ring = resilience.recovery == "replicas" and resilience.replica_store is None
        return cls(model, Layout(pipelines, ring=ring), chosen, microbatch, slots, threads,
                   LocalProcesses() if launch is True else (launch or None), rules, [] if ignore_eos else rules.eos,
                   links, watch, resilience, memory, chosen_batching, prefill_tokens, defaults, prefixes)


def _recovery_with_prefixes(given: dict[str, Any]) -> dict[str, Any]:
    """The recovery of a pipeline that reads prompt prefixes: a slot's replica does not hold the prompt positions
    read from the tiers yet, so "auto" recovers by recomputing (each row's prompt read again), and "replicas" is
    refused."""
    recovery = given.get("recovery")
    if recovery == "replicas":
        raise ConfigError("recovery='replicas' with prefix_cache: a slot's replica does not hold the prompt positions "
                          "read from the tiers yet; use recovery='recompute' (or 'auto')")
    return {**given, "recovery": "recompute"} if recovery == "auto" else given


def _check_prefixes(prefixes: Prefixes, prefill_tokens: int | None, disaggregated: bool) -> None:
    """ConfigError where prompt prefixes cannot be served as asked: a joining prompt is prefilled a chunk a round
    (so each chunk kept is what computing it a chunk at a time makes), and a prompt pipeline reads none yet."""
    if prefill_tokens != prefixes.chunk:
        raise ConfigError(f"max_prefill_tokens={prefill_tokens!r} with prefix_chunk={prefixes.chunk}: a prompt is "
                          f"prefilled a chunk a round with a prefix cache (give max_prefill_tokens={prefixes.chunk})")
    if disaggregated:
        raise ConfigError("prefix_cache with a prompt pipeline (prompt_stages=): its stages read and keep no "
                          "prefix chunks yet; serve the model mixed (stages=) to read them")


def check_body_limit(max_body_bytes: Any) -> int:
    """The controller's cap on a request body, in bytes."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < MIN_BODY_BYTES:
        raise ConfigError(f"max_body_bytes must be an integer of at least {MIN_BODY_BYTES}, got {max_body_bytes!r}")
    return max_body_bytes


def plan_for(model: Any, machines: Any, plan: str, workload: tuple[int, int], microbatch: int,
             threads: int | None) -> Plan:
    """The planner's choice for `machines` stage processes, from this machine's measured prompt time Y and
    token time t of `model` on a microbatch of the `workload`'s (prompt tokens, new tokens), timed with the
    threads each stage process will have (on one machine, its share of the cores)."""
    if plan != "auto":
        raise ConfigError(f"plan={plan!r}: the only plan is 'auto' (the planner chooses from measured Y and t)")
    if isinstance(machines, bool) or not isinstance(machines, int) or machines < 1:
        raise ConfigError(f"machines must be a positive integer, got {machines!r}")
    prompt_tokens, new_tokens = check_workload(workload)
    if machines == 1:
        return Plan(False, 0, 0, 1.0, "Keep one mixed pipeline: one machine cannot be split.", 1.0, 1.0,
                    float("inf"))
    prompt_time, token_time = measure_times(model, microbatch, prompt_tokens,
                                            threads=threads or max(1, (os.cpu_count() or 1) // machines))
    return make_plan(machines, prompt_time, token_time, new_tokens)


def check_workload(workload: Any) -> tuple[int, int]:
    pair = tuple(workload) if isinstance(workload, (tuple, list)) else ()
    if len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in pair):
        raise ConfigError(f"workload is (prompt tokens, new tokens) of a typical request, got {workload!r}")
    return pair[0], pair[1]


def _choose_swapping(weighted: Callable[[], Any], workload: Any, microbatch: int, share: float, budget: int | None,
                     per_token: int, limit: int, threads: int) -> SwapChoice:
    """Swap when the `limit` in-flight microbatches of the workload would not fit in the budget, the stages'
    device is not the host, and the copies keep up with a decoding stage's step (timed on the whole model,
    `weighted()`, here, scaled to the stage's `share` of layers). The weights are read only when the budget
    leaves a choice."""
    prompt_tokens, new_tokens = check_workload(workload)
    alone = positions_needed(prompt_tokens, new_tokens) * per_token
    fits_without = budget is None or limit * microbatch * alone <= budget

    def device() -> torch.device:
        return next(weighted().parameters()).device  # where stage processes load the model too

    def measure() -> tuple[float, float]:
        _, token_time = measure_times(weighted(), microbatch, prompt_tokens, threads=threads)
        return token_time * share, measure_host_bandwidth(device(), microbatch * alone)

    return choose_swapping(fits_without=fits_without, batch=microbatch, prompt_tokens=prompt_tokens,
                           new_tokens=new_tokens, cache_bytes_per_token=per_token,
                           device_is_host=fits_without or device().type != "cuda",
                           two_slots=budget is None or 2 * alone <= budget, measure=measure)


def _token_slots(token_slots: Any, pipelines: list[list[tuple[int, int]]]) -> int:
    depth, disaggregated = len(pipelines[-1]), len(pipelines) == 2
    if token_slots is None:
        return depth + len(pipelines[0]) if disaggregated else depth
    if isinstance(token_slots, bool) or not isinstance(token_slots, int) or token_slots < depth:
        raise ConfigError(f"token_slots must be an integer of at least {depth} (one microbatch per token "
                          f"stage), got {token_slots!r}")
    if token_slots != depth and not disaggregated:
        raise ConfigError("token_slots applies to disaggregated pipelines (prompt_stages= and token_stages=)")
    return token_slots


def _split(given: dict[str, Any], *checks: Callable[..., Any]) -> list[dict[str, Any]]:
    """`given`'s keywords by the check (of `checks`) that takes each as a keyword-only parameter; a keyword none
    takes is a TypeError, as a call with an unknown keyword is."""
    names = [{name for name, parameter in inspect.signature(check).parameters.items()
              if parameter.kind is inspect.Parameter.KEYWORD_ONLY} for check in checks]
    unknown = sorted(name for name in given if not any(name in parameters for parameters in names))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    return [{name: value for name, value in given.items() if name in parameters} for parameters in names]
