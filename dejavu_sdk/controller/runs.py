"""One OpenAI request being served: its choices submitted to the pipeline, their tokens and text as they come
(the run's log of updates, written by a task of its own), answered whole or streamed as server-sent events in the
shape of the API it came in by, to its client and to any client that resumes it (`GET /v1/requests/<id>/stream`).

Each event of a stream carries `id: <request id>:<position>`, a position per choice (comma-separated when
there are several): the choice's tokens sent so far, and its end as one more. A client that reconnects with the
last id it got (`Last-Event-ID`) gets every later token once. With a journal, a token goes out only once the
journal holds it, and a successor controller adopts the request (`Run(..., adopted=)`): the journal's tokens
replayed a token per update (a client resumes at any of them), the rest computed again from the prompt, the
tokens the journal had checked against it. A token the journal does not hold is never sent: a stream whose tokens
it cannot write within `JOURNAL_WAIT` seconds (or never will: another controller took it over) ends with a 503
error event `journal_failed`, and its request is cancelled. A run writes its `Transcript` (transcripts.py); once it
ended, the API keeps that alone (`kept()`).

Each choice ends at its end-of-sequence token, its `max_tokens`, or the first stop string in its text (its
request is then cancelled in the pipeline: no token is computed past the stop for nobody); the update with its
last token carries its finish reason. Text is made by a `TextStream` per choice, on the API's text threads,
never on the event loop nor the pipeline's receiver thread.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Protocol

import attrs

from ..errors import DejaVuError, RequestFailed
from ..generation.batching import Result
from ..generation.decoding import ENDS, Ends
from ..generation.logprobs import PromptLogprobs, TokenLogprobs
from .detokenizer import TextStream
from .journal import Journal, JournaledRequest, with_seeds
from .logprob_shapes import chat_logprobs, completion_logprobs
from .metrics import ControllerMetrics
from .openai_requests import ApiError, Choice, GenerationRequest
from .transcripts import Transcript, Update

log = logging.getLogger(__name__)

#: Seconds a token waits for the journal to hold it (its store fails, or hangs) before its stream ends with an
#: error: it is never sent without the journal.
JOURNAL_WAIT = 30.0
#: A position in an event id: ASCII digits (not int()'s signs, underscores or other scripts' digits), 18 at most.


class GenerationBackend(Protocol):
    """What a run is served by: the tokenizer and end-of-sequence ids, the metrics, and a way to submit choices."""

    tokenizer: Any | None
    eos: list[int]
    metrics: ControllerMetrics
    journal: Journal | None

    def submit(self, choices: list[Choice], on_token: Callable[[int, int], None],
               on_logprobs: Callable[[int, TokenLogprobs | PromptLogprobs], None] | None = None,
               tags: Sequence[Any] | None = None) -> list[Future[Result]]:
        """Queue every choice (all checked first: ConfigError); `on_token(index, id)` as tokens arrive, each after
        its log-probabilities to `on_logprobs(index, entry)` where the choices ask for them; `tags[index]` names
        choice `index` in the journal's microbatch records."""

    def started_at(self, future: Future[Result]) -> float | None:
        """When the choice of `future` left the waiting queue (`time.monotonic()`)."""


@attrs.define
class _ChoiceState:
    """What one choice has so far: its tokens, its text, and its finish reason once it ended."""

    stream: TextStream | None
    tokens: list[int] = attrs.field(factory=list)
    text: str = ""
    finish: str | None = None
    #: Where asked: each token's log-probabilities (None: lost), those that arrived before their token (on the
    #: receiver thread), the prompt's (echo), and the characters of the token texts listed so far (the next
    #: one's text offset, streamed).
    logprobs: list[TokenLogprobs | None] = attrs.field(factory=list)
    arriving: collections.deque[TokenLogprobs] = attrs.field(factory=collections.deque)
    prompt: PromptLogprobs | None = None
    listed: int = 0


class Run(Transcript):
    """One request's choices, submitted on creation (ConfigError: a bad prompt, and none is queued, nor
    journaled); `start` (on the event loop) starts the task that writes its log. `adopted`: the request as a
    predecessor's journal holds it, gone on with under its id."""

    def __init__(self, backend: GenerationBackend, request: GenerationRequest, loop: asyncio.AbstractEventLoop,
                 text_threads: Executor, control: Executor, adopted: JournaledRequest | None = None) -> None:
        self.journal = backend.journal
        if self.journal is not None and adopted is None:
            request = with_seeds(request)
        self.backend, self.request, self.loop, self.text_threads = backend, request, loop, text_threads
        self.control = control  # cancels go through it: a cancel may wait on a stage, never on the loop
        prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
        super().__init__(adopted.id if adopted is not None else f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                         request.kind, request.model, request.include_usage, len(request.choices),
                         adopted.prompt_count() if adopted is not None else sum(map(len, request.prompts)),
                         owner=request.owner)
        self.started = time.monotonic()
        #: (choice, token or None: done, the token's log-probabilities where asked, its journal entry's number)
        self.events: asyncio.Queue[tuple[int, int | None, TokenLogprobs | None, int]] = asyncio.Queue()
        self.states = [_ChoiceState(None if backend.tokenizer is None else TextStream(backend.tokenizer, request.stop))
                       for _ in request.choices]
        self.timed_out: str | None = None  # why it was cancelled before it started
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}  # each choice's last arrival
        self._positions = [0] * len(request.choices)
        self._task: asyncio.Task[None] | None = None
        #: Tokens of each choice that a journal held (adopted: computed again, each checked against its own), those
        #: the pipeline gave, and those given to this controller's journal.
        self.known = [list(adopted.tokens.get(index, [])) if adopted else [] for index in range(len(request.choices))]
        self.arrived = [0] * len(request.choices)
        self.journaled = [len(tokens) for tokens in self.known]
        self.diverged: str | None = None  # a recomputed token that differs from the journal's
        #: Held while the choices are submitted and journaled: no token of theirs is journaled before they are.
        self._admitting = threading.Lock()
        if adopted is not None:
            self.outcome = adopted.answered  # one answered already is counted no more
            self._replay(adopted)
        with self._admitting:
            try:
                self._submit()
            except BaseException:
                if self.journal is not None and adopted is not None:  # a new request refused is not journaled
                    self.journal.answered(self.id, "refused")
                raise
            if self.journal is not None and adopted is None:
                self.journal.admitted(self.id, attrs.asdict(request))

    def _submit(self) -> None:
        """Queue the choices that have not ended (all of a new request; none of one answered already)."""
        going = [] if self.outcome is not None else [index for index, state in enumerate(self.states)
                                                     if state.finish is None]
        self.futures: list[Future[Result]] = [_ended_future() for _ in self.states]
        submitted = self.backend.submit(
            [self.request.choices[index] for index in going], functools.partial(self._on_token_of, going),
            None if self.request.logprobs is None else functools.partial(self._on_logprobs_of, going),
            [[self.id, index] for index in going])
        for index, future in zip(going, submitted, strict=True):
            self.futures[index] = future
            future.add_done_callback(functools.partial(self._on_done, index))
        if self.outcome is None:
            self.backend.metrics.in_flight.inc(len(self.futures))

    def start(self) -> None:
        """Start writing the log (on the event loop; once)."""
        if self._task is None:
            self._task = self.loop.create_task(self._write_log())

    def abandon(self) -> None:
        """Stop writing the log (the API stops; the pipeline fails what is left)."""
        if self._task is not None:
            self._task.cancel()

    def _replay(self, adopted: JournaledRequest) -> None:
        """The journal's tokens of an adopted request as updates, a token each, with the text and ends its
        predecessor streamed."""
        for index, state in enumerate(self.states):
            for token in self.known[index]:
                self._logged(self._advance(index, [token], [None]))
                if state.finish is not None:  # tokens past a stop string were journaled, never sent
                    break
            finish = adopted.finish.get(index)
            if state.finish is None and finish is not None:  # ended by the pipeline (a cancel, a failure)
                state.finish = finish
                text = "" if state.stream is None else state.stream.finish()
                state.text += text
                self._logged(Update(index, text, [], finish))

    # ---- from the pipeline's receiver thread -----------------------------------------------------------
    def _on_token_of(self, going: list[int], submitted: int, token: int) -> None:
        """The token of the `submitted`-th choice queued (`going[submitted]`)."""
        index = going[submitted]
        if self.diverged is not None:  # the request fails as its choices end: nothing more goes out
            return
        arriving = self.states[index].arriving  # its entry came just before it, on this thread
        entry = arriving.popleft() if arriving else None
        position, known = self.arrived[index], self.known[index]
        self.arrived[index] += 1
        if position < len(known):  # computed again: the journal had it, and a client may have had it
            if token != known[position] and self.diverged is None:
                self.diverged = (f"choice {index}'s token {position} computed again is {token}, not the "
                                 f"{known[position]} first streamed: the request cannot go on exactly")
                self._cancel_futures(self.futures)
            return
        sequence = 0
        if self.journal is not None:
            with self._admitting:  # after the request's own entry
                sequence = self.journal.token(self.id, index, self.journaled[index], token)
            self.journaled[index] += 1
        self.loop.call_soon_threadsafe(self.events.put_nowait, (index, token, entry, sequence))

    def _on_logprobs_of(self, going: list[int], submitted: int, entry: TokenLogprobs | PromptLogprobs) -> None:
        state = self.states[going[submitted]]
        if isinstance(entry, PromptLogprobs):  # before the first token
            state.prompt = entry
        else:
            state.arriving.append(entry)

    def _on_done(self, index: int, _: Future[Result]) -> None:  # after the choice's last token
        self.loop.call_soon_threadsafe(self.events.put_nowait, (index, None, None, 0))

    # ---- the log ---------------------------------------------------------------------------------------------
    async def _write_log(self) -> None:
        try:
            async for update in self._updates():
                self._logged(update)
        except ApiError as error:
            self.error = error
        except Exception:
            log.exception("serving %s failed", self.id)
            self.cancel("%s failed while its tokens were made into text")
            self.error = ApiError(500, "internal error; the controller's log says more", "server_error")
        finally:
            self.over = True
            self._wake()

    def _logged(self, update: Update) -> None:
        """Append `update` to the log, with its position."""
        self._positions[update.index] += len(update.tokens)
        position = self._positions[update.index] + (update.finish is not None)
        self.log.append(attrs.evolve(update, position=position))
        self._wake()

    def kept(self) -> Transcript:
        """What is kept of this run once it ended: its transcript (no request, prompts, text state nor futures)."""
        kept = Transcript(self.id, self.created, self.kind, self.model, self.include_usage, self.choices,
                          self.prompt_tokens, live=False, owner=self.owner)
        kept.log, kept.error, kept.outcome = list(self.log), self.error, self.outcome
        return kept

    async def ended(self) -> None:
        """Wait until every choice has ended (or the run failed); a waiter that is cancelled leaves the run be."""
        self.start()
        assert self._task is not None
        await asyncio.shield(self._task)

    # ---- tokens to text ----------------------------------------------------------------------------------
    async def _updates(self) -> AsyncIterator[Update]:
        """Each choice's text and tokens as they come, until every choice has ended; a choice whose computation
        failed raises its ApiError (the other choices are cancelled)."""
        open_choices = 0 if self.outcome is not None else sum(state.finish is None for state in self.states)
        while open_choices:
            batch = [await self.events.get()]
            while not self.events.empty():
                batch.append(self.events.get_nowait())
            await self._until_journaled(max(event[3] for event in batch))
            for index, tokens, entries, done in _coalesced(batch):
                state = self.states[index]
                if state.finish is not None:
                    continue
                if tokens:
                    self._note_arrival(index, len(tokens))
                    update = await self.loop.run_in_executor(self.text_threads, self._take, index, tokens, entries)
                elif done:
                    update = await self.loop.run_in_executor(self.text_threads, self._ended, index)
                else:
                    continue
                if update.finish is not None:
                    open_choices -= 1
                if update.text or update.tokens or update.finish is not None:
                    yield update
        self._count_ok()

    async def _until_journaled(self, sequence: int) -> None:
        """Wait until the journal holds its entries up to number `sequence`; past JOURNAL_WAIT seconds, or once it
        never will, the run fails (ApiError 503 journal_failed) and its choices are cancelled: no token goes out
        that a successor could not know."""
        if self.journal is None or sequence == 0:
            return
        written: asyncio.Future[bool] = self.loop.create_future()
        self.journal.when_written(sequence, lambda sendable: self.loop.call_soon_threadsafe(_settle, written, sendable))
        try:
            if await asyncio.wait_for(written, JOURNAL_WAIT):
                return
            why = self.journal.failure or "the journal closed"
        except TimeoutError:
            why = f"it did not hold them within {JOURNAL_WAIT:.0f} s: {self.journal.failure or 'its store hangs'}"
        log.error("%s: the journal cannot hold its tokens (%s): they are held back, and the request fails", self.id,
                  why)
        self._count("failed")
        self._cancel_futures(self.futures)
        raise ApiError(503, f"the journal cannot hold this request's tokens, so they are held back (a controller "
                       f"taking over would not know them): {why}", "server_error", "journal_failed", 5.0)

    def _take(self, index: int, tokens: list[int], entries: list[TokenLogprobs | None]) -> Update:
        """Choice `index`'s new tokens, up to its end (end-of-sequence, max_tokens, or a stop string, which
        cancels it in the pipeline)."""
        state = self.states[index]
        if not state.tokens:
            started = self.backend.started_at(self.futures[index])
            if started is not None:
                self.backend.metrics.queue_time.observe(max(0.0, started - self.started))
        update = self._advance(index, tokens, entries)
        if update.finish is not None:
            self._note_finish(index, update.finish)
            if state.stream is not None and state.stream.stopped is not None:
                self._cancel_futures([self.futures[index]])  # nothing more is computed for it
        return update

    def _advance(self, index: int, tokens: list[int], entries: list[TokenLogprobs | None]) -> Update:
        """Choice `index`'s state past its new tokens, up to its end; the update that says so."""
        choice = self.request.choices[index]
        state, limit = self.states[index], choice.max_tokens
        stop_ids, eos = set(choice.decoding.get("stop_token_ids", ())), self._end_ids(index)
        text, taken, scores = "", [], []
        for token, entry in zip(tokens, entries, strict=True):
            taken.append(token)
            state.tokens.append(token)
            scores.append(entry)
            if state.stream is not None and token not in stop_ids:  # a stop token's own text is left out
                text += state.stream.add([token])
                if state.stream.stopped is not None:
                    state.finish = "stop"
                    break
            if token in eos:
                state.finish = "stop"
                break
            if len(state.tokens) >= limit:
                state.finish = "length"
                break
        if state.finish is not None and state.stream is not None:
            text += state.stream.finish()
        state.text += text
        state.logprobs += scores
        return Update(index, text, taken, state.finish, self._shaped(state, taken, scores))

    def _shaped(self, state: _ChoiceState, tokens: list[int], entries: list[TokenLogprobs | None]) -> Any:
        """A chunk's log-probabilities in the API's shape (None where not asked); text offsets go on from the
        choice's last chunk."""
        if self.request.logprobs is None:
            return None
        if self.request.kind == "chat":
            return chat_logprobs(self.backend.tokenizer, tokens, entries)
        shaped = completion_logprobs(self.backend.tokenizer, tokens, entries, state.listed)
        state.listed += sum(len(text) for text in shaped["tokens"])
        return shaped

    def _end_ids(self, index: int) -> set[int]:
        """The ids choice `index` ends at: the model's end-of-sequence ids (unless it ignores them) and its own."""
        decoding = self.request.choices[index].decoding
        return Ends.of(**{name: decoding[name] for name in ENDS if name in decoding}).ids(self.backend.eos)

    def _ended(self, index: int) -> Update:
        """Choice `index`'s future is done before its tokens said it ended: its error, or its end (a cancelled one
        ends with what it had)."""
        future, state = self.futures[index], self.states[index]
        if self.diverged is not None:
            self._count("failed")
            raise ApiError(500, self.diverged, "server_error", "recomputation_diverged")
        if future.cancelled() and self.timed_out is not None:
            raise ApiError(503, f"the request was not served: {self.timed_out}", "server_error", "queue_timeout", 5.0)
        error = None if future.cancelled() else future.exception()
        if error is not None:
            self._cancel_futures(self.futures)
            self._count("failed")
            raise _api_error(error)
        state.finish = "stop" if state.tokens and state.tokens[-1] in self._end_ids(index) else "length"
        self._note_finish(index, state.finish)
        text = "" if state.stream is None else state.stream.finish()
        state.text += text
        return Update(index, text, [], state.finish)

    # ---- answers -----------------------------------------------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The whole answer, once every choice has ended."""
        await self.ended()
        if self.error is not None:
            raise self.error
        choices = await self.loop.run_in_executor(  # token texts are decoded off the event loop
            self.text_threads, lambda: [self._whole_choice(index) for index in range(len(self.states))])
        return {**self._head(), "choices": choices, "usage": self._usage()}

    def time_out(self, why: str) -> None:
        """Cancel a request that waited too long to start: its answer is a 503 that says `why`."""
        self.timed_out = why
        if self._count("timed_out"):
            self._cancel_futures(self.futures)

    def cancel(self, why: str) -> None:
        """Cancel every choice not answered yet (a waiting one is never computed, a running one ends at its next
        step), and count the request as cancelled, once; nothing for a request already answered or failed."""
        if self._count("cancelled"):
            log.info(why, self.id)
            self._cancel_futures(self.futures)

    def _cancel_futures(self, futures: list[Future[Result]]) -> None:
        """Cancel `futures` on the control thread (a cancel sends a message to a stage, which may be slow)."""
        def cancel_all() -> None:
            for future in futures:
                future.cancel()

        try:
            self.control.submit(cancel_all)
        except RuntimeError:  # the API is shutting down: cancel here
            cancel_all()

    # ---- shapes of the two APIs --------------------------------------------------------------------------
    def _whole_choice(self, index: int) -> dict[str, Any]:
        state, tokenizer = self.states[index], self.backend.tokenizer
        asked = self.request.logprobs is not None
        if self.request.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": state.text},
                    "logprobs": chat_logprobs(tokenizer, state.tokens, state.logprobs) if asked else None,
                    "finish_reason": state.finish}
        text, tokens, entries = state.text, state.tokens, state.logprobs
        if self.request.echo:
            prompt = self.request.prompts[self.request.choices[index].prompt_index]
            text = ("" if tokenizer is None else tokenizer.decode(prompt, skip_special_tokens=True)) + text
            tokens = [*prompt, *tokens]
            if asked:
                entries = [*self._prompt_logprobs(index, len(prompt)), *entries]
        return {"index": index, "text": text, "finish_reason": state.finish, "token_ids": state.tokens,
                "logprobs": completion_logprobs(tokenizer, tokens, entries) if asked else None}

    def _prompt_logprobs(self, index: int, length: int) -> list[TokenLogprobs | None]:
        """Choice `index`'s prompt's log-probabilities (`length` tokens, the first None)."""
        found = self.states[index].prompt
        if found is None or found.entries is None or len(found.entries) != length:
            raise ApiError(503, "the prompt's log-probabilities were lost in a recovery: send the request again",
                           "server_error", "prompt_logprobs_lost", 1.0)
        return list(found.entries)

    # ---- counting, once -----------------------------------------------------------------------------------
    def _note_arrival(self, index: int, tokens: int) -> None:
        """Time to first token, and the time between a choice's tokens (tokens that arrive together share it)."""
        now, metrics = time.monotonic(), self.backend.metrics
        if self.first_token is None:
            self.first_token = now
            metrics.first_token.observe(now - self.started)
        if index in self.last_token:
            metrics.inter_token.observe((now - self.last_token[index]) / tokens)
        self.last_token[index] = now

    def _count_ok(self) -> None:
        if self._count("ok"):
            metrics = self.backend.metrics
            metrics.prompt_tokens.inc(sum(len(ids) for ids in self.request.prompts))
            metrics.generated_tokens.inc(sum(len(state.tokens) for state in self.states))
            metrics.latency.observe(time.monotonic() - self.started)

    def _note_finish(self, index: int, reason: str) -> None:
        self.backend.metrics.finished.labels(reason).inc()
        if self.journal is not None:
            self.journal.finished(self.id, index, reason)

    def _count(self, outcome: str) -> bool:
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self.backend.metrics.in_flight.dec(len(self.futures))
        self.backend.metrics.requests.labels(outcome).inc()
        if self.journal is not None:
            self.journal.answered(self.id, outcome)
        return True


def _coalesced(events: list[tuple[int, int | None, TokenLogprobs | None, int]],
               ) -> list[tuple[int, list[int], list[TokenLogprobs | None], bool]]:
    """Events in order, consecutive tokens of one choice taken together: (choice, tokens, their entries, done)."""
    out: list[tuple[int, list[int], list[TokenLogprobs | None], bool]] = []
    for index, token, entry, _ in events:
        if token is None:
            out.append((index, [], [], True))
        elif out and out[-1][0] == index and not out[-1][3]:
            out[-1][1].append(token)
            out[-1][2].append(entry)
        else:
            out.append((index, [token], [entry], False))
    return out


def _api_error(error: BaseException) -> ApiError:
    """A failed choice's error: its own input (400) or computation (500), or the pipeline's failure (503)."""
    if isinstance(error, RequestFailed):
        if error.input_error:
            return ApiError(400, str(error), "invalid_request_error", "bad_request")
        return ApiError(500, str(error), "server_error", "request_failed")
    if isinstance(error, DejaVuError):
        return ApiError(503, f"the serving pipeline failed: {error}", "server_error", "pipeline_failed", 5.0)
    return ApiError(500, f"generation failed: {error}", "server_error", "request_failed")


def _ended_future() -> Future[Result]:
    """The future of a choice that ended before this controller (adopted): done, and never computed here."""
    future: Future[Result] = Future()
    future.cancel()
    return future


def _settle(written: asyncio.Future[bool], sendable: bool) -> None:
    if not written.done():
        written.set_result(sendable)

