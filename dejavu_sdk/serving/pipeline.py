"""`Pipeline`: one model cut into stages that run in separate processes, serving requests in microbatches.

    with dv.Pipeline("smollm2", stages=2, microbatch=4) as pipe:    # stage processes start here
        outs = pipe.generate([ids_a, ids_b], max_new_tokens=64)     # each request's new ids, prompt excluded
        future = pipe.submit(ids, max_new_tokens=64)                # a concurrent.futures.Future of a Result
    dv.Pipeline("smollm2", prompt_stages=1, token_stages=2)         # prompt/token disaggregation
    dv.Pipeline("smollm2", machines=3, plan="auto")                 # the planner lays out 3 processes

The pipeline is the head: it owns the request queue, forms microbatches in arrival order, keeps up to one
microbatch per stage in flight, and collects each step's tokens from the last stage. Disaggregated, a
microbatch's prompt runs on the prompt pipeline, whose last stage picks the first tokens (`prefilled`);
the head then starts it on the token pipeline (`start`) once a token stage is free, and the token stages
build its cache from the KV the prompt stages streamed to them meanwhile. Stage workers join it
(`dejavu worker --join URL`; `Pipeline` launches them as local processes unless `launch=False`, in which
case workers started elsewhere join it) and are assigned stages in the order they join. Every link is a
transport with a shared secret token; a worker that dies or stops answering fails the requests in flight
with `TransportError` instead of leaving them waiting.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from ..backends import open_store, open_transport, serve
from ..errors import ConfigError, RequestFailed, StoreError, TransportError
from ..generation.adapters import adapter_for
from ..generation.batching import (
    Microbatch,
    Request,
    Result,
    cache_bytes,
    check_new_tokens,
    check_prompt,
    take_microbatch,
)
from ..generation.decoding import Decoding, TokenRules
from ..generation.stage import check_layers
from ..models import load_model
from ..planner import Plan
from ..planner import plan as make_plan
from ..store import Store
from ..stream import LayerPartition
from ..swapping import (
    SwapChoice,
    check_budget,
    check_fits_alone,
    check_swapping,
    choose_swapping,
    kv_bytes_per_token,
    measure_host_bandwidth,
    positions_needed,
    slots_needed,
)
from ..timing import measure_times
from ..transports.base import Server, Transport
from .launchers import JoinedWorker, Launcher, LocalProcesses, WorkerHandle
from .messages import Message, pack, unpack
from .recovery import ATTEMPTS, RECOVERY, Recovery, RecoveryReport, RecoveryRetry
from .replication import replica_stream

log = logging.getLogger(__name__)

#: The transports a pipeline's links can use.
TRANSPORTS = ("tcp", "gloo", "nccl", "ucx")
#: Seconds the head waits for every worker to join and load its stage.
START_TIMEOUT = 300.0
#: Seconds between the head's checks of its stages' processes, heartbeats and progress.
WATCH_PERIOD = 0.1
#: Sampling with recovery: the last steps whose generator state the head keeps (a microbatch whose replicas
#: lag further behind starts over).
RNG_STEPS_KEPT = 64
#: Why a microbatch in flight at two recoveries in a row, without a new token between them, fails: whatever
#: it carries may be what kills the stages, and it must not hold the pipeline in recoveries.
POISON = ("it was in flight at two recoveries in a row without making progress; it is not tried again, so that "
          "no request can hold the pipeline in recoveries")


@attrs.frozen
class StageInfo:
    """One stage of the layout: its `name`, `role` ("mixed", "prompt" or "token"), `number` in its own pipeline,
    and `layers`."""

    name: str
    role: str
    number: int
    layers: tuple[int, int]

    @property
    def layer_count(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def decodes(self) -> bool:
        return self.role != "prompt"


class Pipeline:
    """Serve `model` (`smollm2`, a Hugging Face directory, or `package.module:function`) in stage processes,
    `microbatch` requests at a time, laid out as one of:

    - one mixed pipeline of `stages` even stages (or the cuts in `layers`, e.g. `[(0, 12), (12, 30)]`) that
      runs prompts and tokens alike;
    - disaggregated: a prompt pipeline of `prompt_stages` and a token pipeline of `token_stages` even stages.
      Each prompt stage streams every layer's KV, as soon as the layer is done, to the token stage that owns
      it; the token side holds the KV of at most `token_slots` microbatches (default: one per stage of either
      pipeline), and a full token side holds new prompts back;
    - `machines` processes laid out by the planner (`plan="auto"`), from Y and t measured here on a microbatch
      of the `workload`'s (prompt tokens, new tokens); its answer is `self.plan`.

    `kv_budget_bytes`: device memory each stage may give its microbatches' KV caches (None: no cap); a new
    microbatch starts only once its cache fits (as many of its rows as fit) beside those in flight.
    `swapping=True` keeps the decoding stages' caches in host memory with two on the device, brought in while
    the previous microbatch computes, so about twice as many fit; `"auto"` swaps when the in-flight
    microbatches of the `workload` would not fit, the stages run on a GPU and the planner's condition says
    the copies keep up, from a step time and host bandwidth measured here (`swap_choice` says what it chose
    and why).

    `transport`: how activations and KV move (`tcp`, `gloo`, `nccl`, `ucx`). `timeout`: seconds a microbatch in
    flight may go without a new token before its requests fail with `TransportError` (a stage dead or stuck).
    `heartbeat`: seconds between each worker's heartbeats (sent from a thread of their own); a worker that
    misses `missed_beats` in a row (a process stopped or hung, or gone) fails the requests in flight.
    `recovery`: what a dead or hung stage costs. None (default): the requests in flight fail with
    `TransportError`. `"replicas"`: each decoding stage streams its caches to the next decoding stage's memory
    (a ring; needs two decoding stages or more), and a dead stage is replaced by a new process that gets its
    caches back from there: every microbatch resumes from its last replicated step (`recoveries` describes
    each recovery). `"recompute"`: the stage is replaced and the microbatches in flight start over from their
    prompts. Either way every request completes with the tokens it would have had without the failure.
    `"auto"`: from replicas where the layout allows it, else by recomputing, else None.
    `replica_store`: with recovery from replicas, a store every stage process reaches (`file://` on a shared
    file system, `s3://`, ...) that keeps the replicas instead of the next decoding stage: they outlive any
    stage, so even two neighbouring stages lost at once resume from there (and one decoding stage is enough).
    `standby`: spare worker processes kept with the model loaded, so that a replacement starts at once (the
    pool is topped up after each recovery; 0: a replacement process starts when needed).
    `on_recovery(report)` is called after each recovery (on its thread).
    `ignore_eos`: every request generates its `max_new_tokens` (benchmarks, as vLLM's `ignore_eos`).
    `threads`: torch threads per stage process (default: this machine's cores shared between the stages).
    `launch`: True starts the stage workers as processes of this machine; a `Launcher` starts them its way
    (`dejavu_sdk.cluster.ray.RayWorkers`: Ray actors); False starts none (workers join from elsewhere).
    `host`/`port`: where the head listens for its workers. `token`: the shared secret of every link (default:
    `DEJAVU_TOKEN`, else a random one handed to the workers it launches).
    """

    def __init__(self, model: str, stages: int | None = None, *, layers: Sequence[tuple[int, int]] | None = None,
                 prompt_stages: int | None = None, token_stages: int | None = None, token_slots: int | None = None,
                 machines: int | None = None, plan: str = "auto", workload: tuple[int, int] = (256, 64),
                 microbatch: int = 4, kv_budget_bytes: int | None = None, swapping: bool | str = "auto",
                 transport: str = "tcp", timeout: float = 60.0, heartbeat: float = 1.0, missed_beats: int = 3,
                 recovery: str | None = None, replica_store: str | None = None, standby: int = 0,
                 ignore_eos: bool = False,
                 threads: int | None = None, launch: bool | Launcher = True, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ConfigError(f"transport={transport!r}: pipelines run over {', '.join(TRANSPORTS)}")
        if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1:
            raise ConfigError(f"microbatch must be a positive integer, got {microbatch!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(heartbeat, bool) or not isinstance(heartbeat, (int, float)) or not 0 < heartbeat <= 60:
            raise ConfigError(f"heartbeat must be a number of seconds in (0, 60], got {heartbeat!r}")
        if isinstance(missed_beats, bool) or not isinstance(missed_beats, int) or missed_beats < 1:
            raise ConfigError(f"missed_beats must be a positive integer, got {missed_beats!r}")
        #: Seconds between a worker's heartbeats, and how many in a row it may miss before it counts as dead.
        self.heartbeat, self.missed_beats = float(heartbeat), missed_beats
        self.kv_budget = check_budget(kv_budget_bytes)
        check_swapping(swapping)
        reference = load_model(model)  # ConfigError for a bad name, before any process starts
        adapter = adapter_for(reference)  # ConfigError for an architecture without an adapter
        total = len(adapter.decoder_layers())
        #: The planner's answer, when `machines` asked for one.
        self.plan: Plan | None = None
        if machines is not None:
            if stages is not None or layers is not None or prompt_stages is not None or token_stages is not None:
                raise ConfigError("machines= lets the planner choose the stages: give it alone, or give stages= "
                                  "(mixed) or prompt_stages= and token_stages= (disaggregated) instead")
            self.plan = _plan(reference, machines, plan, workload, microbatch, threads)
            if self.plan.disaggregate:
                prompt_stages, token_stages = self.plan.prompt_machines, self.plan.token_machines
            else:
                stages = machines
        #: Mixed: every stage's layers. Disaggregated: the prompt pipeline's, then the token pipeline's.
        self.layouts = _layouts(stages, layers, prompt_stages, token_stages, total)
        self.disaggregated = len(self.layouts) == 2
        #: Every stage's layers, in the order their workers are assigned (prompt stages first).
        self.layers: list[tuple[int, int]] = [cut for layout in self.layouts for cut in layout]
        depth = len(self.layouts[-1])
        if token_slots is None:
            token_slots = depth + len(self.layouts[0]) if self.disaggregated else depth
        if isinstance(token_slots, bool) or not isinstance(token_slots, int) or token_slots < depth:
            raise ConfigError(f"token_slots must be an integer of at least {depth} (one microbatch per token "
                              f"stage), got {token_slots!r}")
        if token_slots != depth and not self.disaggregated:
            raise ConfigError("token_slots applies to disaggregated pipelines (prompt_stages= and token_stages=)")
        #: Microbatches whose KV the token side may hold (decoding, or arrived and waiting to): a full token side
        #: holds the prompt side back.
        self.token_slots = token_slots
        rules = TokenRules.of(reference)
        self._sampling_refused = rules.sampling_refused
        self.context: int | None = rules.context
        #: Every end-of-sequence token id (some models have several); a row ends at any of them.
        self.eos: list[int] = rules.eos
        self.pad: int = rules.pad
        self.vocabulary: int = rules.vocabulary
        self.threads = threads or max(1, (os.cpu_count() or 1) // sum(map(len, self.layouts)))
        widest = max(stop - start for start, stop in self.layouts[-1])
        #: KV bytes per position of one row in the decoding stage with the most layers (the one a budget binds).
        self.kv_bytes_per_token = kv_bytes_per_token(reference.config, next(reference.parameters()).dtype, widest)
        #: Whether decoding stages swap caches to host memory, and, when "auto" decided it, why.
        self.swap_choice: SwapChoice | None = None
        if swapping == "auto" and recovery is not None:  # recovery="auto" included: it never swaps
            self.swap_choice = SwapChoice(False, "recovery keeps every cache where its replica streams from")
        elif swapping == "auto":
            self.swap_choice = self._choose_swapping(reference, workload, microbatch, widest / total)
            log.info("swapping %s: %s", "on" if self.swap_choice.swapping else "off", self.swap_choice.reason)
        self.swapping = self.swap_choice.swapping if self.swap_choice is not None else bool(swapping)
        #: How a dead stage is recovered from: "replicas", "recompute", or None (the requests in flight fail).
        self.recovery = _check_recovery(recovery, transport, self.layouts, self.swapping, reference,
                                        replica_store is not None)
        #: Where replicas live when not on the next decoding stage (recovery from replicas), and their streams' prefix.
        self.replica_store = _open_replica_store(replica_store, self.recovery)
        self.replica_prefix = f"p{secrets.token_hex(4)}-"
        if isinstance(standby, bool) or not isinstance(standby, int) or standby < 0:
            raise ConfigError(f"standby must be a number of spare workers (0 or more), got {standby!r}")
        if standby and (self.recovery is None or not launch):
            raise ConfigError("standby workers replace dead stages: give recovery=, and let the pipeline launch them")
        self.standby = standby
        if ignore_eos:
            self.eos = []
        #: Each recovery so far, in order.
        self.recoveries: list[RecoveryReport] = []
        #: Called with each recovery's report, and with each failure's description as a recovery starts.
        self.on_recovery: Callable[[RecoveryReport], None] | None = None
        self.on_failure: Callable[[str], None] | None = None
        del reference
        self.model, self.microbatch, self.timeout = model, microbatch, float(timeout)
        #: How stage workers start (None: they are started elsewhere and join).
        self.launcher: Launcher | None = LocalProcesses() if launch is True else (launch or None)
        self.launch = self.launcher is not None
        self.host, self.port, self.transport = host, port, transport
        if not launch and not (token or os.environ.get("DEJAVU_TOKEN")):
            raise ConfigError("launch=False: workers started elsewhere must present the head's token; set "
                              "DEJAVU_TOKEN to a shared secret here and for every `dejavu worker`")
        self._token = token or os.environ.get("DEJAVU_TOKEN") or secrets.token_hex(16)
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._in_flight: dict[int, Microbatch] = {}
        self._reserved: dict[int, int] = {}  # per microbatch in flight: its cache's bytes at its end, per stage
        self._freed_early: set[int] = set()  # microbatches every stage freed before their `ended` came
        #: The most microbatches that were in flight at once (from admission until every stage let its cache go).
        self.most_in_flight = 0
        self._stats: dict[str, dict[str, Any]] = {}  # per stage: what its caches held, as it last said
        self._stats_arrived = threading.Condition(self._lock)
        self._beats: dict[str, float] = {}  # per stage name: when its last heartbeat (or `ready`) arrived
        self._assigned: dict[str, int] = {}  # per stage name: the epoch its worker was assigned in
        self._progress: dict[int, float] = {}  # per microbatch in flight: when it last made progress
        self._next_microbatch = 0
        self._prompting = 0  # disaggregated: microbatches in the prompt pipeline
        self._decoding = 0  # disaggregated: microbatches in the token pipeline
        self._staged: deque[tuple[int, Message]] = deque()  # prefilled, waiting for a token stage to start them
        self._failure: TransportError | None = None
        self._processes: list[WorkerHandle] = []
        self._workers: list[Transport] = []
        self._urls: list[str] = []  # each stage worker's inbox, in stage order
        self._spares: dict[int, WorkerHandle] = {}  # launched workers not serving a stage, by pid
        self._pool: list[tuple[str, int]] = []  # spare workers with the model loaded (inbox, pid), oldest first
        self._warming: dict[str, int] = {}  # spare workers loading the model: inbox -> pid
        #: Every stage of the layout, in the order workers are assigned (prompt stages first).
        self.stage_table = _stage_table(self.layouts)
        self._epoch = 0  # raised by each recovery: messages of older epochs are dropped
        self._held = False  # a recovery is under way: nothing new starts
        self._recovering: threading.Thread | None = None
        self._failed_meanwhile: str | None = None  # a failure reported during a recovery, to look at after it
        #: The stages' answers to a recovery's steps, for the recovery thread.
        self.replies: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._inbox: Server | None = None
        self._receiver: threading.Thread | None = None
        self._starting = False  # start() is under way: submissions wait for it (bounded by `timeout`)
        self._running = threading.Event()
        self._closed = False

    # ---- life cycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Where workers join (`dejavu worker --join URL`); set once the pipeline has started."""
        if self._inbox is None:
            raise ConfigError("the pipeline has not started: use it in a with block, or call start()")
        return self._inbox.url

    def listen(self) -> str:
        """Open the head's inbox, where workers join (`url`), without waiting for them: `start` does."""
        if self._inbox is None:
            self._inbox = serve(f"{self.transport}://{self.host}:{self.port}", token=self._token)
        return self._inbox.url

    def start(self) -> Pipeline:
        """Listen, launch (or wait for) the stage workers, assign them their stages, and wait until all have
        loaded them."""
        self.listen()
        self._starting = True
        try:
            if self.launch:
                self._processes = [self._launch() for _ in self.layers]
                for _ in range(self.standby):
                    spare = self._launch()
                    self._spares[spare.pid] = spare
            self._assign_stages()
        except BaseException:
            self.close()
            raise
        self._receiver = threading.Thread(target=self._receive, name="dejavu-pipeline-head", daemon=True)
        self._receiver.start()
        self._running.set()
        return self

    def _assign_stages(self) -> None:
        assert self._inbox is not None
        deadline = time.monotonic() + START_TIMEOUT
        joined: list[str] = []
        pids: list[int] = []
        while len(joined) < len(self.layers):
            message = self._next_message(deadline, "every stage worker to join")
            if message.kind == "join" and int(message.fields["pid"]) in self._spares:
                self._pool_spare(message)
            elif message.kind == "warm":
                self._warmed(str(message.fields["url"]))
            elif message.kind == "join":
                joined.append(message.fields["url"])
                pids.append(int(message.fields["pid"]))
        if self.launch:  # stages go in the order workers joined: each stage's process is the one that joined as it
            by_pid = {process.pid: process for process in self._processes}
            self._processes = [by_pid[pid] for pid in pids]
        self._urls = joined
        self._workers = [open_transport(url, token=self._token) for url in joined]
        for index in range(len(self.stage_table)):
            self.send(index, Message("assign", self.assignment(index)))
        ready: set[int] = set()
        while len(ready) < len(self.layers):
            message = self._next_message(deadline, "every stage worker to load its stage")
            if message.kind == "join":  # a standby that joined after the stage workers
                self._pool_spare(message)
            elif message.kind == "warm":
                self._warmed(str(message.fields["url"]))
            elif message.kind == "failed":
                raise ConfigError(f"stage {message.fields['stage']} could not start: {message.fields['error']}")
            if message.kind == "ready":
                ready.add(message.fields["stage"])
        self._beats = {stage.name: time.monotonic() for stage in self.stage_table}

    def assignment(self, index: int) -> dict[str, Any]:
        """What worker `index` is told to be: the model, its stage and where it sits, and its links."""
        stage = self.stage_table[index]
        return {"model": self.model, "stage": index, "threads": self.threads, "eos": self.eos, "pad": self.pad,
                "swapping": self.swapping, "heartbeat": self.heartbeat, "recovery": self.recovery is not None,
                "epoch": self._epoch, "role": stage.role, "number": stage.number, "name": stage.name,
                "stages": len(self.layouts[-1] if stage.role == "token" else self.layouts[0]), **self.links_of(index)}

    def links_of(self, index: int) -> dict[str, Any]:
        """Stage `index`'s links: the next stage of its pipeline, its pipeline's first stage, a prompt stage's
        token stages, and a decoding stage's replica holder (with recovery from replicas)."""
        stage = self.stage_table[index]
        pipeline = [other for other, info in enumerate(self.stage_table) if info.decodes == stage.decodes]
        following = pipeline[stage.number + 1] if stage.number + 1 < len(pipeline) else None
        fields: dict[str, Any] = {"layers": list(stage.layers), "first": self._urls[pipeline[0]],
                                  "next": None if following is None else self._urls[following]}
        if stage.role == "prompt":
            token_layout = self.layouts[1]
            fields["token_stages"] = [self._urls[other] for other in self.decoding_stages()]
            fields["token_boundaries"] = [token_layout[0][0]] + [stop for _, stop in token_layout]
        holder = self.replica_holder(index)
        fields["holder"] = None if holder is None else self._urls[holder]
        if self.replica_store is not None and stage.decodes:
            fields["replica_store"] = self.replica_store.url
        fields["replica_prefix"] = self.replica_prefix
        return fields

    def decoding_stages(self) -> list[int]:
        """The stages that decode (mixed or token stages), in pipeline order."""
        return [index for index, stage in enumerate(self.stage_table) if stage.decodes]

    def replica_holder(self, index: int) -> int | None:
        """The stage holding decoding stage `index`'s replicas: the next decoding stage, around the ring."""
        decoding = self.decoding_stages()
        if self.recovery != "replicas" or self.replica_store is not None or index not in decoding:
            return None
        return decoding[(decoding.index(index) + 1) % len(decoding)]

    def replica_owner(self, index: int) -> int | None:
        """The decoding stage whose replicas stage `index` holds."""
        decoding = self.decoding_stages()
        if self.recovery != "replicas" or self.replica_store is not None or index not in decoding:
            return None
        return decoding[(decoding.index(index) - 1) % len(decoding)]

    def send(self, index: int, message: Message) -> None:
        """Send stage `index` a message and wait until its inbox has it."""
        self._workers[index].send_tensor(pack(message))

    def url_of(self, index: int) -> str:
        return self._urls[index]

    def _next_message(self, deadline: float, waiting_for: str) -> Message:
        assert self._inbox is not None
        while True:
            self._check_processes()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"waited {START_TIMEOUT:.0f} s for {waiting_for}")
            try:
                return unpack(self._inbox.recv_tensor(timeout=min(1.0, remaining)))
            except TransportError:
                continue

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers and fail whatever is still waiting. Closing twice is harmless."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._running.set()  # submissions waiting for the start see it closed
        holding = self.holding_numbers()
        self._fail(TransportError("the pipeline was closed"))
        recovering = self._recovering
        if recovering is not None:  # let it see the pipeline closed (its waits are bounded), so no spare is left
            recovering.join(timeout=10)
        for worker in self._workers:
            with contextlib.suppress(TransportError):  # a worker already gone needs no shutdown
                worker.send_tensor(pack(Message("shutdown")))
            worker.close()
        with self._lock:
            joined = {pid: url for url, pid in [*self._pool, *((url, pid) for url, pid in self._warming.items())]}
            handles = [*self._processes, *self._spares.values()]
        for url in joined.values():
            with contextlib.suppress(TransportError), open_transport(url, token=self._token) as link:
                link.send_tensor(pack(Message("shutdown")))
        for process in handles:
            if process in self._spares.values() and process.pid not in joined:
                process.kill()  # launched, not joined yet: nothing to tell it
            else:
                process.stop(timeout=10)
        if self._receiver is not None:
            self._receiver.join(timeout=5)
        if self._inbox is not None:
            self._inbox.close()
        if self.replica_store is not None:  # what microbatches left in flight replicated goes too
            for number in holding:
                for stage in self.decoding_stages():
                    with contextlib.suppress(StoreError):
                        self.replica_store.delete(replica_stream(self.stage_table[stage].number, number,
                                                                 self.replica_prefix))
            self.replica_store.close()

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, ids: Any, max_new_tokens: int = 32, *, do_sample: bool = False, seed: int | None = None,
               on_token: Callable[[int], None] | None = None, **settings: Any) -> Future[Result]:
        """Queue one prompt `[T]`; the future gets its `Result` (new tokens, and where it was served).

        Greedy by default; `do_sample=True` samples with `temperature` (below 1e-5: greedy), `top_k`, `top_p`,
        `min_p` (unset ones from the model's generation config) from a generator of the request's own seeded with
        `seed` (drawn when not given, and returned in the result): alone in its microbatch, its tokens equal
        `torch.manual_seed(seed)` followed by `model.generate(..., do_sample=True)`. Requests of any settings
        share microbatches. `on_token(id)` gets each new token as it arrives, on the head's receiver thread
        (keep it short). The future is answered at the step its request ends, with its `Result`, or a
        `RequestFailed` of its own (the other requests go on), or the `TransportError` that stopped the
        pipeline. `future.cancel()` (or `cancel(future)`) takes a waiting request off the queue, and ends a
        running one at its next step. A pipeline still starting queues the request once it is running.
        """
        listener = None if on_token is None else (lambda _, token: on_token(token))
        return self.submit_all([ids], max_new_tokens, do_sample=do_sample, seed=seed, on_token=listener,
                               **settings)[0]

    def submit_all(self, prompts: Sequence[Any], max_new_tokens: int = 32, *, do_sample: bool = False,
                   seed: int | None = None, on_token: Callable[[int, int], None] | None = None,
                   **settings: Any) -> list[Future[Result]]:
        """Queue several prompts together, in order, every one checked before any is queued (ConfigError);
        decoding as in `submit`, each prompt from its own generator seeded with `seed`; `on_token(index, id)`
        gets the new tokens of `prompts[index]` as they arrive. Admission takes turns between submissions: a
        long list does not hold back a submission that comes after it."""
        return self._queue(prompts, max_new_tokens, Decoding.of(do_sample, seed, **settings), on_token)

    def generate(self, prompts: Sequence[Any], max_new_tokens: int = 32, *, do_sample: bool = False,
                 seed: int | None = None, **settings: Any) -> list[torch.Tensor]:
        """Each prompt's new token ids (prompt excluded), queued together and served in microbatches in the
        order given; decoding as in `submit`, one seed for them all."""
        futures = self.submit_all(prompts, max_new_tokens, do_sample=do_sample, seed=seed, **settings)
        return [future.result().tokens for future in futures]

    def cancel(self, future: Future[Result]) -> bool:
        """Cancel the request `future` belongs to (as `future.cancel()` does): a waiting request is never
        computed, a running one ends at its next step. False when it had its answer already."""
        return future.cancel()

    def _queue(self, prompts: Sequence[Any], max_new_tokens: int, decoding: Decoding,
               on_token: Callable[[int, int], None] | None = None) -> list[Future[Result]]:
        self._wait_until_running()
        if decoding.do_sample and self._sampling_refused is not None:
            raise self._sampling_refused
        requests: list[Request] = []
        for index, ids in enumerate(prompts):  # every prompt is checked before any is queued
            prompt = check_prompt(ids, self.context, self.vocabulary)
            listener = None if on_token is None else functools.partial(on_token, index)
            request = Request(prompt, check_new_tokens(max_new_tokens, prompt.numel(), self.context), decoding,
                              on_token=listener)
            if requests:  # prompts submitted together are one submission: admission takes turns between them
                request.group = requests[0].group
            requests.append(request)
            check_fits_alone(cache_bytes(requests[-1:], self.kv_bytes_per_token), self.kv_budget, self.swapping)
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._waiting.extend(requests)
        for request in requests:
            request.future.add_done_callback(functools.partial(self._answered, request))
        self._admit()
        return [request.future for request in requests]

    def _wait_until_running(self) -> None:
        """Return once the pipeline runs: at once, or when a start under way ends (within `timeout`)."""
        if self._closed or not (self._starting or self._running.is_set()):
            raise ConfigError("the pipeline is not running: use it in a with block, or call start()")
        if not self._running.wait(self.timeout):
            raise TransportError(f"the pipeline did not finish starting within {self.timeout:.0f} s")
        if self._closed:
            raise ConfigError("the pipeline is closed")

    def _answered(self, request: Request, future: Future[Result]) -> None:
        """A request's future is done: when its caller cancelled it, take it off the queue, or end its row."""
        if not future.cancelled():
            return
        with self._lock:
            if request in self._waiting:
                self._waiting.remove(request)
                return
            found = next(((batch, row) for batch in self._in_flight.values()
                          for row, member in enumerate(batch.requests) if member is request), None)
            if found is None:
                return
            batch, row = found
            batch.dropped.add(row)
            batch.settled.add(row)
            decoding = self._phase(batch) == "decoding"
        if decoding:  # else its start on the token pipeline carries the row as ended
            self._send_quietly(self.decoding_stages()[0], Message("cancel", {
                "microbatch": batch.number, "rows": [row], "epoch": self._epoch}))

    def _phase(self, batch: Microbatch) -> str:
        """Where a microbatch in flight is: "prompting" (in the prompt pipeline), "staged" (prefilled, waiting
        for the token pipeline) or "decoding" (a mixed pipeline's microbatches always are)."""
        if not self.disaggregated:
            return "decoding"
        if any(number == batch.number for number, _ in self._staged):
            return "staged"
        return "decoding" if batch.arrived else "prompting"

    def _microbatch_failed(self, number: int, error: str) -> None:
        """A stage's computation failed on microbatch `number`: its unanswered requests fail with that error,
        every decoding stage lets it go, and its room is given back. The stage and the other microbatches go on."""
        with self._lock:
            batch = self._in_flight.get(number)
            if batch is None:
                return
            phase = self._phase(batch)
            del self._in_flight[number]
            self._prompting -= self.disaggregated and phase == "prompting"
            self._decoding -= self.disaggregated and phase == "decoding"
            for table in (self._reserved, self._progress):
                table.pop(number, None)
            self._freed_early.discard(number)
            answers = self._fail_rows(batch, error)
        _answer(answers)
        for index in self.decoding_stages():
            self._send_quietly(index, Message("drop", {"microbatches": [number], "epoch": self._epoch}))
        self._admit()

    @staticmethod
    def _fail_rows(batch: Microbatch, error: str) -> list[tuple[Future[Result], Any]]:
        """Under the lock: a `RequestFailed` for each row of `batch` not answered yet, which now are."""
        rows = [row for row in range(len(batch.requests)) if row not in batch.settled]
        batch.settled.update(rows)
        return [(batch.requests[row].future, RequestFailed(error, batch.requests[row].number)) for row in rows]

    def _send_quietly(self, index: int, message: Message) -> None:
        """Send a message whose loss a stage failure makes moot (the watchdog finds the stage)."""
        try:
            self.send(index, message)
        except (TransportError, StoreError) as error:
            log.warning("%s did not take %r: %s", self.stage_table[index].name, message.kind, error)

    def _settle_rows(self, batch: Microbatch, failures: dict[str, Any]) -> list[tuple[Future[Result], Any]]:
        """Under the lock: the answers due to the rows of `batch` that failed (by row, as the last stage reported
        them) or came to their end with its latest step; they are settled from now on."""
        answers: list[tuple[Future[Result], Any]] = []
        for key, failure in failures.items():
            row = int(key)
            if row not in batch.settled:
                batch.settled.add(row)
                batch.dropped.add(row)
                error = RequestFailed(failure["reason"], batch.requests[row].number, bool(failure["input_error"]))
                answers.append((batch.requests[row].future, error))
        for row in batch.ended_rows(self.eos):
            batch.settled.add(row)
            answers.append((batch.requests[row].future, batch.result(row, self.eos)))
        return answers

    # ---- the head's scheduling --------------------------------------------------------------------
    def _admit(self) -> None:
        """Start what may start: a prefilled microbatch on a free token stage, and waiting requests as a new
        microbatch while the first stage's pipeline has room (disaggregated: and the token side a free slot)."""
        while True:
            with self._lock:
                if self._failure is not None or self._held:
                    return
                if self._staged and self._decoding < len(self.layouts[-1]):
                    number, start = self._staged.popleft()
                    self._decoding += 1
                    self._progress[number] = time.monotonic()
                    stage, message = len(self.layouts[0]), _without(start, self._in_flight[number].dropped)
                elif self._waiting and self._room_for_a_prefill():
                    taken = take_microbatch(self._waiting, self.microbatch, self._fits_beside_those_in_flight)
                    if not taken:  # the budget is full: wait for a microbatch to end
                        return
                    batch = Microbatch.of(self._next_microbatch, taken, self.pad)
                    self._reserved[batch.number] = cache_bytes(taken, self.kv_bytes_per_token)
                    self._next_microbatch += 1
                    self._in_flight[batch.number] = batch
                    self.most_in_flight = max(self.most_in_flight, self._holding())
                    self._progress[batch.number] = time.monotonic()
                    self._prompting += self.disaggregated
                    stage, message = 0, Message("prefill", batch.fields(), (batch.ids, batch.mask))
                else:
                    return
                message = Message(message.kind, {**message.fields, "epoch": self._epoch}, message.tensors)
            try:
                self._workers[stage].send_tensor(pack(message))
            except (TransportError, StoreError) as error:  # StoreClosed: the pipeline closed meanwhile
                failure = f"{self.stage_table[stage].name} is unreachable: {error}"
                if self.recovery is None or self._closed:
                    self._fail(TransportError(failure))
                else:  # the recovery decides where the microbatch goes on from
                    self._start_recovery(set(), failure)
                return

    def _fits_beside_those_in_flight(self, requests: list[Request]) -> bool:
        if self.kv_budget is None:
            return True
        reservations = [*self._reserved.values(), cache_bytes(requests, self.kv_bytes_per_token)]
        return slots_needed(reservations, self.swapping) <= self.kv_budget

    def _choose_swapping(self, reference: Any, workload: Any, microbatch: int, share: float) -> SwapChoice:
        """Swap when the in-flight microbatches of the workload would not fit in the budget, the stages' device
        is not the host, and the copies keep up with a decoding stage's step (timed on the whole model here,
        scaled to the stage's share of layers)."""
        prompt_tokens, new_tokens = _workload(workload)
        alone = positions_needed(prompt_tokens, new_tokens) * self.kv_bytes_per_token
        limit = self.token_slots if self.disaggregated else len(self.layers)
        device = next(reference.parameters()).device  # where stage processes load the model too

        def measure() -> tuple[float, float]:
            _, token_time = measure_times(reference, microbatch, prompt_tokens, threads=self.threads)
            return token_time * share, measure_host_bandwidth(device, microbatch * alone)

        budget = self.kv_budget
        return choose_swapping(fits_without=budget is None or limit * microbatch * alone <= budget, batch=microbatch,
                               prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                               cache_bytes_per_token=self.kv_bytes_per_token, device_is_host=device.type != "cuda",
                               two_slots=budget is None or 2 * alone <= budget, measure=measure)

    def status(self) -> dict[str, Any]:
        """A snapshot for operators: the layout and its stages (whether each launched process lives), the
        microbatches in flight and their steps, the requests waiting, and the failure that stopped it, if any."""
        kinds = ("prompt", "token") if self.disaggregated else ("mixed",)
        stages: list[dict[str, Any]] = [
            {"name": f"stage {number}" if kind == "mixed" else f"{kind} stage {number}", "role": kind,
             "layers": list(layers)}
            for kind, layout in zip(kinds, self.layouts, strict=True) for number, layers in enumerate(layout)]
        for stage, process in zip(stages, self._processes, strict=False):
            stage.update(pid=process.pid, alive=process.alive())
        now = time.monotonic()
        for stage in stages:
            if stage["name"] in self._beats:
                stage["last_heartbeat_seconds_ago"] = round(now - self._beats[stage["name"]], 3)
        with self._lock:
            return {"layout": "disaggregated" if self.disaggregated else "mixed", "stages": stages,
                    "microbatches": [{"microbatch": number, "rows": len(batch.requests), "steps": len(batch.arrived)}
                                     for number, batch in sorted(self._in_flight.items())],
                    "waiting": len(self._waiting), "swapping": self.swapping, "kv_budget_bytes": self.kv_budget,
                    "recovery": self.recovery, "epoch": self._epoch, "recovering": self._recovering is not None,
                    "standby": [pid for _, pid in self._pool],
                    "recoveries": [attrs.asdict(report) for report in self.recoveries],
                    "failure": None if self._failure is None else str(self._failure)}

    def stage_stats(self, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        """Each stage's KV caches as it reports them now: whether it swaps, device bytes held now and at most
        (`held_kv_bytes`, `peak_kv_bytes`: counted from the caches' tensors), swap-ins and the seconds it waited
        for them."""
        with self._lock:
            self._stats.clear()
        for worker in self._workers:
            worker.send_tensor(pack(Message("stats")))
        deadline = time.monotonic() + timeout
        with self._stats_arrived:
            while len(self._stats) < len(self._workers):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._failure is not None:
                    raise TransportError(f"the stages did not all report within {timeout} s") from self._failure
                self._stats_arrived.wait(remaining)
            return dict(self._stats)

    def _holding(self) -> int:
        """Microbatches in flight: from admission until they ended and every stage let their caches go (one
        whose caches went before its `ended` came has left every stage)."""
        return len((self._in_flight.keys() - self._freed_early) | self._reserved.keys())

    def _room_for_a_prefill(self) -> bool:
        if not self.disaggregated:
            return self._holding() < len(self.layers)  # one microbatch per stage
        return self._prompting < len(self.layouts[0]) and self._holding() < self.token_slots

    def _receive(self) -> None:
        """The head's receiver thread: takes the workers' messages, and watches them between messages."""
        assert self._inbox is not None
        watched = time.monotonic()
        while not self._closed:
            try:
                message: Message | None = unpack(self._inbox.recv_tensor(timeout=WATCH_PERIOD))
            except TransportError:
                message = None
            try:
                if message is not None:
                    self._handle(message)
                if time.monotonic() - watched >= WATCH_PERIOD:
                    watched = time.monotonic()
                    self._watch()
            except Exception as error:  # a malformed message or a broken link: fail the requests, never hang them
                self._fail(error if isinstance(error, TransportError) else
                           TransportError(f"the pipeline's head failed: {type(error).__name__}: {error}"))

    def _handle(self, message: Message) -> None:
        if message.kind in _STEPS and int(message.fields.get("epoch", 0)) < self._epoch:
            return  # sent before a recovery, which decided where its microbatch goes on from
        if message.kind in _REPLIES:
            self.replies.put(message)
        elif message.kind == "join":  # a spare worker: launched for a recovery or as a standby, or started by hand
            self._pool_spare(message)
        elif message.kind == "warm":
            self._warmed(str(message.fields["url"]))
        elif message.kind == "link_lost":
            self._start_recovery(set(), f"{message.fields['stage']} lost a link: {message.fields['error']}")
        elif message.kind == "tokens":
            number = int(message.fields["microbatch"])
            calls, answers = [], []
            with self._lock:
                batch = self._in_flight.get(number)
                if batch is not None:
                    self._progress[number] = time.monotonic()
                    batch.add_step(message.tensors[0].tolist())
                    if len(message.tensors) > 1:  # sampling with recovery: the generators' states after this step
                        step = len(batch.arrived)
                        batch.rng_states[step] = message.tensors[1].clone()
                        batch.rng_states.pop(step - RNG_STEPS_KEPT, None)  # replicas are never that far behind
                    calls = batch.unstreamed(self.eos)
                    answers = self._settle_rows(batch, message.fields.get("failed", {}))
            _stream(calls)
            _answer(answers)
        elif message.kind == "prefilled":  # disaggregated: the prompt pipeline's first tokens; decoding waits
            number = int(message.fields["microbatch"])
            with self._lock:
                batch = self._in_flight.get(number)
                self._prompting -= 1
                self._progress.pop(number, None)  # not watched while it waits for a token stage
                calls, answers = [], []
                if batch is not None:
                    tokens, mask, ended, rng = message.tensors
                    batch.add_step(tokens[:, 0].tolist())
                    if rng.numel() and self.recovery is not None:
                        batch.rng_states[1] = rng.clone()
                    calls = batch.unstreamed(self.eos)
                    answers = self._settle_rows(batch, message.fields.get("failed", {}))
                    self._staged.append((number, Message("start", batch.fields(), (tokens, mask, ended, rng))))
            _stream(calls)
            _answer(answers)
            self._admit()
        elif message.kind == "ended":
            number = int(message.fields["microbatch"])
            with self._lock:
                batch = self._in_flight.pop(number, None)
                self._freed_early.discard(number)
                if message.fields.get("freed"):  # else the room its caches took is given back by `freed`
                    self._reserved.pop(number, None)
                if number in self._reserved:  # watched until `freed` comes: a stage that never frees it fails
                    self._progress[number] = time.monotonic()
                else:
                    self._progress.pop(number, None)
                self._decoding -= self.disaggregated
            if batch is not None:  # every row was answered at its end; this answers any the stages ended early
                _answer([(batch.requests[row].future, batch.result(row, self.eos))
                         for row in range(len(batch.requests)) if row not in batch.settled])
            self._admit()
        elif message.kind == "microbatch_failed":
            self._microbatch_failed(int(message.fields["microbatch"]), str(message.fields["error"]))
        elif message.kind == "heartbeat":
            name = str(message.fields["stage"])
            with self._lock:  # a standby's beats only show it is there; a replaced worker's are no one's
                if name in self._beats and int(message.fields.get("epoch", 0)) >= self._assigned.get(name, 0):
                    self._beats[name] = time.monotonic()
        elif message.kind == "freed":  # every decoding stage let the microbatch's cache go
            number = int(message.fields["microbatch"])
            with self._lock:
                self._reserved.pop(number, None)
                if number not in self._in_flight:  # `ended` came first
                    self._progress.pop(number, None)
                else:  # `ended` is on its way from the last stage
                    self._freed_early.add(number)
            self._admit()
        elif message.kind == "stats":
            with self._stats_arrived:
                self._stats[str(message.fields["stage"])] = dict(message.fields)
                self._stats_arrived.notify_all()
        elif message.kind == "failed":
            failure = f"stage {message.fields['stage']} failed: {message.fields['error']}"
            known = {info.name for info in self.stage_table} | set(range(len(self.stage_table)))
            if message.fields["stage"] not in known:
                log.warning("%s", failure)  # not a stage's worker: a spare that could not load, say
                return
            stage = self.stage_table[self._index_of(message.fields["stage"])].name
            if int(message.fields.get("epoch", 0)) < self._assigned.get(stage, 0):
                return  # a worker replaced since (one started elsewhere cannot be stopped from here)
            if self.recovery is None:
                self._fail(TransportError(failure))
            elif self._recovering is not None:
                self.replies.put(message)
            else:
                self._start_recovery({self._index_of(message.fields["stage"])}, failure)

    def _watch(self) -> None:
        """Find stages that are dead or hung: a process that exited, a stage silent for `missed_beats`
        heartbeats, or a microbatch without progress (no new tokens) for `timeout` seconds. Recover from them,
        or, without recovery, fail the requests in flight."""
        if self._recovering is not None:
            return  # the recovery watches its own steps
        now = time.monotonic()
        exited = self.exited()
        with self._lock:
            stalled = min(self._progress.values(), default=None)
            silent = sorted((last, name) for name, last in self._beats.items()
                            if now - last > self.heartbeat * self.missed_beats)
        reasons = [f"the process of {self.stage_table[index].name} exited" for index in exited]
        reasons += [f"{name} sent no heartbeat for {now - last:.1f} s ({self.missed_beats} missed): its process is "
                    "dead or hung" for last, name in silent]
        if stalled is not None and now - stalled > self.timeout:
            reasons.append(f"a microbatch made no progress for {self.timeout:.0f} s: a stage worker is dead or stuck")
        if not reasons:
            return
        if self.recovery is None:
            raise TransportError(reasons[0])
        self._start_recovery(set(exited) | {self._index_of(name) for _, name in silent}, "; ".join(reasons))

    def exited(self) -> list[int]:
        """The stages whose launched process has exited."""
        if self._closed:
            return []
        return [index for index, process in enumerate(self._processes) if not process.alive()]

    def _check_processes(self) -> None:
        for number in self.exited():
            raise TransportError(f"the process of stage {number} exited with "
                                 f"{self._processes[number].exit_status()}")

    def _index_of(self, stage: str | int) -> int:
        """A stage's index, from its name or index (as a worker names itself)."""
        if isinstance(stage, int):
            return stage
        return next(index for index, info in enumerate(self.stage_table) if info.name == stage)

    # ---- recovery ---------------------------------------------------------------------------------
    def _start_recovery(self, dead: set[int], reason: str) -> None:
        """Recover on a thread of its own (the receiver keeps taking the stages' answers meanwhile). A failure
        reported while a recovery runs is looked at again once it ends."""
        with self._lock:
            if self._recovering is not None:
                self._failed_meanwhile = self._failed_meanwhile or reason
                return
            if self._failure is not None or self._closed:
                return
            self._held = True
            self._recovering = threading.Thread(target=self._recover, args=(dead, reason),
                                                name="dejavu-pipeline-recovery", daemon=True)
            self._recovering.start()  # started as it is set: whoever sees it may join it
        log.warning("recovering: %s", reason)
        _call_quietly(self.on_failure, reason)

    def _recover(self, dead: set[int], reason: str) -> None:
        """The recovery thread: up to ATTEMPTS recoveries (another stage may die meanwhile), then the pipeline
        goes on, or its requests fail; never does it stay held."""
        again: str | None = None
        try:
            report = self._recover_attempts(dead, reason)
            if report is None:
                return
            try:
                self.resume(report.epoch, report.resumed, report.recomputed, report.finished, report.failed)
            except TransportError as lost:  # a stage died as the pipeline went on: recover again
                again = f"resuming after a recovery failed: {lost}"
            _call_quietly(self.on_recovery, report)
            self.top_up()
        except Exception as error:  # whatever else stops a recovery fails the requests, rather than hang them
            self._fail(TransportError(f"recovery failed: {type(error).__name__}: {error}"))
        finally:
            with self._lock:
                self._recovering = None
                again = again or self._failed_meanwhile
                self._failed_meanwhile = None
        if again is not None:
            self._start_recovery(set(), again)
        self._admit()

    def _recover_attempts(self, dead: set[int], reason: str) -> RecoveryReport | None:
        error: Exception | None = None
        detected = time.monotonic()
        for _ in range(ATTEMPTS):
            _drain(self.replies)  # answers to an earlier attempt are of no use to this one
            try:
                report = Recovery(self, dead, reason, detected).run()
            except RecoveryRetry as retry:  # another stage died meanwhile: replace it too
                dead |= {self._index_of(name) for name in retry.stages}
                reason, error = f"{reason}; then {retry}", retry
                continue
            self.recoveries.append(report)
            return report
        self._fail(TransportError(f"recovery failed after {ATTEMPTS} attempts: {error}"))
        return None

    def new_epoch(self) -> int:
        with self._lock:
            self._epoch += 1
            return self._epoch

    def fence(self, index: int) -> None:
        """Make sure stage `index`'s launched process is gone (a stopped one would wake and speak out of turn)."""
        if index < len(self._processes) and self._processes[index].alive():
            self._processes[index].kill()

    def _launch(self) -> WorkerHandle:
        """A worker that joins this head, started by the launcher."""
        assert self.launcher is not None  # only launched pipelines start workers
        return self.launcher.start(self.url, self._token)

    def _pool_spare(self, join: Message) -> None:
        """A worker joined while no stage needs it: it loads the model, and waits as a standby once `warm`.
        One that cannot be reached is left out (a launched one is dropped with the next pruning)."""
        url = join.fields["url"]
        try:
            with open_transport(url, token=self._token) as link:
                link.send_tensor(pack(Message("standby", {"model": self.model, "threads": self.threads})))
        except TransportError as error:
            log.warning("a spare worker at %s is unreachable: %s", url, error)
            return
        with self._lock:
            self._warming[url] = int(join.fields["pid"])

    def _prune_spares(self) -> None:
        """Forget spares whose launched process has ended (they would be counted, or taken, in vain)."""
        with self._lock:
            gone = {pid for pid, spare in self._spares.items() if not spare.alive()}
            for pid in gone:
                del self._spares[pid]
            self._pool = [(url, pid) for url, pid in self._pool if pid not in gone]
            self._warming = {url: pid for url, pid in self._warming.items() if pid not in gone}

    def _warmed(self, url: str) -> None:
        with self._lock:
            if url in self._warming:
                self._pool.append((url, self._warming.pop(url)))

    def launch_replacements(self, stages: list[int]) -> None:
        """Make sure workers will be there to replace `stages`: standbys, or processes launched now (launched
        pipelines); otherwise workers started elsewhere must join (`dejavu worker --join URL`)."""
        self._prune_spares()
        if self.launch:
            while len(self._spares) < len(stages):  # every spare is joined already, or on its way
                spare = self._launch()
                self._spares[spare.pid] = spare
            return
        with self._lock:
            missing = len(stages) - len(self._pool)
        if missing > 0:
            log.warning("%s gone: start %d worker(s) with `dejavu worker --join %s` to replace them",
                        ", ".join(self.stage_table[index].name for index in stages), missing, self.url)

    def take_spare(self) -> tuple[str, int] | None:
        """A spare worker that joined (its inbox and pid), now taken off the pool; None when none has."""
        self._prune_spares()
        with self._lock:
            return self._pool.pop(0) if self._pool else None

    def top_up(self) -> None:
        """Launch spare workers until `standby` of them are joined or on their way."""
        self._prune_spares()
        while self.launch and len(self._spares) < self.standby and not self._closed:
            spare = self._launch()
            self._spares[spare.pid] = spare

    def place(self, index: int, url: str, pid: int) -> None:
        """The worker at `url` (process `pid`) will be stage `index`: its links and process are now the
        stage's (its assignment follows, once every replacement is placed)."""
        if self.launch:  # a worker started by hand has no handle here: heartbeats watch it
            self._processes[index] = self._spares.pop(pid) if pid in self._spares else JoinedWorker(pid)
        self._workers[index].close()
        self._urls[index] = url
        self._workers[index] = open_transport(url, token=self._token)
        with self._lock:
            self._assigned[self.stage_table[index].name] = self._epoch

    def heard_from(self, index: int) -> None:
        with self._lock:
            self._beats[self.stage_table[index].name] = time.monotonic()

    def holding_numbers(self) -> list[int]:
        """The microbatches some stage may hold a cache of: in flight, or ended but not yet freed."""
        with self._lock:
            return sorted(self._in_flight.keys() | self._reserved.keys())

    def in_flight_batches(self) -> list[tuple[int, Microbatch, str]]:
        """Each microbatch in flight and where it is: "prompting", "staged" (prefilled, waiting for the token
        pipeline) or "decoding"."""
        with self._lock:
            return [(number, batch, self._phase(batch)) for number, batch in sorted(self._in_flight.items())]

    def batch(self, number: int) -> Microbatch:
        return self._in_flight[number]

    def resume(self, epoch: int, resumed: dict[int, int], recomputed: list[int], finished: list[int],
               failed: Sequence[int] = ()) -> None:
        """After a recovery: feed each resumed microbatch the token of the step it resumes at, start the
        recomputed ones over from their prompts, settle the finished ones, fail the `failed` ones (in flight at
        two recoveries in a row without progress: poison); then let new work in."""
        first = self.decoding_stages()[0]
        sends: list[tuple[int, Message]] = []
        answers: list[tuple[Future[Result], Any]] = []
        with self._lock:
            for number in failed:
                answers += self._fail_rows(self._in_flight.pop(number), POISON)
            done = [self._in_flight.pop(number) for number in finished]
            for number in [number for number in self._reserved if number not in self._in_flight]:
                del self._reserved[number]  # ended: every stage dropped its cache
                self._progress.pop(number, None)
            self._staged.clear()
            self._freed_early.clear()
            self._prompting = len(recomputed) if self.disaggregated else 0
            self._decoding = len(resumed) if self.disaggregated else 0
            now = time.monotonic()
            for number, step in resumed.items():
                batch = self._in_flight[number]
                batch.rewind(step)
                tokens = torch.tensor([[row[-1]] for row in batch.generated], dtype=torch.long)
                sends.append((first, Message("decode", {"microbatch": number, "epoch": epoch}, (tokens,))))
                self._progress[number] = now
            for number in recomputed:
                batch = self._in_flight[number]
                batch.rewind(0)
                self._reserved[number] = cache_bytes(batch.requests, self.kv_bytes_per_token)  # freed, taken again
                sends.append((0, Message("prefill", {**batch.fields(), "epoch": epoch}, (batch.ids, batch.mask))))
                self._progress[number] = now
            self._held = False
        for batch in done:
            answers += [(batch.requests[row].future, batch.result(row, self.eos))
                        for row in range(len(batch.requests)) if row not in batch.settled]
        _answer(answers)
        for index, message in sends:
            self.send(index, message)

    def _fail(self, error: TransportError) -> None:
        """Fail every request in flight or waiting with `error`; later submissions raise it too."""
        with self._lock:
            if self._failure is None:
                self._failure = error
            self._held = False
            batches, self._in_flight, self._progress = list(self._in_flight.values()), {}, {}
            self._reserved.clear()
            self._freed_early.clear()
            waiting, self._waiting = list(self._waiting), deque()
        for request in [request for batch in batches for request in batch.requests] + waiting:
            _settle(request.future, error=error)


#: Messages about a microbatch's steps (and lost links): those of an epoch before the head's are dropped.
_STEPS = ("tokens", "prefilled", "ended", "freed", "link_lost", "microbatch_failed")
#: The stages' answers to a recovery's steps, handed to the recovery thread.
_REPLIES = ("paused", "relinked", "sent", "rewound", "ready")


def _stage_table(layouts: list[list[tuple[int, int]]]) -> list[StageInfo]:
    kinds = ("prompt", "token") if len(layouts) == 2 else ("mixed",)
    return [StageInfo(f"stage {number}" if kind == "mixed" else f"{kind} stage {number}", kind, number, layers)
            for kind, layout in zip(kinds, layouts, strict=True) for number, layers in enumerate(layout)]


def _check_recovery(recovery: Any, transport: str, layouts: list[list[tuple[int, int]]], swapping: bool,
                    model: Any, replica_store: bool = False) -> str | None:
    """`recovery` if this pipeline can recover that way ("auto": the best way it can); ConfigError otherwise."""
    if recovery is None:
        if replica_store:
            raise ConfigError("replica_store keeps replicas to recover from: give recovery='replicas' too")
        return None
    if recovery not in (*RECOVERY, "auto"):
        raise ConfigError(f"recovery={recovery!r}: use {', '.join(map(repr, RECOVERY))} or 'auto', or None to fail "
                          "the requests in flight when a stage dies")
    refusals = {"transport": None if transport == "tcp" else
                f"recovery needs tcp links, which reconnect to a replacement; {transport} links do not yet",
                "swapping": "recovery and swapping=True do not combine yet: recovery keeps every cache on the device"
                if swapping else None}
    replicas = {"ring": None if len(layouts[-1]) >= 2 or replica_store else
                "recovery='replicas' keeps each decoding stage's replica on the next one: it needs two decoding "
                "stages or more (or use recovery='recompute')",
                "window": "recovery='replicas' does not cover sliding-window attention layers yet; use "
                "recovery='recompute'" if any(getattr(layer, "sliding_window", None)
                                              for layer in DynamicCache(config=model.config).layers) else None}
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


def _open_replica_store(url: str | None, recovery: str | None) -> Store | None:
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


def _layouts(stages: int | None, layers: Sequence[tuple[int, int]] | None, prompt_stages: int | None,
             token_stages: int | None, total: int) -> list[list[tuple[int, int]]]:
    """The stages' layer ranges: one mixed pipeline (`layers`, or `stages` even cuts), or a prompt and a token
    pipeline of `prompt_stages` and `token_stages` even cuts each."""
    if prompt_stages is None and token_stages is None:
        return [_cuts(stages, layers, total)]
    if prompt_stages is None or token_stages is None:
        raise ConfigError("a disaggregated pipeline needs both prompt_stages= and token_stages=")
    if stages is not None or layers is not None:
        raise ConfigError("give stages=/layers= for one mixed pipeline, or prompt_stages= and token_stages= for "
                          "a disaggregated one, not both")
    return [_even(prompt_stages, total, "prompt_stages"), _even(token_stages, total, "token_stages")]


def _cuts(stages: int | None, layers: Sequence[tuple[int, int]] | None, total: int) -> list[tuple[int, int]]:
    """One pipeline's layer ranges: `layers` as given (contiguous from 0 to the last layer), or `stages` even
    cuts."""
    if layers is not None:
        cuts = [check_layers(pair, total) for pair in layers]
        ends = [0] + [stop for _, stop in cuts]
        if not cuts or [start for start, _ in cuts] != ends[:-1] or ends[-1] != total:
            raise ConfigError(f"layers={list(layers)!r} must cover the model's {total} layers in order, each "
                              "stage starting where the previous ends")
        if stages is not None and stages != len(cuts):
            raise ConfigError(f"stages={stages} but layers lists {len(cuts)} stages")
        return cuts
    return _even(1 if stages is None else stages, total, "stages")


def _even(stages: Any, total: int, name: str) -> list[tuple[int, int]]:
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ConfigError(f"{name} must be an integer from 1 to the model's {total} layers, got {stages!r}")
    return LayerPartition.even(total, stages).stages


def _plan(model: Any, machines: Any, plan: str, workload: tuple[int, int], microbatch: int,
          threads: int | None) -> Plan:
    """The planner's choice for `machines` stage processes, from this machine's measured prompt time Y and
    token time t of `model` on a microbatch of the `workload`'s (prompt tokens, new tokens), timed with the
    threads each stage process will have (on one machine, its share of the cores)."""
    if plan != "auto":
        raise ConfigError(f"plan={plan!r}: the only plan is 'auto' (the planner chooses from measured Y and t)")
    if isinstance(machines, bool) or not isinstance(machines, int) or machines < 1:
        raise ConfigError(f"machines must be a positive integer, got {machines!r}")
    prompt_tokens, new_tokens = _workload(workload)
    if machines == 1:
        return Plan(False, 0, 0, 1.0, "Keep one mixed pipeline: one machine cannot be split.", 1.0, 1.0,
                    float("inf"))
    prompt_time, token_time = measure_times(model, microbatch, prompt_tokens,
                                            threads=threads or max(1, (os.cpu_count() or 1) // machines))
    return make_plan(machines, prompt_time, token_time, new_tokens)


def _workload(workload: Any) -> tuple[int, int]:
    pair = tuple(workload) if isinstance(workload, (tuple, list)) else ()
    if len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in pair):
        raise ConfigError(f"workload is (prompt tokens, new tokens) of a typical request, got {workload!r}")
    return pair[0], pair[1]


def _drain(replies: queue.SimpleQueue[Message]) -> None:
    while not replies.empty():
        replies.get_nowait()


def _call_quietly(callback: Callable[[Any], None] | None, argument: Any) -> None:
    """Call a user's callback; its failure is logged, and stops nothing."""
    if callback is not None:
        try:
            callback(argument)
        except Exception:
            log.exception("a pipeline callback failed")


def _stream(calls: list[tuple[Callable[[int], None], int]]) -> None:
    """Give requests their new tokens (outside the head's lock); a failing callback stops none of the others."""
    for callback, token in calls:
        try:
            callback(token)
        except Exception:  # noqa: PERF203 - one callback's failure must not keep tokens from the others
            log.exception("a request's on_token callback failed")


def _answer(answers: list[tuple[Future[Result], Any]]) -> None:
    """Give each future its result or error (outside the head's lock)."""
    for future, answer in answers:
        if isinstance(answer, BaseException):
            _settle(future, error=answer)
        else:
            _settle(future, result=answer)


def _without(start: Message, rows: set[int]) -> Message:
    """A `start` message whose `ended` rows include `rows` (failed or cancelled since it was made)."""
    if not rows:
        return start
    tokens, mask, ended, rng = start.tensors
    ended = ended.clone()
    ended[sorted(rows)] = 1
    return Message(start.kind, start.fields, (tokens, mask, ended, rng))


def _settle(future: Future[Result], result: Result | None = None, error: BaseException | None = None) -> None:
    """Give a request's future its result or error, unless its caller cancelled it or it is settled already."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

