"""One OpenAI request being served: its choices submitted to the pipeline, their tokens and text as they come
(`updates`), answered whole or streamed as server-sent events in the shape of the API it came in by.

Each choice ends at its end-of-sequence token, its `max_tokens`, or the first stop string in its text (its
request is then cancelled in the pipeline: no token is computed past the stop for nobody); the update with its
last token carries its finish reason. Text is made by a `TextStream` per choice, on the API's text threads,
never on the event loop nor the pipeline's receiver thread.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, Future
from typing import Any, Protocol

import attrs
from aiohttp import web

from ..errors import DejaVuError, RequestFailed
from ..generation.batching import Result
from ..generation.decoding import ENDS, Ends
from ..generation.logprobs import PromptLogprobs, TokenLogprobs
from .detokenizer import TextStream
from .journal import Journal, with_seeds
from .logprob_shapes import chat_logprobs, completion_logprobs
from .metrics import ControllerMetrics
from .openai_requests import ApiError, Choice, GenerationRequest

log = logging.getLogger(__name__)


class GenerationBackend(Protocol):
    """What a run is served by: the tokenizer and end-of-sequence ids, the metrics, and a way to submit choices."""

    tokenizer: Any | None
    eos: list[int]
    metrics: ControllerMetrics
    journal: Journal | None

    def submit(self, choices: list[Choice], on_token: Callable[[int, int], None],
               on_logprobs: Callable[[int, TokenLogprobs | PromptLogprobs], None] | None = None,
               ) -> list[Future[Result]]:
        """Queue every choice (all checked first: ConfigError); `on_token(index, id)` as tokens arrive, each after
        its log-probabilities to `on_logprobs(index, entry)` where the choices ask for them."""

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


@attrs.frozen
class Update:
    """New text and tokens of choice `index` (with their log-probabilities, in the API's shape, where asked);
    `finish` set on its last."""

    index: int
    text: str
    tokens: list[int]
    finish: str | None
    logprobs: dict[str, Any] | None = None


class Run:
    """One request's choices, submitted on creation (ConfigError: a bad prompt, and none is queued)."""

    def __init__(self, backend: GenerationBackend, request: GenerationRequest, loop: asyncio.AbstractEventLoop,
                 text_threads: Executor, control: Executor) -> None:
        self.journal = backend.journal
        if self.journal is not None:
            request = with_seeds(request)
        self.backend, self.request, self.loop, self.text_threads = backend, request, loop, text_threads
        self.control = control  # cancels go through it: a cancel may wait on a stage, never on the loop
        prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
        self.id, self.created, self.started = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), time.monotonic()
        #: (choice, token or None: done, the token's log-probabilities where asked)
        self.events: asyncio.Queue[tuple[int, int | None, TokenLogprobs | None]] = asyncio.Queue()
        self.states = [_ChoiceState(None if backend.tokenizer is None else TextStream(backend.tokenizer, request.stop))
                       for _ in request.choices]
        self.counted = False  # in the metrics as ok, failed, cancelled or timed out (once)
        self.timed_out: str | None = None  # why it was cancelled before it started
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}  # each choice's last arrival
        self.journaled = [0] * len(request.choices)  # tokens of each choice given to the journal
        if self.journal is not None:
            self.journal.admitted(self.id, attrs.asdict(request))
        try:
            self.futures = backend.submit(request.choices, self._on_token,
                                          None if request.logprobs is None else self._on_logprobs)
        except BaseException:
            if self.journal is not None:
                self.journal.answered(self.id, "refused")
            raise
        backend.metrics.in_flight.inc(len(self.futures))
        for index, future in enumerate(self.futures):
            future.add_done_callback(functools.partial(self._on_done, index))

    # ---- from the pipeline's receiver thread -----------------------------------------------------------
    def _on_token(self, index: int, token: int) -> None:
        if self.journal is not None:
            self.journal.token(self.id, index, self.journaled[index], token)
            self.journaled[index] += 1
        arriving = self.states[index].arriving  # its entry came just before it, on this thread
        entry = arriving.popleft() if arriving else None
        self.loop.call_soon_threadsafe(self.events.put_nowait, (index, token, entry))

    def _on_logprobs(self, index: int, entry: TokenLogprobs | PromptLogprobs) -> None:
        if isinstance(entry, PromptLogprobs):  # before the first token
            self.states[index].prompt = entry
        else:
            self.states[index].arriving.append(entry)

    def _on_done(self, index: int, _: Future[Result]) -> None:  # after the choice's last token
        self.loop.call_soon_threadsafe(self.events.put_nowait, (index, None, None))

    # ---- tokens to text ----------------------------------------------------------------------------------
    async def updates(self) -> AsyncIterator[Update]:
        """Each choice's text and tokens as they come, until every choice has ended; a choice whose computation
        failed raises its ApiError (the other choices are cancelled)."""
        open_choices = len(self.states)
        while open_choices:
            batch = [await self.events.get()]
            while not self.events.empty():
                batch.append(self.events.get_nowait())
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

    def _take(self, index: int, tokens: list[int], entries: list[TokenLogprobs | None]) -> Update:
        """Choice `index`'s new tokens, up to its end (end-of-sequence, max_tokens, or a stop string, which
        cancels it in the pipeline)."""
        choice = self.request.choices[index]
        state, limit = self.states[index], choice.max_tokens
        stop_ids, eos = set(choice.decoding.get("stop_token_ids", ())), self._end_ids(index)
        if not state.tokens:
            started = self.backend.started_at(self.futures[index])
            if started is not None:
                self.backend.metrics.queue_time.observe(max(0.0, started - self.started))
        text, taken, scores = "", [], []
        for token, entry in zip(tokens, entries, strict=True):
            taken.append(token)
            state.tokens.append(token)
            scores.append(entry)
            if state.stream is not None and token not in stop_ids:  # a stop token's own text is left out
                text += state.stream.add([token])
                if state.stream.stopped is not None:
                    state.finish = "stop"
                    self._cancel_futures([self.futures[index]])  # nothing more is computed for it
                    break
            if token in eos:
                state.finish = "stop"
                break
            if len(state.tokens) >= limit:
                state.finish = "length"
                break
        if state.finish is not None:
            self._note_finish(index, state.finish)
            if state.stream is not None:
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
        """The whole answer, once every choice has ended (a client that leaves: the API cancels the run)."""
        async for _ in self.updates():
            pass
        choices = await self.loop.run_in_executor(  # token texts are decoded off the event loop
            self.text_threads, lambda: [self._whole_choice(index) for index in range(len(self.states))])
        return {**self._head(), "choices": choices, "usage": self._usage()}

    async def stream(self, request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
        """Server-sent events: a chunk per update, an error event if a choice fails, the usage when asked for,
        then `data: [DONE]` (a client that leaves: the API cancels the run)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **headers})
        try:
            await response.prepare(request)
            if self.request.kind == "chat":  # the assistant's turn opens every choice, as OpenAI's stream does
                for index in range(len(self.states)):
                    await self._send(response, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}])
            try:
                async for update in self.updates():
                    await self._send(response, [self._chunk_choice(update, self.request.kind)])
            except ApiError as error:
                await _write(response, {"error": {"message": error.message, "type": error.kind, "code": error.code}})
            except ConnectionResetError:
                raise
            except Exception:  # the headers went out: the stream says what went wrong, in its own shape
                log.exception("streaming %s failed", self.id)
                self.cancel("%s failed while streaming")
                await _write(response, {"error": {"message": "internal error; the controller's log says more",
                                                  "type": "server_error", "code": None}})
            else:
                if self.request.include_usage:
                    await self._send(response, [], usage=self._usage())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client left: the API cancels what is left of the run
            pass
        return response

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
    def _head(self) -> dict[str, Any]:
        kind = self.request.kind
        obj = "text_completion" if kind == "completion" else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model}

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

    @staticmethod
    def _chunk_choice(update: Update, kind: str) -> dict[str, Any]:
        if kind == "chat":
            delta = {"content": update.text} if update.text or update.finish is None else {}
            return {"index": update.index, "delta": delta, "finish_reason": update.finish, "logprobs": update.logprobs}
        return {"index": update.index, "text": update.text, "logprobs": update.logprobs,
                "finish_reason": update.finish, "token_ids": update.tokens}

    async def _send(self, response: web.StreamResponse, choices: list[dict[str, Any]],
                    usage: dict[str, int] | None = None) -> None:
        head = self._head()
        if self.request.kind == "chat":
            head["object"] = "chat.completion.chunk"
        extra = {"usage": usage} if self.request.include_usage else {}
        await _write(response, {**head, "choices": choices, **extra})

    def _usage(self) -> dict[str, int]:
        prompt = sum(len(ids) for ids in self.request.prompts)
        generated = sum(len(state.tokens) for state in self.states)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

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
        if self.counted:
            return False
        self.counted = True
        self.backend.metrics.in_flight.dec(len(self.futures))
        self.backend.metrics.requests.labels(outcome).inc()
        if self.journal is not None:
            self.journal.answered(self.id, outcome)
        return True


def _coalesced(events: list[tuple[int, int | None, TokenLogprobs | None]],
               ) -> list[tuple[int, list[int], list[TokenLogprobs | None], bool]]:
    """Events in order, consecutive tokens of one choice taken together: (choice, tokens, their entries, done)."""
    out: list[tuple[int, list[int], list[TokenLogprobs | None], bool]] = []
    for index, token, entry in events:
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


async def _write(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
