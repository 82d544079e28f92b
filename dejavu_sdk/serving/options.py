"""Every option of a `Pipeline` (and the controller's own), checked once, here, before any process starts.

`PipelineOptions.check(...)` loads the model once to read what the options depend on (its layers, tokens,
KV geometry), asks the planner for a layout when `machines=` is given, decides swapping when it is "auto", and
returns one frozen record that the pipeline's parts read. Every refusal is a `ConfigError` that says what to
change.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..backends import open_store
from ..errors import ConfigError
from ..generation.adapters import adapter_for
from ..generation.batching import check_batching, check_max_prefill_tokens
from ..generation.decoding import TokenRules
from ..models import load_model
from ..planner import Plan
from ..planner import plan as make_plan
from ..store import Store
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
from ..transports.access import TOKEN_VARIABLE
from .layout import Layout, pipelines_for
from .processes.launchers import Launcher, LocalProcesses
from .wire.link_tls import LinkTls

log = logging.getLogger(__name__)

#: The transports a pipeline's links can use.
TRANSPORTS = ("tcp", "gloo", "nccl", "ucx")
#: The ways a pipeline may recover from a dead stage.
RECOVERY = ("replicas", "recompute")
#: The transports whose links reconnect to a stage's replacement (each link its own connection, or its own
#: two-rank gloo group); NCCL's communicators are not torn down and rebuilt around a hung peer yet.
RECOVERABLE_TRANSPORTS = ("tcp", "gloo", "ucx")
#: A joining prompt's positions run per step beside decoding rows, by default (vLLM's chunked-prefill budget).
DEFAULT_PREFILL_TOKENS = 256
#: Seconds a worker whose head is gone waits for a successor to take its stage back (`orphan_timeout`).
ORPHAN_TIMEOUT = 60.0
#: Seconds a microbatch may go without a token while no stage computes before its stage counts as stuck.
PROGRESS_TIMEOUT = 60.0
#: The smallest body cap a controller takes.
MIN_BODY_BYTES = 1024


@attrs.frozen
class PipelineOptions:
    """A pipeline's checked options. The layout's (`stages`, `layers`, `prompt_stages`, `token_stages`,
    `token_slots`, `machines`, `plan`, `workload`) and `microbatch` are described on `Pipeline`; the others:

    `kv_budget_bytes`: device memory each stage may give its microbatches' KV caches (None: no cap); a new
    microbatch starts only once its cache fits (as many of its rows as fit) beside those in flight, and a request
    that could never fit, even alone, is refused as it is submitted (`RequestTooLarge`).
    `swapping=True` keeps the decoding stages' caches in host memory with two on the device, brought in while
    the previous microbatch computes, so about twice as many fit; `"auto"` swaps when the in-flight
    microbatches of the `workload` would not fit, the stages run on a GPU and the planner's condition says
    the copies keep up, from a step time and host bandwidth measured here (`swap_choice` says what it chose
    and why).

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
    one microbatch at once, prefilled in one step, and keeps its ended rows as padding until its last row ends,
    as `model.generate` runs a batch (its results carry no schedule). With `recovery="replicas"` a slot goes
    on from right after its last round the head heard of, as it stood then (each stage writes a round to its
    replica before passing it on); with `"recompute"` a lost continuous slot's rows run again from their prompts
    and the tokens already streamed (each still equals the replay of its `Result.schedule`), and a lost static
    slot's microbatch starts over, each row where it sat (each still equals `model.generate` on it).
    `ignore_eos`: every request generates its `max_new_tokens` (benchmarks, as vLLM's `ignore_eos`).
    `threads`: torch threads per stage process (default: this machine's cores shared between the stages).
    `launch`: True starts the stage workers as processes of this machine; a `Launcher` starts them its way
    (`dejavu_sdk.cluster.ray.RayWorkers`: Ray actors); False starts none (workers join from elsewhere).
    `orphan_timeout`: seconds a worker whose head is gone keeps its stage loaded, asking the head's address to
    take it back (a successor started there, as a controller with a journal is), before it stops (0: at once).
    `replica_prefix`: what the names of its replica streams start with (default: drawn, so that pipelines can
    share a replica store); a successor head takes its predecessor's, to find the replicas its workers hold.
    `host`/`port`: where the head listens for its workers. `token`: the shared secret of every link (default:
    `DEJAVU_TOKEN`, else a random one handed to the workers it launches). `link_tls_cert`, `link_tls_key`,
    `link_tls_ca`: TLS on every link of the pipeline (`link_tls`; tcp only).
    """

    model: str
    layout: Layout
    plan: Plan | None
    microbatch: int
    token_slots: int
    kv_budget: int | None
    swapping: bool
    swap_choice: SwapChoice | None
    transport: str
    timeout: float
    heartbeat: float
    missed_beats: int
    recovery: str | None
    replica_store: Store | None
    replica_prefix: str
    standby: int
    threads: int
    launcher: Launcher | None
    host: str
    port: int
    token: str
    rules: TokenRules
    eos: list[int]
    kv_bytes_per_token: int
    batching: str = "static"
    max_prefill_tokens: int | None = None
    link_tls: LinkTls | None = None
    orphan_timeout: float = ORPHAN_TIMEOUT
    progress_timeout: float = PROGRESS_TIMEOUT

    @classmethod
    def check(cls, model: str, stages: int | None = None, *, layers: Sequence[tuple[int, int]] | None = None,
              prompt_stages: int | None = None, token_stages: int | None = None, token_slots: int | None = None,
              machines: int | None = None, plan: str = "auto", workload: tuple[int, int] = (256, 64),
              microbatch: int = 4, kv_budget_bytes: int | None = None, swapping: bool | str = "auto",
              transport: str = "tcp", timeout: float = 60.0, heartbeat: float = 1.0, missed_beats: int = 3,
              recovery: str | None = None, replica_store: str | None = None, standby: int = 0,
              ignore_eos: bool = False, threads: int | None = None, launch: bool | Launcher = True,
              host: str = "127.0.0.1", port: int = 0, token: str | None = None, batching: str | None = None,
              max_prefill_tokens: int | None = DEFAULT_PREFILL_TOKENS, link_tls_cert: str | None = None,
              link_tls_key: str | None = None, link_tls_ca: str | None = None,
              orphan_timeout: float = ORPHAN_TIMEOUT, replica_prefix: str | None = None,
              progress_timeout: float = PROGRESS_TIMEOUT) -> PipelineOptions:
        if transport not in TRANSPORTS:
            raise ConfigError(f"transport={transport!r}: pipelines run over {', '.join(TRANSPORTS)}")
        link_tls = LinkTls.of(link_tls_cert, link_tls_key, link_tls_ca, transport)
        _positive_integer(microbatch, "microbatch")
        _seconds(timeout, "timeout")
        _seconds(heartbeat, "heartbeat", most=60)
        _positive_integer(missed_beats, "missed_beats")
        _seconds(orphan_timeout, "orphan_timeout", zero=True)
        _seconds(progress_timeout, "progress_timeout")
        if progress_timeout <= heartbeat:
            raise ConfigError(f"progress_timeout={progress_timeout!r} must be longer than a heartbeat "
                              f"({heartbeat!r} s): heartbeats say whether a stage computes")
        budget = check_budget(kv_budget_bytes)
        check_swapping(swapping)
        reference = load_model(model, weights=False)  # ConfigError for a bad name, before any process starts
        weighted = functools.cache(lambda: load_model(model))  # what is measured here needs the weights
        total = len(adapter_for(reference).decoder_layers())  # ConfigError for an architecture without an adapter
        chosen: Plan | None = None
        if machines is not None:
            if stages is not None or layers is not None or prompt_stages is not None or token_stages is not None:
                raise ConfigError("machines= lets the planner choose the stages: give it alone, or give stages= "
                                  "(mixed) or prompt_stages= and token_stages= (disaggregated) instead")
            chosen = plan_for(weighted(), machines, plan, workload, microbatch, threads)
            if chosen.disaggregate:
                prompt_stages, token_stages = chosen.prompt_machines, chosen.token_machines
            else:
                stages = machines
        pipelines = pipelines_for(stages, layers, prompt_stages, token_stages, total)
        slots = _token_slots(token_slots, pipelines)
        threads = threads or max(1, (os.cpu_count() or 1) // sum(map(len, pipelines)))
        widest = max(stop - start for start, stop in pipelines[-1])
        per_token = kv_bytes_per_token(reference.config, next(reference.parameters()).dtype, widest)
        choice: SwapChoice | None = None
        if swapping == "auto":
            limit = slots if len(pipelines) == 2 else len(pipelines[0])
            choice = _choose_swapping(weighted, workload, microbatch, widest / total, budget, per_token, limit,
                                      threads)
            log.info("swapping %s: %s", "on" if choice.swapping else "off", choice.reason)
        swaps = choice.swapping if choice is not None else bool(swapping)
        recovery = check_recovery(recovery, transport, pipelines, replica_store is not None)
        if isinstance(standby, bool) or not isinstance(standby, int) or standby < 0:
            raise ConfigError(f"standby must be a number of spare workers (0 or more), got {standby!r}")
        if standby and (recovery is None or not launch):
            raise ConfigError("standby workers replace dead stages: give recovery=, and let the pipeline launch them")
        if not launch and not (token or os.environ.get(TOKEN_VARIABLE)):
            raise ConfigError(f"launch=False: workers started elsewhere must present the head's token; set "
                              f"{TOKEN_VARIABLE} to a shared secret here and for every `dejavu worker`")
        rules = TokenRules.of(reference)
        chosen_batching = check_batching("continuous" if batching is None else batching)
        prefill_tokens = check_max_prefill_tokens(max_prefill_tokens)
        store = open_replica_store(replica_store, recovery)
        return cls(model, Layout(pipelines, ring=recovery == "replicas" and store is None), chosen, microbatch, slots,
                   budget, swaps, choice, transport, float(timeout), float(heartbeat), missed_beats, recovery, store,
                   _prefix(replica_prefix), standby, threads,
                   LocalProcesses() if launch is True else (launch or None), host, port,
                   token or os.environ.get(TOKEN_VARIABLE) or secrets.token_hex(16), rules,
                   [] if ignore_eos else rules.eos, per_token, chosen_batching, prefill_tokens, link_tls,
                   float(orphan_timeout), float(progress_timeout))


def check_body_limit(max_body_bytes: Any) -> int:
    """The controller's cap on a request body, in bytes."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < MIN_BODY_BYTES:
        raise ConfigError(f"max_body_bytes must be an integer of at least {MIN_BODY_BYTES}, got {max_body_bytes!r}")
    return max_body_bytes


def check_recovery(recovery: Any, transport: str, pipelines: list[list[tuple[int, int]]],
                   replica_store: bool = False) -> str | None:
    """`recovery` if this pipeline can recover that way ("auto": the best way it can); ConfigError otherwise."""
    if recovery is None:
        if replica_store:
            raise ConfigError("replica_store keeps replicas to recover from: give recovery='replicas' too")
        return None
    if recovery not in (*RECOVERY, "auto"):
        raise ConfigError(f"recovery={recovery!r}: use {', '.join(map(repr, RECOVERY))} or 'auto', or None to fail "
                          "the requests in flight when a stage dies")
    refusals = {"transport": None if transport in RECOVERABLE_TRANSPORTS else
                f"recovery needs links that reconnect to a replacement ({', '.join(RECOVERABLE_TRANSPORTS)}); "
                f"{transport} links do not yet"}
    replicas = {"ring": None if len(pipelines[-1]) >= 2 or replica_store else
                "recovery='replicas' keeps each decoding stage's replica on the next one: it needs two decoding "
                "stages or more (or use recovery='recompute')"}
    if recovery == "auto":
        if any(refusals.values()):
            return None
        return "recompute" if any(replicas.values()) and not replica_store else "replicas"
    if recovery == "recompute" and replica_store:
        raise ConfigError("replica_store keeps replicas to recover from, which recovery='recompute' never reads")
    for refusal in [*refusals.values(), *(replicas.values() if recovery == "replicas" else [])]:
        if refusal:
            raise ConfigError(refusal)
    return str(recovery)


def open_replica_store(url: str | None, recovery: str | None) -> Store | None:
    """The store every stage replicates into, checked: other processes must see what one puts there."""
    if url is None:
        return None
    if recovery != "replicas":
        raise ConfigError("replica_store keeps replicas to recover from: it needs recovery='replicas'")
    store = open_store(url)
    if not store.shared:
        store.close()
        raise ConfigError(f"replica_store={url!r}: every stage process writes there and the head reads it, so it "
                          "must be a store other processes see (file:// on a shared file system, s3://, ...)")
    return store


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


def _positive_integer(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _seconds(value: Any, name: str, most: float | None = None, zero: bool = False) -> None:
    """A ConfigError unless `value` is a finite number of seconds above 0 (or 0 itself, `zero`), at most `most`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero) or (most and value > most):
        lowest = "0 or more" if zero else "positive"
        raise ConfigError(f"{name} must be a number of seconds in (0, {most}], got {value!r}" if most else
                          f"{name} must be a {lowest} number of seconds, got {value!r}")


def _prefix(replica_prefix: Any) -> str:
    """The replica streams' prefix: the one given (letters, digits and dashes), or a drawn one."""
    if replica_prefix is None:
        return f"p{secrets.token_hex(4)}-"
    if not isinstance(replica_prefix, str) or not re.fullmatch(r"[A-Za-z0-9-]{1,64}", replica_prefix):
        raise ConfigError(f"replica_prefix must be 1 to 64 letters, digits or dashes, got {replica_prefix!r}")
    return replica_prefix
