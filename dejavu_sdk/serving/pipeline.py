"""`Pipeline`: one model cut into stages that run in separate processes, serving requests in microbatches.

    with dv.Pipeline("smollm2", stages=2, microbatch=4) as pipe:    # stage processes start here
        outs = pipe.generate([ids_a, ids_b], max_new_tokens=64)     # each request's new ids, prompt excluded
        future = pipe.submit(ids, max_new_tokens=64)                # a concurrent.futures.Future of a Result

The pipeline is the head: it owns the request queue, forms microbatches in arrival order, keeps up to one
microbatch per stage in flight, and collects each step's tokens from the last stage. Stage workers join it
(`dejavu worker --join URL`; `Pipeline` launches them as local processes unless `launch=False`, in which
case workers started elsewhere join it) and are assigned stages in the order they join. Every link is a
transport with a shared secret token; a worker that dies or stops answering fails the requests in flight
with `TransportError` instead of leaving them waiting.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch

from ..backends import open_transport, serve
from ..errors import ConfigError, StoreError, TransportError
from ..models import load_model
from ..stream import LayerPartition
from ..transports.base import Server, Transport
from .adapters import adapter_for
from .batching import Microbatch, Request, Result, check_new_tokens, check_prompt, take_microbatch
from .decoding import GREEDY_UNSUPPORTED, SAMPLING_UNSUPPORTED, Decoding, check_unsupported
from .messages import Message, pack, unpack
from .stage import check_layers

#: Seconds the head waits for every worker to join and load its stage.
START_TIMEOUT = 300.0


class Pipeline:
    """Serve `model` (`smollm2`, a Hugging Face directory, or `package.module:function`) cut into `stages`
    even stages (or the cuts in `layers`, e.g. `[(0, 12), (12, 30)]`), `microbatch` requests at a time.

    `timeout`: seconds a microbatch in flight may go without a new token before the requests fail with
    `TransportError` (a stage dead or stuck). `threads`: torch threads per stage process (default: this
    machine's cores shared between the stages). `host`/`port`: where the head listens for its workers.
    """

    def __init__(self, model: str, stages: int | None = None, *, layers: Sequence[tuple[int, int]] | None = None,
                 microbatch: int = 4, transport: str = "tcp", timeout: float = 60.0, threads: int | None = None,
                 launch: bool = True, host: str = "127.0.0.1", port: int = 0) -> None:
        if transport != "tcp":
            raise ConfigError(f"transport={transport!r}: pipelines run over tcp")
        if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1:
            raise ConfigError(f"microbatch must be a positive integer, got {microbatch!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        reference = load_model(model)  # ConfigError for a bad name, before any process starts
        adapter = adapter_for(reference)  # ConfigError for an architecture without an adapter
        total = len(adapter.decoder_layers())
        self.layers = _cuts(stages, layers, total)
        config, generation = reference.config, reference.generation_config
        check_unsupported(generation, GREEDY_UNSUPPORTED, "decoding greedily")
        try:
            check_unsupported(generation, SAMPLING_UNSUPPORTED, "sampling")
            self._sampling_refused: ConfigError | None = None
        except ConfigError as refusal:  # greedy requests are still served
            self._sampling_refused = refusal
        self.context: int | None = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions",
                                                                                                  None)
        eos = generation.eos_token_id
        #: Every end-of-sequence token id (some models have several); a row ends at any of them.
        self.eos: list[int] = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        pad = generation.pad_token_id if generation.pad_token_id is not None else config.pad_token_id
        self.pad: int = pad if pad is not None else (self.eos[0] if self.eos else 0)
        self.vocabulary: int = config.vocab_size
        del reference
        self.model, self.microbatch, self.timeout = model, microbatch, float(timeout)
        self.threads = threads or max(1, (os.cpu_count() or 1) // len(self.layers))
        self.launch, self.host, self.port = launch, host, port
        if not launch and not os.environ.get("DEJAVU_TOKEN"):
            raise ConfigError("launch=False: workers started elsewhere must present the head's token; set "
                              "DEJAVU_TOKEN to a shared secret here and for every `dejavu worker`")
        self._token = os.environ.get("DEJAVU_TOKEN") or secrets.token_hex(16)
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._in_flight: dict[int, Microbatch] = {}
        self._progress: dict[int, float] = {}  # per microbatch in flight: when it last made progress
        self._next_microbatch = 0
        self._failure: TransportError | None = None
        self._processes: list[subprocess.Popen[bytes]] = []
        self._workers: list[Transport] = []
        self._inbox: Server | None = None
        self._receiver: threading.Thread | None = None
        self._closed = False

    # ---- life cycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Where workers join (`dejavu worker --join URL`); set once the pipeline has started."""
        if self._inbox is None:
            raise ConfigError("the pipeline has not started: use it in a with block, or call start()")
        return self._inbox.url

    def start(self) -> Pipeline:
        """Listen, launch (or wait for) the stage workers, assign them their stages, and wait until all have
        loaded them."""
        self._inbox = serve(f"tcp://{self.host}:{self.port}", token=self._token)
        try:
            if self.launch:
                environment = {**os.environ, "DEJAVU_TOKEN": self._token}
                for _ in self.layers:
                    self._processes.append(subprocess.Popen(
                        [sys.executable, "-m", "dejavu_sdk.cli", "worker", "--join", self.url], env=environment))
            self._assign_stages()
        except BaseException:
            self.close()
            raise
        self._receiver = threading.Thread(target=self._receive, name="dejavu-pipeline-head", daemon=True)
        self._receiver.start()
        return self

    def _assign_stages(self) -> None:
        assert self._inbox is not None
        deadline = time.monotonic() + START_TIMEOUT
        joined: list[str] = []
        while len(joined) < len(self.layers):
            message = self._next_message(deadline, "every stage worker to join")
            if message.kind == "join":
                joined.append(message.fields["url"])
        self._workers = [open_transport(url, token=self._token) for url in joined]
        for number, layers in enumerate(self.layers):
            following = joined[number + 1] if number + 1 < len(joined) else None
            self._workers[number].send_tensor(pack(Message("assign", {
                "model": self.model, "layers": list(layers), "stage": number, "stages": len(self.layers),
                "next": following, "first": joined[0], "threads": self.threads, "eos": self.eos, "pad": self.pad})))
        ready: set[int] = set()
        while len(ready) < len(self.layers):
            message = self._next_message(deadline, "every stage worker to load its stage")
            if message.kind == "failed":
                raise ConfigError(f"stage {message.fields['stage']} could not start: {message.fields['error']}")
            if message.kind == "ready":
                ready.add(message.fields["stage"])

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
        self._fail(TransportError("the pipeline was closed"))
        for worker in self._workers:
            with contextlib.suppress(TransportError):  # a worker already gone needs no shutdown
                worker.send_tensor(pack(Message("shutdown")))
            worker.close()
        for process in self._processes:
            _stop(process)
        if self._receiver is not None:
            self._receiver.join(timeout=5)
        if self._inbox is not None:
            self._inbox.close()

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, ids: Any, max_new_tokens: int = 32, *, do_sample: bool = False, seed: int | None = None,
               **settings: Any) -> Future[Result]:
        """Queue one prompt `[T]`; the future gets its `Result` (new tokens, and where it was served).

        Greedy by default; `do_sample=True` samples with `temperature`, `top_k`, `top_p`, `min_p` (unset ones
        from the model's generation config) from a generator seeded with `seed` (drawn when not given, and
        returned in the result): the microbatch's tokens equal `torch.manual_seed(seed)` followed by
        `model.generate(..., do_sample=True)` on it. Requests share a microbatch only with equal settings.
        """
        return self._queue([ids], max_new_tokens, Decoding.of(do_sample, seed, **settings))[0]

    def generate(self, prompts: Sequence[Any], max_new_tokens: int = 32, *, do_sample: bool = False,
                 seed: int | None = None, **settings: Any) -> list[torch.Tensor]:
        """Each prompt's new token ids (prompt excluded), queued together and served in microbatches in the
        order given; decoding as in `submit`, one seed for them all."""
        decoding = Decoding.of(do_sample, seed, **settings)
        return [future.result().tokens for future in self._queue(prompts, max_new_tokens, decoding)]

    def _queue(self, prompts: Sequence[Any], max_new_tokens: int, decoding: Decoding) -> list[Future[Result]]:
        if self._receiver is None or self._closed:
            raise ConfigError("the pipeline is not running: use it in a with block, or call start()")
        if decoding.do_sample and self._sampling_refused is not None:
            raise self._sampling_refused
        requests = []
        for ids in prompts:  # every prompt is checked before any is queued
            prompt = check_prompt(ids, self.context, self.vocabulary)
            requests.append(Request(prompt, check_new_tokens(max_new_tokens, prompt.numel(), self.context),
                                    decoding))
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._waiting.extend(requests)
        self._admit()
        return [request.future for request in requests]

    # ---- the head's scheduling --------------------------------------------------------------------
    def _admit(self) -> None:
        """Start waiting microbatches while fewer than one per stage are in flight."""
        while True:
            with self._lock:
                if self._failure is not None or not self._waiting or len(self._in_flight) >= len(self.layers):
                    return
                batch = Microbatch.of(self._next_microbatch, take_microbatch(self._waiting, self.microbatch),
                                      self.pad)
                self._next_microbatch += 1
                self._in_flight[batch.number] = batch
                self._progress[batch.number] = time.monotonic()
            try:
                self._workers[0].send_tensor(pack(Message(
                    "prefill", {"microbatch": batch.number, "max_new_tokens": batch.max_new_tokens,
                                "decoding": batch.decoding.fields()},
                    (batch.ids, batch.mask))))
            except (TransportError, StoreError) as error:  # StoreClosed: the pipeline closed meanwhile
                self._fail(TransportError(f"stage 0 is unreachable: {error}"))
                return

    def _receive(self) -> None:
        """The head's receiver thread: takes the workers' messages, and watches them between messages."""
        assert self._inbox is not None
        watched = time.monotonic()
        while not self._closed:
            try:
                message: Message | None = unpack(self._inbox.recv_tensor(timeout=0.5))
            except TransportError:
                message = None
            try:
                if message is not None:
                    self._handle(message)
                if time.monotonic() - watched >= 0.5:
                    watched = time.monotonic()
                    self._watch()
            except Exception as error:  # a malformed message or a broken link: fail the requests, never hang them
                self._fail(error if isinstance(error, TransportError) else
                           TransportError(f"the pipeline's head failed: {type(error).__name__}: {error}"))

    def _handle(self, message: Message) -> None:
        if message.kind == "tokens":
            number = int(message.fields["microbatch"])
            with self._lock:
                batch = self._in_flight.get(number)
                if batch is not None:
                    self._progress[number] = time.monotonic()
                    for row, token in zip(batch.generated, message.tensors[0].tolist(), strict=True):
                        row.append(token)
        elif message.kind == "ended":
            number = int(message.fields["microbatch"])
            with self._lock:
                batch = self._in_flight.pop(number, None)
                self._progress.pop(number, None)
            if batch is not None:
                for request, result in zip(batch.requests, batch.results(self.eos), strict=True):
                    _settle(request.future, result=result)
            self._admit()
        elif message.kind == "failed":
            self._fail(TransportError(f"stage {message.fields['stage']} failed: {message.fields['error']}"))

    def _watch(self) -> None:
        """Fail the requests in flight when a worker process died, or a microbatch made no progress (no new
        tokens) for `timeout` seconds: a stage is dead or hung, whatever its neighbours' heartbeats say."""
        self._check_processes()
        with self._lock:
            stalled = min(self._progress.values(), default=None)
        if stalled is not None and time.monotonic() - stalled > self.timeout:
            raise TransportError(f"a microbatch made no progress for {self.timeout:.0f} s: a stage worker is "
                                 "dead or stuck")

    def _check_processes(self) -> None:
        for number, process in enumerate(self._processes):
            if process.poll() is not None and not self._closed:
                raise TransportError(f"the process of stage {number} exited with status {process.returncode}")

    def _fail(self, error: TransportError) -> None:
        """Fail every request in flight or waiting with `error`; later submissions raise it too."""
        with self._lock:
            if self._failure is None:
                self._failure = error
            batches, self._in_flight, self._progress = list(self._in_flight.values()), {}, {}
            waiting, self._waiting = list(self._waiting), deque()
        for request in [request for batch in batches for request in batch.requests] + waiting:
            _settle(request.future, error=error)


def _cuts(stages: int | None, layers: Sequence[tuple[int, int]] | None, total: int) -> list[tuple[int, int]]:
    """The stages' layer ranges: `layers` as given (contiguous from 0 to the last layer), or `stages` even cuts."""
    if layers is not None:
        cuts = [check_layers(pair, total) for pair in layers]
        ends = [0] + [stop for _, stop in cuts]
        if not cuts or [start for start, _ in cuts] != ends[:-1] or ends[-1] != total:
            raise ConfigError(f"layers={list(layers)!r} must cover the model's {total} layers in order, each "
                              "stage starting where the previous ends")
        if stages is not None and stages != len(cuts):
            raise ConfigError(f"stages={stages} but layers lists {len(cuts)} stages")
        return cuts
    stages = 1 if stages is None else stages
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ConfigError(f"stages must be an integer from 1 to the model's {total} layers, got {stages!r}")
    return LayerPartition.even(total, stages).stages


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Wait for a worker process told to shut down; kill it if it does not within 10 s."""
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _settle(future: Future[Result], result: Result | None = None, error: BaseException | None = None) -> None:
    """Give a request's future its result or error, unless its caller cancelled it or it is settled already."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

