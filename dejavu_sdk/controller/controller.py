"""`Controller`: one model served behind an OpenAI-compatible HTTP API, from Python or `dejavu serve`.

    with dv.Controller("smollm2", prompt_stages=1, token_stages=1, port=8000) as controller:
        client = openai.OpenAI(base_url=controller.url + "/v1", api_key=controller.token)
        client.completions.create(model="smollm2", prompt="The KV cache is", max_tokens=32, temperature=0)

The controller is the pipeline's head as a service: it starts the stage workers (`dv.Pipeline`, the same
layouts and options), and answers HTTP on its own thread and event loop (`controller/api.py`) from the moment
it listens: requests sent while the workers start wait for them (up to `queue_timeout`). Clients present
`token=` (else `DEJAVU_TOKEN`, else a random one: `controller.token`) or one of `tokens`; the stage workers' links
are secured by a secret of their own, `worker_token=` (else `DEJAVU_WORKER_TOKEN`, else a random one), which
opens no client route, as no client token opens a worker link. It binds 127.0.0.1 unless given another host.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
from aiohttp import web

from ..errors import ConfigError, TransportError
from ..generation.batching import Result
from ..generation.logprobs import PromptLogprobs, TokenLogprobs
from ..models import load_tokenizer
from ..serving.options import check_body_limit
from ..serving.pipeline import Pipeline
from ..transports.access import TOKEN_VARIABLE
from ..transports.sockets import server_tls_context
from . import limits
from .adoption import Adoption
from .api import adopt, build_app
from .journal import Journal, JournaledRequest, JournalState
from .journal_lease import LEASE_SECONDS
from .limits import ApiLimits
from .metrics import ControllerMetrics
from .openai_requests import Choice
from .succession import former_port, stand_in

log = logging.getLogger(__name__)

#: The environment variable that may hold the stage workers' link token (`worker_token=`, `--worker-token-file`).
WORKER_TOKEN_VARIABLE = "DEJAVU_WORKER_TOKEN"

#: The largest request body accepted, bytes (a prompt of a few hundred thousand token ids).
MAX_BODY_BYTES = limits.MAX_BODY_BYTES
#: Seconds `start` waits for the HTTP server to listen, and for the journal's requests to be queued again.
LISTEN_TIMEOUT = ADOPT_TIMEOUT = 30.0
#: Seconds a successor gives its predecessor's stage workers to rejoin before it starts workers of its own
#: (they ask every 0.5 s from a second after the predecessor died; the wait ends once every stage is back).
REJOIN_WAIT = 3.0
#: Seconds a `/metrics` scrape waits for the stages' prompt-prefix figures (past it, it shows none of them).
PREFIX_STATS_SECONDS = 2.0


class Controller:
    """Serve `model` (as `dv.Pipeline` names it) over HTTP at `host:port` (0: a free port; see `url`).

    Layout and serving options (`stages`, `layers`, `prompt_stages`, `token_stages`, `microbatch`,
    `kv_budget_bytes`, `swapping`, `transport`, `timeout`, ...) go to the `Pipeline` it runs. `tokens`: more
    client tokens that the API accepts besides `token` (for example from a token file); each reads back and
    resumes the requests it made alone. `tokenizer`: for
    text prompts and texts in the answers (default: the model's own, when it has one; None: token ids only).
    `recovery` (default "auto"): a dead or hung stage is replaced and the requests in flight go on, from the
    replicas the decoding stages keep of each other where the layout allows it (`dv.Pipeline`'s `recovery`).
    Stage workers join at `worker_host:worker_port` (0: a free port); with `launch=False` none is started
    here: `dejavu worker --controller URL` on any machine asks `GET /v1/workers` where to join, then joins.

    `served_model_name`: the names clients use for the model (default: `model`), the first the one `/v1/models`
    lists first. Limits (`ApiLimits`): `max_waiting` choices waiting to start (429 past it), `max_prompts`
    choices in one request, `queue_timeout` seconds a request may wait to start (503 after), `max_body_bytes`.
    `tls_cert` and `tls_key` (PEM files): the API answers HTTPS only (`url` starts with https://).
    `journal`: a store URL that outlives the process, where every admitted request and every streamed token is
    recorded (`controller.journal`; `read_journal` reads it back); a token reaches its client once the journal
    holds it. A controller started on the journal of one that died goes on with its requests (`adoption` says
    which) under their ids, for their clients to resume (`GET /v1/requests/<id>/stream` with `Last-Event-ID`).
    `keep_finished`: seconds an ended request stays readable there (at most 10,000 ended requests are kept, in
    memory and in the journal).

    One controller writes a journal at a time: it holds the journal's lease (renewed every quarter of
    `journal_lease` seconds, default 3). Started on a journal whose lease another controller renews, it raises
    `JournalInUse` (`dejavu serve` exits with status 2); on one whose holder died, it waits up to `journal_lease`
    seconds to see the lease lapse, then takes over. `take_over_journal=True` takes the lease at once: the holder,
    if it still runs, finds it taken at its next renewal and writes no more (its `/health` says `journal_failed`).
    A journal that lost its records (an LMDB `data.mdb` of 0 bytes, records without their head) is refused
    (ConfigError) unless `journal_reset=True`, which discards what it holds and starts it empty.

    A journal write that fails is tried again every second. `journal_failure` says what happens meanwhile:
    "stop" (the default) holds back every token the journal does not hold (a stream ends with a 503
    `journal_failed` error event after 30 s), answers new requests 503 `journal_failed` and `/health` 503 with
    the reason, until the journal writes again; "serve" goes on without it, `/health` answering 200 `degraded`
    with the reason (a successor may not know what was streamed meanwhile). `/metrics` has
    `dejavu_journal_healthy` and `dejavu_journal_failed_writes_total`, `/v1/status` the journal's state.
    """

    def __init__(self, model: str, *, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
                 tokens: Sequence[str] = (), tokenizer: Any = "auto", max_body_bytes: int = MAX_BODY_BYTES,
                 max_waiting: int = limits.MAX_WAITING, max_prompts: int = limits.MAX_PROMPTS,
                 queue_timeout: float = limits.QUEUE_TIMEOUT, served_model_name: str | Sequence[str] | None = None,
                 recovery: str | None = "auto", worker_host: str = "127.0.0.1", worker_port: int = 0,
                 tls_cert: str | None = None, tls_key: str | None = None, worker_token: str | None = None,
                 journal: str | None = None, keep_finished: float = limits.KEEP_FINISHED,
                 journal_failure: str = "stop", journal_lease: float = LEASE_SECONDS, take_over_journal: bool = False,
                 journal_reset: bool = False, **pipeline_options: Any) -> None:
        check_body_limit(max_body_bytes)
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError("TLS needs both tls_cert (a PEM certificate chain) and tls_key (its private key)")
        self._tls = None if tls_cert is None or tls_key is None else server_tls_context(tls_cert, tls_key)
        self.limits = ApiLimits(max_waiting, max_prompts, queue_timeout, max_body_bytes, keep_finished)
        self.token = token or os.environ.get(TOKEN_VARIABLE) or secrets.token_urlsafe(24)
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [model])
        if not names or not all(isinstance(name, str) and name for name in names):
            raise ConfigError(f"served_model_name must be one or more non-empty names, got {served_model_name!r}")
        self.model_id, self.names = names[0], names
        self.journal = None if journal is None else Journal(
            journal, keep_finished=keep_finished, failure_policy=journal_failure, lease=journal_lease,
            take_over=take_over_journal, reset=journal_reset)
        try:
            # the workers of a predecessor on this journal rejoin where it had them join, with its token
            self._former = former = None if self.journal is None else self.journal.found.head
            given = worker_token or os.environ.get(WORKER_TOKEN_VARIABLE)
            self.worker_token = given or (former.token if former is not None else None) or secrets.token_urlsafe(24)
            self._drawn_worker_token = not given  # written to the journal for a successor; a given one never is
            if self.worker_token in (self.token, *tokens):
                raise ConfigError("the workers' token must differ from every client token: a client must not be "
                                  "able to open a worker link")
            if former is not None and worker_port == 0:
                worker_port = former_port(former.url, worker_host)
            if former is not None and former.prefix is not None:  # the replicas its workers hold are named so
                pipeline_options.setdefault("replica_prefix", former.prefix)
            self.pipeline = Pipeline(model, token=self.worker_token, recovery=recovery, host=worker_host,
                                     port=worker_port, **pipeline_options)  # ConfigError before any process starts
            launcher = self.pipeline.options.launcher
            orphans = former is not None and (launcher is None or getattr(launcher, "outlives_head", True))
            self._rejoin_wait = REJOIN_WAIT if orphans else 0.0
        except BaseException:
            if self.journal is not None:
                self.journal.close()
            raise
        self.tokenizer = load_tokenizer(model) if tokenizer == "auto" else tokenizer
        self.context = self.pipeline.context
        self.eos = self.pipeline.eos
        self.metrics = ControllerMetrics()
        self.pipeline.on_failure = lambda _: self.metrics.failures.inc()
        self.pipeline.on_recovery = self._recovered
        if self.pipeline.options.prefixes.tiers:
            self.metrics.watch_prefixes(lambda: self.pipeline.stage_stats(PREFIX_STATS_SECONDS))
        if self.journal is not None:
            self.metrics.watch_journal(self.journal)
            self.pipeline.on_entered = self.journal.slot_group
        self.host, self.port = host, port
        self._tokens = [self.token, *tokens]
        self._draining = False
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._app: web.Application | None = None
        self.adoption = Adoption()
        self._adopting = False  # taking over a journal's requests: "starting" until they are queued
        self._thread: threading.Thread | None = None
        self._url: str | None = None
        self._failures_seen = 0
        self._lock = threading.Lock()

    def _recovered(self, report: Any) -> None:
        self.metrics.recovered(report.total)
        self._journal_head()  # a new epoch: a successor goes beyond it

    @property
    def url(self) -> str:
        """`http://host:port` (with TLS: https) once started."""
        if self._url is None:
            raise ConfigError("the controller has not started: use it in a with block, or call start()")
        return self._url

    # ---- what the API serves from -------------------------------------------------------------------
    def submit(self, choices: list[Choice], on_token: Callable[[int, int], None],
               on_logprobs: Callable[[int, TokenLogprobs | PromptLogprobs], None] | None = None,
               tags: Sequence[Any] | None = None, salt: str = "") -> list[Future[Result]]:
        """Queue the choices as one submission (admission takes turns between submissions: a request's choices
        take one turn at a time, however many they are), each with its own limit and seed (an unseeded sampled
        choice draws its own); `on_token(index, id)` as tokens arrive, each after its log-probabilities to
        `on_logprobs(index, entry)` where asked; `tags`: each choice's name in the journal; `salt`: its tenant's,
        for the prompt prefixes it reads and keeps. All are checked before any is queued (ConfigError)."""
        if not choices:  # an adopted request that had ended: nothing to queue
            return []
        settings = _but_seed(choices[0].decoding)
        if any(_but_seed(choice.decoding) != settings for choice in choices):
            raise ConfigError("the choices of one request differ in more than their seeds")
        futures = self.pipeline.submit_all([choice.prompt for choice in choices],
                                           [choice.max_tokens for choice in choices],
                                           seed=[choice.decoding.get("seed") for choice in choices], on_token=on_token,
                                           on_logprobs=on_logprobs, tags=tags, cache_salt=salt, **settings)
        for future in futures:
            future.add_done_callback(self._note_failure)
        return futures

    def health(self) -> tuple[str, str]:
        """("serving" | "degraded" | "starting" | "recovering" | "draining" | "failed" | "journal_failed", why)."""
        if self._draining:
            return "draining", "the server is shutting down: it finishes the requests it has and takes no new ones"
        state, why = self.pipeline.health()
        if state in ("failed", "starting"):
            return state, why
        if self._adopting:
            return "starting", "taking over the requests of the journal"
        journal = None if self.journal is None else self.journal.health()
        if journal is not None:
            return journal
        return (state, why) if state == "recovering" else ("serving", "")

    def waiting(self) -> int:
        return self.pipeline.waiting()

    def none_started(self, futures: Sequence[Future[Result]]) -> bool:
        return all(not future.done() and self.started_at(future) is None for future in futures)

    def started_at(self, future: Future[Result]) -> float | None:
        request = self.pipeline.request_of(future)
        return None if request is None else request.started

    def cached_positions(self, future: Future[Result]) -> int:
        request = self.pipeline.request_of(future)
        return 0 if request is None else request.cached

    def status(self, readable: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """The pipeline's status, the journal's, and what this controller took over from a journal (`adopted`): of
        the request ids there, those `readable` says yes to (None: all; the API lists a client's own)."""
        adoption = self.adoption if readable is None else self.adoption.readable(readable)
        return {"model": self.model_id, **self.pipeline.status(), "adopted": attrs.asdict(adoption),
                **({} if self.journal is None else {"journal": self.journal.status()})}

    @property
    def join_url(self) -> str:
        return self.pipeline.url

    def _note_failure(self, future: Future[Result]) -> None:
        """Count a failure that failed requests (with recovery, each was counted as its recovery started)."""
        if self.pipeline.recovery is None and not future.cancelled() and isinstance(future.exception(),
                                                                                    TransportError):
            with self._lock:
                first = self._failures_seen == 0
                self._failures_seen += 1
            if first:  # one stage failure fails every request in flight: count it once
                self.metrics.failures.inc()

    # ---- life cycle -----------------------------------------------------------------------------------
    def drain(self, timeout: float) -> bool:
        """Take no new requests (`/health` and new requests answer 503 "draining") and wait up to `timeout`
        seconds for those waiting or running to finish; whether they all did. `close` then stops the workers
        (and fails what is left)."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while not self.pipeline.idle():
            if time.monotonic() > deadline or not self.pipeline.running:
                return self.pipeline.idle()
            time.sleep(0.05)
        return True

    def start(self) -> Controller:
        """Start the HTTP server and the stage workers (which may ask it where to join); return once both are
        up."""
        try:
            began = time.monotonic()
            inherited = [] if self.journal is None else self._inherited()
            read = time.monotonic()
            read_seconds = read - began + (0.0 if self.journal is None else self.journal.read_seconds)
            lease_seconds = 0.0 if self.journal is None else self.journal.lease_seconds
            self._adopting = bool(inherited)
            self.pipeline.listen()
            if self.journal is not None:
                if self._former is not None:  # what the old pipeline's stages still send is of an older epoch
                    self.pipeline.fleet.epoch = self._former.epoch + 1
                self._journal_head()
            self._start_http()
            if not self.pipeline.launch:
                log.warning("waiting for %d stage workers: start each with `dejavu worker --controller %s`",
                            len(self.pipeline.stage_table), self.url)
            self.pipeline.start(self._rejoin_wait, hold=self._rejoin_wait > 0)
            started = time.monotonic()
            self._adopt(inherited)
            self._adopting = False
            self._journal_head()  # its epoch, past the rejoined workers'
            self._started = True
            self.adoption = attrs.evolve(self.adoption, rejoined=list(self.pipeline.fleet.rejoined),
                                         read_seconds=read_seconds, lease_seconds=lease_seconds,
                                         workers_seconds=started - read, adopt_seconds=time.monotonic() - started)
            if self.journal is not None:  # taken over: what it found is held by the runs and the journal now
                self.journal.found = JournalState()
        except BaseException:
            self.close()
            raise
        log.info("serving %s at %s", self.model_id, self.url)
        return self

    def _journal_head(self) -> None:
        """Write where the workers join, their token if this controller drew it, and the pipeline's epoch."""
        if self.journal is not None:
            self.journal.head(self.pipeline.url, self.worker_token if self._drawn_worker_token else None,
                              self.pipeline.fleet.epoch, self.pipeline.options.resilience.replica_prefix)

    def _inherited(self) -> list[JournaledRequest]:
        """The requests of the journal a successor takes over: those not answered, and those answered within
        `keep_finished` seconds."""
        assert self.journal is not None
        now = time.time()
        return [journaled for journaled in self.journal.found.requests.values()
                if journaled.answered is None or now - journaled.answered_at <= self.limits.keep_finished]

    def _adopt(self, inherited: list[JournaledRequest]) -> None:
        """Go on with the journal's requests (queued while the pipeline holds them), then with the microbatches
        that rejoined workers still hold (`Pipeline.take_over`), which lets requests start."""
        assert self._loop is not None
        assert self._app is not None
        runs = [] if not inherited else asyncio.run_coroutine_threadsafe(
            adopt(self._app, inherited), self._loop).result(ADOPT_TIMEOUT)
        going = [run for run in runs if not run.state.ended]
        running = {run.id: [index for index, state in enumerate(run.states) if state.finish is None] for run in going}
        found = JournalState() if self.journal is None else self.journal.found
        report = self.pipeline.take_over(found.slots, functools.partial(stand_in, found))
        taken = {(str(tag[0]), int(tag[1])) for tag in report.tags}
        over = {run.id: [index for index in running[run.id] if (run.id, index) in taken] for run in going}
        again = {run.id: [index for index in running[run.id] if (run.id, index) not in taken] for run in going}
        self.adoption = Adoption([run.id for run in going],
                                 {run.id: sum(len(run.known[index]) for index in over[run.id])
                                  for run in going if over[run.id]},
                                 {run.id: sum(len(run.known[index]) for index in again[run.id])
                                  for run in going if any(run.known[index] for index in again[run.id])},
                                 [run.id for run in runs if run.state.ended])
        if going:
            log.warning("took over %d requests from the journal, %d from the caches their predecessor's stages "
                        "held; %d tokens it held are computed again from their prompts: %s", len(going),
                        len(self.adoption.taken_over), sum(self.adoption.recomputed.values()),
                        ", ".join(self.adoption.going_on))

    def _start_http(self) -> None:
        try:
            listener = socket.create_server((self.host, self.port), family=socket.AF_INET6 if ":" in self.host
                                            else socket.AF_INET)
        except OSError as error:
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {error}") from error
        port = listener.getsockname()[1]
        scheme = "http" if self._tls is None else "https"
        self._url = f"{scheme}://[{self.host}]:{port}" if ":" in self.host else f"{scheme}://{self.host}:{port}"
        loop = asyncio.new_event_loop()
        ready: Future[None] = Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._app = build_app(self, self._tokens, self.worker_token, self.limits)
            runner = web.AppRunner(self._app, access_log=None,
                                   handler_cancellation=True)  # a client that leaves cancels its request
            try:
                loop.run_until_complete(runner.setup())
                loop.run_until_complete(web.SockSite(runner, listener, ssl_context=self._tls).start())
            except BaseException as error:
                ready.set_exception(error)
                return
            ready.set_result(None)
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="dejavu-controller-http", daemon=True)
        self._thread.start()
        ready.result(timeout=LISTEN_TIMEOUT)

    def close(self) -> None:
        """Stop the workers, then stop answering HTTP: the requests still running fail while the API's loop runs,
        and their clients are told so. Closing twice is harmless."""
        self.pipeline.close()
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop = self._thread = None
        if self.journal is not None:
            if self._started:  # its workers are told to stop: a successor waits for none to rejoin
                self.journal.head(None)
            self.journal.close()

    def __enter__(self) -> Controller:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _but_seed(decoding: dict[str, Any]) -> dict[str, Any]:
    """A choice's decoding settings but its seed (the choices of one request differ in their seeds alone)."""
    return {name: value for name, value in decoding.items() if name != "seed"}
