"""One OpenAI request being served, its whole life in one place (`Run`): its choices submitted to the pipeline and
journaled, their tokens taken as they come (on the pipeline's receiver thread), made into text up to their ends
and counted in the metrics (on the API's text threads, never on the event loop nor the receiver thread), and
written to its transcript by a task of its own, from which its client and any client that resumes it are answered
(answers.py, in the shapes of openai_responses.py). Its `state` (`RequestState`) goes from running to how it
ended, decided once: then it is counted, and journaled as answered. Nothing here speaks HTTP.

With a journal, a token goes out only once the journal holds it, and a successor controller adopts the request
(`Run(..., adopted=)`): the journal's tokens replayed a token per update (a client resumes at any of them), the
rest computed again from the prompt, the tokens the journal had checked against it (a token that differs fails the
request: it cannot go on exactly). A token the journal does not hold is never sent: a stream whose tokens it cannot
write within `JOURNAL_WAIT` seconds (or never will: another controller took it over) ends with a 503 error event
`journal_failed`, and its request is cancelled. Once a run ended, the API keeps its transcript alone (`kept()`).

Each choice ends at its end-of-sequence token, its `max_tokens`, or the first stop string in its text (its
request is then cancelled in the pipeline: no token is computed past the stop for nobody); the update with its
last token carries its finish reason.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor, Future
from typing import Any

import attrs

from ..errors import DejaVuError, RequestFailed
from ..generation.batching import Result
from ..generation.logprobs import PromptLogprobs, TokenLogprobs
from .api_errors import ApiError
from .journal import JournaledRequest, with_seeds
from .metrics import RequestTimes
from .openai_requests import GenerationRequest
from .openai_responses import shape_of
from .request_state import ChoiceState, RequestState, Update
from .served_model import GenerationBackend
from .transcripts import Transcript

log = logging.getLogger(__name__)

#: Seconds a token waits for the journal to hold it (its store fails, or hangs) before its stream ends with an
#: error: it is never sent without the journal.
JOURNAL_WAIT = 30.0


class Run(Transcript):
    """One request's choices, submitted on creation (ConfigError: a bad prompt, and none is queued, nor
    journaled); `start` (on the event loop) starts the task that writes its transcript. `adopted`: the request as
    a predecessor's journal holds it, gone on with under its id."""

    def __init__(self, backend: GenerationBackend, request: GenerationRequest, loop: asyncio.AbstractEventLoop,
                 text_threads: Executor, control: Executor, adopted: JournaledRequest | None = None) -> None:
        self.journal = backend.journal
        if self.journal is not None and adopted is None:
            request = with_seeds(request)
        self.backend, self.request, self.loop, self.text_threads = backend, request, loop, text_threads
        self.control = control  # cancels go through it: a cancel may wait on a stage, never on the loop
        self.shape = shape_of(request.kind)
        super().__init__(adopted.id if adopted is not None else self.shape.new_id(), int(time.time()), request.kind,
                         request.model, request.include_usage, len(request.choices),
                         adopted.prompt_count() if adopted is not None else sum(map(len, request.prompts)),
                         owner=request.owner, continuous_usage=request.continuous_usage)
        self.times = RequestTimes(backend.metrics)
        #: (choice, token or None: done, the token's log-probabilities where asked, its journal entry's number)
        self.events: asyncio.Queue[tuple[int, int | None, TokenLogprobs | None, int]] = asyncio.Queue()
        self.states = [ChoiceState.of(choice, backend.tokenizer, request.stop, backend.eos)
                       for choice in request.choices]
        self._task: asyncio.Task[None] | None = None
        #: Tokens of each choice that a journal held (adopted: computed again, each checked against its own), those
        #: the pipeline gave, and those given to this controller's journal.
        self.known = [list(adopted.tokens.get(index, [])) if adopted else [] for index in range(len(request.choices))]
        self.arrived = [0] * len(request.choices)
        self.journaled = [len(tokens) for tokens in self.known]
        self.diverged: str | None = None  # a recomputed token that differs from the journal's
        self._timed_out = ""  # why it was cancelled before it started (state TIMED_OUT)
        self._deciding = threading.Lock()  # its state leaves RUNNING once, whichever thread decides
        #: Held while the choices are submitted and journaled: no token of theirs is journaled before they are.
        self._admitting = threading.Lock()
        if adopted is not None:
            if adopted.answered is not None:  # one answered already is counted no more
                self.state = RequestState(adopted.answered)
            self._replay(adopted)
        with self._admitting:
            try:
                self._submit()
            except BaseException:
                if self.journal is not None and adopted is not None:  # a new request refused is not journaled
                    self.journal.answered(self.id, RequestState.REFUSED.value)
                raise
            if self.journal is not None and adopted is None:
                self.journal.admitted(self.id, attrs.asdict(request))

    def _submit(self) -> None:
        """Queue the choices that have not ended (all of a new request; none of one answered already)."""
        going = [] if self.state.ended else [index for index, state in enumerate(self.states) if state.finish is None]
        self.futures: list[Future[Result]] = [_ended_future() for _ in self.states]
        submitted = self.backend.submit(
            [self.request.choices[index] for index in going], functools.partial(self._on_token_of, going),
            None if self.request.logprobs is None else functools.partial(self._on_logprobs_of, going),
            [[self.id, index] for index in going], self.request.salt())
        for index, future in zip(going, submitted, strict=True):
            self.futures[index] = future
            future.add_done_callback(functools.partial(self._on_done, index))
        if not self.state.ended:
            self.backend.metrics.in_flight.inc(len(self.futures))

    def start(self) -> None:
        """Start writing the transcript (on the event loop; once)."""
        if self._task is None:
            self._task = self.loop.create_task(self._write_log())

    def abandon(self) -> None:
        """Stop writing the transcript (the API stops; the pipeline fails what is left)."""
        if self._task is not None:
            self._task.cancel()

    async def ended(self) -> None:
        """Wait until every choice has ended (or the run failed); a waiter that is cancelled leaves the run be."""
        self.start()
        assert self._task is not None
        await asyncio.shield(self._task)

    def generated(self) -> int:
        """The tokens its choices took so far."""
        return sum(len(state.tokens) for state in self.states)

    def _replay(self, adopted: JournaledRequest) -> None:
        """The journal's tokens of an adopted request as updates, a token each, with the text, log-probabilities
        and ends its predecessor streamed."""
        for index, state in enumerate(self.states):
            entries = [None if entry is None else TokenLogprobs.of_wire(entry)
                       for entry in adopted.logprobs.get(index, [])]
            for position, token in enumerate(self.known[index]):
                self.append(self._advance(index, [token], [entries[position] if position < len(entries) else None]))
                if state.finish is not None:  # tokens past a stop string were journaled, never sent
                    break
            finish = adopted.finish.get(index)
            if state.finish is None and finish is not None:  # ended by the pipeline (a cancel, a failure)
                self.append(Update(index, state.close(finish), [], finish))

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
                asked = self.request.logprobs is not None  # then its entry goes with it
                logprobs = [None if entry is None else entry.wire()] if asked else []
                sequence = self.journal.token(self.id, index, self.journaled[index], token, *logprobs)
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

    # ---- the transcript --------------------------------------------------------------------------------------
    async def _write_log(self) -> None:
        error = None
        try:
            async for update in self._updates():
                self.append(update)
        except ApiError as failed:
            error = failed
        except Exception:
            log.exception("serving %s failed", self.id)
            self.cancel("%s failed while its tokens were made into text")
            error = ApiError(500, "internal error; the controller's log says more", "server_error")
        finally:
            self.close(error)

    async def _updates(self) -> AsyncIterator[Update]:
        """Each choice's text and tokens as they come, until every choice has ended; a choice whose computation
        failed raises its ApiError (the other choices are cancelled)."""
        open_choices = 0 if self.state.ended else sum(state.finish is None for state in self.states)
        while open_choices:
            batch = [await self.events.get()]
            while not self.events.empty():
                batch.append(self.events.get_nowait())
            await self._until_journaled(max(event[3] for event in batch))
            for index, tokens, entries, done in _coalesced(batch):
                if self.states[index].finish is not None:
                    continue
                if tokens:
                    self.times.arrived(index, len(tokens))
                    update = await self.loop.run_in_executor(self.text_threads, self._take, index, tokens, entries)
                elif done:
                    update = await self.loop.run_in_executor(self.text_threads, self._ended, index)
                else:
                    continue
                if update.finish is not None:
                    open_choices -= 1
                if update.text or update.tokens or update.finish is not None:
                    yield update
        self._finished()

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
        self._decide(RequestState.FAILED)
        self._cancel_futures(self.futures)
        raise ApiError(503, f"the journal cannot hold this request's tokens, so they are held back (a controller "
                       f"taking over would not know them): {why}", "server_error", "journal_failed", 5.0)

    # ---- tokens to text, on the text threads -------------------------------------------------------------
    def _take(self, index: int, tokens: list[int], entries: list[TokenLogprobs | None]) -> Update:
        """Choice `index`'s new tokens, up to its end (end-of-sequence, max_tokens, or a stop string, which
        cancels it in the pipeline)."""
        state = self.states[index]
        if not state.tokens:
            self.times.choice_started(self.backend.started_at(self.futures[index]))
            cached = self.backend.cached_positions(self.futures[index])
            if cached > self.cached_tokens:
                self.backend.metrics.cached_tokens.inc(cached - self.cached_tokens)  # a prompt's once, whatever its n
                self.cached_tokens = cached
        update = self._advance(index, tokens, entries)
        if update.finish is not None:
            self._note_finish(index, update.finish)
            if state.stopped:
                self._cancel_futures([self.futures[index]])  # nothing more is computed for it
        return update

    def _advance(self, index: int, tokens: list[int], entries: list[TokenLogprobs | None]) -> Update:
        """Choice `index`'s state past its new tokens, up to its end; the update that says so (with the tokens'
        log-probabilities in its API's shape, where asked)."""
        state = self.states[index]
        text, taken, scores = state.advance(tokens, entries)
        logprobs = None if self.request.logprobs is None else self.shape.chunk_logprobs(
            self.backend.tokenizer, state, taken, scores)
        return Update(index, text, taken, state.finish, logprobs)

    def _ended(self, index: int) -> Update:
        """Choice `index`'s future is done before its tokens said it ended: its error, or its end (a cancelled one
        ends with what it had)."""
        future, state = self.futures[index], self.states[index]
        if self.diverged is not None:
            self._decide(RequestState.FAILED)
            raise ApiError(500, self.diverged, "server_error", "recomputation_diverged")
        if future.cancelled() and self.state is RequestState.TIMED_OUT:
            raise ApiError(503, f"the request was not served: {self._timed_out}", "server_error", "queue_timeout",
                           5.0)
        error = None if future.cancelled() else future.exception()
        if error is not None:
            self._cancel_futures(self.futures)
            self._decide(RequestState.FAILED)
            raise _api_error(error)
        text = state.close()
        assert state.finish is not None
        self._note_finish(index, state.finish)
        return Update(index, text, [], state.finish)

    # ---- the whole answer, and ends decided from outside ---------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The whole answer in its API's shape, once every choice has ended (its ApiError where it failed)."""
        await self.ended()
        if self.error is not None:
            raise self.error
        tokenizer, logprobs, request = self.backend.tokenizer, self.request.logprobs is not None, self.request

        def choices() -> list[dict[str, Any]]:  # token texts are decoded off the event loop
            return [self.shape.whole_choice(index, state, tokenizer, logprobs,
                                            request.prompts[request.choices[index].prompt_index] if request.echo
                                            else None)
                    for index, state in enumerate(self.states)]

        return self.shape.answer(self, await self.loop.run_in_executor(self.text_threads, choices))

    def time_out(self, why: str) -> None:
        """Cancel a request that waited too long to start: its answer is a 503 that says `why`."""
        self._timed_out = why
        if self._decide(RequestState.TIMED_OUT):
            self._cancel_futures(self.futures)

    def cancel(self, why: str) -> None:
        """Cancel every choice not answered yet (a waiting one is never computed, a running one ends at its next
        step), and count the request as cancelled, once; nothing for a request already answered or failed."""
        if self._decide(RequestState.CANCELLED):
            log.info(why, self.id)
            self._cancel_futures(self.futures)

    def detach(self) -> None:
        """Its client is done with it (answered, or gone): without a journal nobody can resume it, so what is left
        of it is cancelled; with one, it goes on to its end for the client to resume."""
        if self.journal is None:
            self.cancel("%s ended before its answer was complete (the client left)")

    def _cancel_futures(self, futures: list[Future[Result]]) -> None:
        """Cancel `futures` on the control thread (a cancel sends a message to a stage, which may be slow)."""
        def cancel_all() -> None:
            for future in futures:
                future.cancel()

        try:
            self.control.submit(cancel_all)
        except RuntimeError:  # the API is shutting down: cancel here
            cancel_all()

    # ---- counting, once -----------------------------------------------------------------------------------
    def _finished(self) -> None:
        if self._decide(RequestState.FINISHED):
            metrics = self.backend.metrics
            metrics.prompt_tokens.inc(sum(len(ids) for ids in self.request.prompts))
            metrics.generated_tokens.inc(self.generated())
            self.times.ended()

    def _note_finish(self, index: int, reason: str) -> None:
        self.backend.metrics.finished.labels(reason).inc()
        if self.journal is not None:
            self.journal.finished(self.id, index, reason)

    def _decide(self, state: RequestState) -> bool:
        """End the request as `state`, counted and journaled once; False when it had ended already."""
        with self._deciding:
            if self.state.ended:
                return False
            self.state = state
        self.backend.metrics.in_flight.dec(len(self.futures))
        self.backend.metrics.requests.labels(state.value).inc()
        if self.journal is not None:
            self.journal.answered(self.id, state.value)
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
