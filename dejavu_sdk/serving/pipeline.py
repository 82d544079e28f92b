"""`Pipeline`: one model cut into stages that run in separate processes, serving requests in microbatches.

    with dv.Pipeline("smollm2", stages=2, microbatch=4) as pipe:    # stage processes start here
        outs = pipe.generate([ids_a, ids_b], max_new_tokens=64)     # each request's new ids, prompt excluded
        future = pipe.submit(ids, max_new_tokens=64)                # a concurrent.futures.Future of a Result
    dv.Pipeline("smollm2", prompt_stages=1, token_stages=2)         # prompt/token disaggregation
    dv.Pipeline("smollm2", machines=3, plan="auto")                 # the planner lays out 3 processes

The pipeline is the head, a thin facade over its parts: `options` (every option checked once), `layout` (the
stages and their links), `fleet` (the worker processes), `ledger` (every request and slot in flight, and the
decisions) and `head` (`head.receiver.HeadReceiver`: its receiver thread takes the workers' messages, carries out
what the ledger makes of each, watches the stages, and runs the recoveries).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from ..errors import ConfigError, TransportError
from ..generation.admission import Admission
from ..generation.batching import Request, Result
from ..generation.logprobs import PromptLogprobs, TokenLogprobs
from ..generation.slot_policy import slot_policy
from .head.fleet import Fleet
from .head.ledger import Ledger, Outcome
from .head.receiver import HeadReceiver
from .head.recovery import RecoveryReport
from .head.submissions import submission
from .head.takeover import TakeoverReport
from .options import PipelineOptions


class Pipeline:
    """Serve `model` (`smollm2`, a Hugging Face directory, or `package.module:function`) in stage processes,
    `microbatch` requests at a time, laid out as one of:

    - one mixed pipeline of `stages` even stages (or the cuts in `layers`, e.g. `[(0, 12), (12, 30)]`) that
      runs prompts and tokens alike;
    - disaggregated: a prompt pipeline of `prompt_stages` and a token pipeline of `token_stages` even stages,
      each prompt stage streaming every layer's KV as it is done to the token stage that owns it; the token side
      holds at most `token_slots` microbatches' KV (default: one per stage of either pipeline);
    - `machines` processes laid out by the planner (`plan="auto"`), from Y and t measured here on a microbatch
      of the `workload`'s (prompt tokens, new tokens); its answer is `self.plan`.

    Each microbatch is a slot of up to `microbatch` rows (default, with `threads`: `serving.defaults`, shown in
    `status()`). `batching="continuous"` (the default) lets a row leave
    as it ends and a waiting request join between steps, its prompt prefilled beside the others' decoding
    (`max_prefill_tokens` positions a step; `Result.schedule` replays exactly through `generation.replay`);
    `batching="static"` runs each microbatch until its last row ends, equal to `model.generate` on it.

    `PipelineOptions` checks and describes the other options: KV budget and swapping, transport, failure
    detection, recovery, launchers, and the head's address and secret.
    `on_recovery(report)` is called after each recovery (on its thread), `on_failure(reason)` as one starts.
    """

    def __init__(self, model: str, stages: int | None = None, **options: Any) -> None:
        self.options = checked = PipelineOptions.check(model, stages, **options)  # ConfigError before any process
        self.layout = layout = checked.layout
        self.plan = checked.plan  # the planner's answer, when `machines` asked for one
        #: Mixed: every stage's layers. Disaggregated: the prompt pipeline's, then the token pipeline's.
        self.layouts, self.disaggregated, self.stage_table = layout.pipelines, layout.disaggregated, layout.stages
        self.model, self.microbatch, self.timeout = model, checked.microbatch, checked.watch.timeout
        self.transport, memory = checked.links.transport, checked.memory
        self.swapping, self.swap_choice = memory.swapping, memory.swap_choice
        self.recovery, rules = checked.resilience.recovery, checked.rules
        self.context, self.vocabulary, self.pad, self.eos = rules.context, rules.vocabulary, rules.pad, checked.eos
        self.launch = checked.launcher is not None
        #: Called with each recovery's report, and with each failure's description as a recovery starts.
        self.on_recovery: Callable[[RecoveryReport], None] | None = None
        self.on_failure: Callable[[str], None] | None = None
        #: Mixed stages: called with each group's slot, its requests' numbers there and their `tags`, as it is sent
        #: into the slot, before any stage hears of it (a journal's record of which rows a successor finds in the
        #: stages' caches).
        self.on_entered: Callable[[int, list[int], list[Any]], object] | None = None
        self.fleet = Fleet(checked, lambda: self.url)
        self.ledger = Ledger(layout, self.microbatch, checked.token_slots, self.eos, self.pad,
                             Admission(memory.kv_budget, self.swapping, memory.kv_bytes_per_token),
                             lambda: self.fleet.epoch, slot_policy(checked.batching),
                             prefill_tokens=checked.max_prefill_tokens, prefixes=bool(checked.prefixes.tiers))
        self.batching = checked.batching  # "continuous" or "static": the slots' policy (see `PipelineOptions`)
        self.head = HeadReceiver(checked, self.fleet, self.ledger, lambda: self._closed, lambda: self.on_entered,
                                 lambda: self.on_failure, lambda: self.on_recovery)
        #: Each recovery so far, in order.
        self.recoveries = self.head.recoveries.reports
        self._starting = False  # start() is under way: submissions wait for it (bounded by `timeout`)
        self._running = threading.Event()
        self._closed = False
        self._requests: weakref.WeakKeyDictionary[Future[Result], Request] = weakref.WeakKeyDictionary()

    @property
    def most_in_flight(self) -> int:
        """The most microbatches (slots) that held rows at once (in their caches, or on their way in)."""
        return self.ledger.most_in_flight

    # ---- life cycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Where workers join (`dejavu worker --join URL`); set once the pipeline has started."""
        if self.head.inbox is None:
            raise ConfigError("the pipeline has not started: use it in a with block, or call start()")
        return self.head.inbox.url

    def listen(self) -> str:
        """Open the head's inbox, where workers join (`url`), without waiting for them: `start` does."""
        return self.head.listen()

    def start(self, rejoin_wait: float = 0.0, hold: bool = False) -> Pipeline:
        """Listen, launch (or wait for) the stage workers, assign them their stages, and wait until all have
        loaded them. `rejoin_wait`: seconds first given to the workers of a head that served at this address
        and died to take their stages back (`rejoined`), before workers are launched for the others. `hold`:
        start no request (nor a recovery) until `take_over`, which goes on with what the rejoined workers hold
        (requests submitted meanwhile wait); without it, rejoined workers drop what they held."""
        self.listen()
        self.ledger.held = self.fleet.taking_over = self.head.recoveries.taking_over = hold
        self._starting = True
        try:
            assert self.head.inbox is not None  # listening
            self.fleet.start(self.head.inbox, self.eos, self.pad, self.recovery is not None, rejoin_wait)
        except BaseException:
            self.close()
            raise
        self.head.start()
        self._running.set()
        return self

    def take_over(self, groups: Mapping[int, Sequence[tuple[Sequence[int], Sequence[Any]]]],
                  stand_in: Callable[[Any], Request | None]) -> TakeoverReport:
        """Go on with what the rejoined workers of a former head hold (`takeover`): its slots, whose groups (their
        requests' numbers there, and tags) `groups` gives by slot. The requests of those tags, submitted here (held:
        `start(hold=True)`), go on from the stages' caches where every stage can, else are computed again;
        `stand_in(tag)` is a request like the one a row had whose request ended, or None. Then requests start."""
        return self.head.recoveries.take_over(groups, stand_in, self.head.carry_out)

    closed = property(lambda self: self._closed, doc="Whether `close` has been called.")

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers and fail whatever is still waiting. Closing twice is harmless."""
        with self.ledger.lock:  # a recovery starts under it, or sees the pipeline closed
            if self._closed:
                return
            self._closed = True
        self._running.set()  # submissions waiting for the start see it closed
        holding = self.ledger.holding_numbers()
        self.head.fail(TransportError("the pipeline was closed"))
        self.head.recoveries.join(timeout=10)
        self.fleet.close()
        self.head.close(holding)

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, ids: Any, max_new_tokens: int = 32, *, do_sample: bool = False, seed: int | None = None,
               on_token: Callable[[int], None] | None = None,
               on_logprobs: Callable[[TokenLogprobs | PromptLogprobs], None] | None = None,
               **settings: Any) -> Future[Result]:
        """Queue one prompt `[T]`; the future gets its `Result` (new tokens, and where it was served).

        Greedy by default; `do_sample=True` samples with `temperature` (below 1e-5: greedy), `top_k`, `top_p`,
        `min_p` (unset ones from the model's generation config) from a generator of the request's own seeded with
        `seed` (drawn when not given, and returned in the result): alone in its microbatch, its tokens equal
        `torch.manual_seed(seed)` then `model.generate(..., do_sample=True)`. A request ends at the model's
        end-of-sequence ids (not with `ignore_eos=True`) and at its own `stop_token_ids`, never before `min_tokens`
        new tokens. `logprobs=n` and `prompt_logprobs=n` (0 to 20) report the log-probability of each new (prompt)
        token and of the n most likely at its position (`Result.logprobs`, `Result.prompt_logprobs`;
        `on_logprobs` gets the prompt's `PromptLogprobs` before the first token, and each token's `TokenLogprobs`
        before `on_token(id)` gets the token, on the head's receiver thread: keep them short). Requests of any
        settings share microbatches. The future is answered when its request ends, with its `Result`, or a
        `RequestFailed` of its own (the others go on), or the `TransportError` that stopped the pipeline.
        `future.cancel()` takes a waiting request off the queue, and ends a running one at its next step. A
        pipeline still starting queues the request once it is running. `cache_salt`: its tenant's, for the prompt
        prefixes it reads and keeps (`prefix_cache`)."""
        listener = None if on_token is None else (lambda _, token: on_token(token))
        scores = None if on_logprobs is None else (lambda _, entry: on_logprobs(entry))
        return self.submit_all([ids], max_new_tokens, do_sample=do_sample, seed=seed, on_token=listener,
                               on_logprobs=scores, **settings)[0]

    def submit_all(self, prompts: Sequence[Any], max_new_tokens: int | Sequence[int] = 32, *, do_sample: bool = False,
                   seed: int | Sequence[int | None] | None = None, on_token: Callable[[int, int], None] | None = None,
                   on_logprobs: Callable[[int, TokenLogprobs | PromptLogprobs], None] | None = None,
                   tags: Sequence[Any] | None = None, **settings: Any) -> list[Future[Result]]:
        """Queue several prompts together, in order, every one checked before any is queued (ConfigError;
        `RequestTooLarge` for one whose KV cache could never fit `kv_budget_bytes`, even alone); decoding as in
        `submit`, each prompt from its own generator seeded with `seed` (or with its own of a sequence of seeds,
        a prompt each, None drawing one), up to `max_new_tokens` (or its own of a sequence); `on_token(index,
        id)` gets the new tokens of `prompts[index]` as they arrive, and `on_logprobs(index, entry)` their
        log-probabilities, as `submit`'s `on_logprobs`. `tags`: what the caller calls each prompt (JSON values),
        as `on_entered` reports them.

        The prompts are one submission. Admission takes turns between submissions, the one with the fewest rows
        in flight first: a long list does not hold back a submission that comes after it, and one that has no
        row in flight while another holds more than its share of the layout's rows gets a microbatch (or slot)
        beside them, which only submissions without rows elsewhere join."""
        self._wait_until_running()
        requests = submission(prompts, max_new_tokens, do_sample, seed, on_token, on_logprobs, tags, settings,
                              self.options.rules)
        for request in requests:  # all checked before any is queued
            self.ledger.policy.check_alone(self.ledger.admission, request)  # else it would wait for ever
        self.ledger.queue(requests)
        for request in requests:
            self._requests[request.future] = request
            request.future.add_done_callback(functools.partial(self._answered, request))
        self.head.admit()
        return [request.future for request in requests]

    def generate(self, prompts: Sequence[Any], max_new_tokens: int = 32, *, do_sample: bool = False,
                 seed: int | None = None, **settings: Any) -> list[torch.Tensor]:
        """Each prompt's new token ids (prompt excluded), queued together and served in microbatches in the
        order given; decoding as in `submit`."""
        futures = self.submit_all(prompts, max_new_tokens, do_sample=do_sample, seed=seed, **settings)
        return [future.result().tokens for future in futures]

    def cancel(self, future: Future[Result]) -> bool:
        """Cancel the request `future` belongs to (as `future.cancel()` does): a waiting request is never
        computed, a running one ends at its next step. False when it had its answer already."""
        return future.cancel()

    def idle(self) -> bool:
        """Whether no request waits and no microbatch is in flight."""
        status = self.ledger.status()
        return not status["waiting"] and not status["microbatches"]

    def waiting(self) -> int:
        """How many requests wait to start."""
        return len(self.ledger.waiting)

    def request_of(self, future: Future[Result]) -> Request | None:
        """The request of `future` (None: not this pipeline's), with when it left the waiting queue (`started`) and
        the prompt positions it read from the prompt prefixes (`cached`, as soon as its first round is in)."""
        return self._requests.get(future)

    @property
    def running(self) -> bool:
        """Whether it has started, and has not closed nor failed."""
        return self._running.is_set() and not self._closed and self.ledger.failure is None

    @property
    def recovering(self) -> bool:
        """Whether a recovery is under way."""
        return self.head.recoveries.running

    def health(self) -> tuple[str, str]:
        """Whether it serves: ("failed" | "starting" | "recovering" | "running", why)."""
        if self.ledger.failure is not None:
            return "failed", f"the pipeline failed: {self.ledger.failure}"
        if self._closed:
            return "failed", "the pipeline is closed"
        if not self.running:
            return "starting", "the stage workers are starting"
        if self.recovering:
            return "recovering", "a failed stage is being replaced; requests wait for it"
        return "running", ""

    def _wait_until_running(self) -> None:
        """Return once the pipeline runs: at once, or when a start under way ends (within `timeout`)."""
        if self._closed or not (self._starting or self._running.is_set()):
            raise ConfigError("the pipeline is not running: use it in a with block, or call start()")
        if not self._running.wait(self.timeout):
            raise TransportError(f"the pipeline did not finish starting within {self.timeout:.0f} s")
        if self._closed:
            raise ConfigError("the pipeline is closed")

    def _answered(self, request: Request, future: Future[Result]) -> None:
        """A request's future is done: when its caller cancelled it, the ledger takes it off the queue or ends
        its row."""
        if future.cancelled():
            self.head.carry_out(Outcome(sends=self.ledger.cancel(request)))

    # ---- for operators ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """A snapshot for operators: the layout and its stages (whether each launched process lives), the
        microbatches in flight and their steps, the requests waiting, and the failure that stopped it, if any."""
        failure, options = self.ledger.failure, self.options
        return {"layout": "disaggregated" if self.disaggregated else "mixed", "stages": self.fleet.stage_status(),
                **self.ledger.status(), "swapping": self.swapping, "kv_budget_bytes": options.memory.kv_budget,
                "recovery": self.recovery, "batching": options.batching, "defaults": options.defaults.status(),
                "epoch": self.fleet.epoch, "recovering": self.head.recoveries.running,
                "standby": self.fleet.spare_pids(), "recoveries": [attrs.asdict(report) for report in self.recoveries],
                "failure": None if failure is None else str(failure)}

    def stage_stats(self, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        """Each stage's figures now: whether it swaps, KV device bytes held now and at most (`held_kv_bytes`,
        `peak_kv_bytes`), swap-ins and the seconds it waited for them, `staged_kv` (microbatches or groups whose
        prompt KV a token stage holds before their first step), torch `threads` and whether they follow the cores
        other processes leave idle (`threads_follow_load`), and the last stage's `row_steps` (rows given a token)."""
        return self.fleet.collect_stats(timeout, lambda: self.ledger.failure)

