"""The controller's HTTP API (aiohttp): OpenAI-compatible completions, the model list, status and metrics.

    POST /v1/completions   {"model", "prompt": text | [text] | [ids] | [[ids]], "max_tokens", "temperature",
                            "top_p", "top_k", "seed", "stream"}: one choice per prompt, each with its text (when
                            the model has a tokenizer) and its generated `token_ids`; `stream: true` sends
                            server-sent events, a chunk per token, then `data: [DONE]`
    GET  /v1/models        the one model served
    GET  /v1/status        the serving layout, its stages, the microbatches in flight
    GET  /metrics          Prometheus text format

Every request carries `Authorization: Bearer <token>` (401 otherwise). Bodies are capped (413); malformed
JSON or arguments get a 400 that says what is wrong, an unknown model a 404, a request whose own computation
failed a 500 (a setting the sampler refuses: 400), a failed pipeline a 503; nothing a client sends can take the
controller down, and a request's failure is its own. Errors have OpenAI's shape: `{"error": {"message",
"type", "code"}}`. `temperature` below 1e-5 decodes greedily; otherwise tokens are sampled (temperature, top_p,
top_k and min_p: off unless given, as OpenAI's API has none) from the request's own generator seeded with
`seed` (drawn when not given). A client that leaves, streamed or not, cancels its request: a waiting one is
never computed, a running one ends at its next step.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import Future
from typing import Any, Protocol

import attrs
from aiohttp import web

from ..errors import ConfigError, DejaVuError, RequestFailed
from ..generation.batching import Result
from .metrics import CONTENT_TYPE, ControllerMetrics

log = logging.getLogger(__name__)

#: Arguments of OpenAI's completions API that change the output and are not supported, with the values that
#: change nothing (sent by clients that fill in defaults).
UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, 0),
               "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "stop": (None, [], ""), "logit_bias": (None, {})}


class CompletionBackend(Protocol):
    """What the API serves from: a model's id and tokenizer, and a way to submit token ids."""

    model_id: str
    tokenizer: Any | None
    eos: list[int]
    metrics: ControllerMetrics

    def submit(self, prompts: list[list[int]], max_new_tokens: int, decoding: dict[str, Any],
               on_token: Callable[[int, int], None]) -> list[Future[Result]]:
        """Queue every prompt (all checked first: ConfigError); `on_token(index, id)` as tokens arrive."""

    def status(self) -> dict[str, Any]: ...

    @property
    def join_url(self) -> str:
        """Where stage workers join the pipeline's head (a transport URL)."""


class ApiError(Exception):
    """An error answered with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    def response(self) -> web.Response:
        return _error(self.status, self.message, self.kind, self.code)


@attrs.frozen
class Completion:
    """A checked completions request: the prompts as token ids, the limit and the decoding."""

    prompts: list[list[int]]
    max_tokens: int
    decoding: dict[str, Any]
    stream: bool

    @classmethod
    def parse(cls, body: Any, backend: CompletionBackend) -> Completion:
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' is required: the id GET /v1/models lists")
        if model != backend.model_id:
            raise ApiError(404, f"the model {model!r} is not served here; this controller serves "
                           f"{backend.model_id!r}", "not_found_error", "model_not_found")
        for name, neutral in UNSUPPORTED.items():
            if name in body and body[name] not in neutral:
                raise ApiError(400, f"{name}={body[name]!r} is not supported")
        return cls(_prompts(body.get("prompt"), backend.tokenizer), _integer(body, "max_tokens", 16, minimum=1),
                   _decoding(body), _flag(body, "stream"))


def build_app(backend: CompletionBackend, tokens: Collection[str], max_body_bytes: int) -> web.Application:
    """The API over `backend`; clients present one of `tokens`; request bodies up to `max_body_bytes`."""
    allowed = [token.encode() for token in tokens]
    if not allowed:
        raise ConfigError("the controller needs at least one token for its clients")

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        try:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(presented.strip().encode(), token)
                                                     for token in allowed):
                raise ApiError(401, "a valid bearer token is needed (Authorization: Bearer <token>)",
                               "authentication_error", "invalid_api_key")
            return await handler(request)
        except ApiError as error:
            return error.response()
        except web.HTTPException as error:  # 404 route, 405 method, 413 body too large
            return _error(error.status, error.reason or "error", "invalid_request_error")
        except Exception:  # never let a request take the controller down
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return _error(500, "internal error; the controller's log says more", "server_error")

    app = web.Application(middlewares=[guard], client_max_size=max_body_bytes)
    app.router.add_post("/v1/completions", functools.partial(_completions, backend=backend))
    app.router.add_get("/v1/models", functools.partial(_models, backend=backend))
    app.router.add_get("/v1/status", functools.partial(_status, backend=backend))
    app.router.add_get("/metrics", functools.partial(_metrics, backend=backend))
    app.router.add_get("/v1/workers", functools.partial(_workers, backend=backend))
    return app


async def _completions(request: web.Request, backend: CompletionBackend) -> web.StreamResponse:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        backend.metrics.requests.labels("bad_request").inc()
        raise ApiError(400, "the body is not valid JSON") from None
    try:
        completion = Completion.parse(body, backend)
        run = _Run(backend, completion, asyncio.get_running_loop())
    except (ApiError, ConfigError) as error:
        backend.metrics.requests.labels("bad_request").inc()
        raise error if isinstance(error, ApiError) else ApiError(400, str(error)) from None
    if completion.stream:
        return await run.stream(request)
    return web.json_response(await run.complete())


class _Run:
    """One completions request's prompts, submitted, and their tokens as they come."""

    def __init__(self, backend: CompletionBackend, completion: Completion, loop: asyncio.AbstractEventLoop) -> None:
        self.backend, self.completion, self.loop = backend, completion, loop
        self.id, self.created, self.started = f"cmpl-{uuid.uuid4().hex}", int(time.time()), time.monotonic()
        self.events: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()  # (choice, token or None: done)
        self.counted = False  # in the metrics as ok, failed or cancelled (once)
        self.futures = backend.submit(completion.prompts, completion.max_tokens, completion.decoding,
                                      self._on_token)  # ConfigError: a bad prompt, and none is queued
        backend.metrics.in_flight.inc(len(self.futures))
        for index, future in enumerate(self.futures):
            future.add_done_callback(functools.partial(self._on_done, index))

    def _on_token(self, index: int, token: int) -> None:  # on the serving head's thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, (index, token))

    def _on_done(self, index: int, _: Future[Result]) -> None:  # after the choice's last token
        self.loop.call_soon_threadsafe(self.events.put_nowait, (index, None))

    async def complete(self) -> dict[str, Any]:
        try:
            results = await self._results()
        except asyncio.CancelledError:  # the client left: nothing computes for nobody
            self._cancel("a client left %s before its answer")
            raise
        choices = [{"index": index, "text": self._text(result.tokens.tolist()), "logprobs": None,
                    "finish_reason": self._finish(result.tokens.tolist()), "token_ids": result.tokens.tolist()}
                   for index, result in enumerate(results)]
        return {**self._head(), "choices": choices, "usage": self._usage(results)}

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            await self._stream_events(response)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError) as left:  # the client left: its requests end
            self._cancel("a client left %s before its stream ended")
            if isinstance(left, asyncio.CancelledError):
                raise
        return response

    def _cancel(self, why: str) -> None:
        """Cancel every choice not answered yet (a waiting one is never computed, a running one ends at its next
        step), and count the request as cancelled, once."""
        log.info(why, self.id)
        cancelled = [future.cancel() for future in self.futures]
        if any(cancelled) and not self.counted:
            self.counted = True
            self.backend.metrics.in_flight.dec(len(self.futures))
            self.backend.metrics.requests.labels("cancelled").inc()

    async def _stream_events(self, response: web.StreamResponse) -> None:
        """A chunk per token as it comes, and one per choice when it ends; an error event if one fails."""
        generated: list[list[int]] = [[] for _ in self.futures]
        texts = [""] * len(self.futures)
        first = True
        for _ in self.futures:  # one "done" event per choice, after its tokens
            while True:
                index, token = await self.events.get()
                if token is None:
                    break
                if first:
                    self.backend.metrics.first_token.observe(time.monotonic() - self.started)
                    first = False
                generated[index].append(token)
                text = self._text(generated[index])
                delta = text[len(texts[index]):] if text.startswith(texts[index]) and not text.endswith("\ufffd") \
                    else ""  # wait for the bytes that complete a character
                texts[index] += delta
                await _send(response, {**self._head(), "choices": [{"index": index, "text": delta, "logprobs": None,
                                                                    "finish_reason": None, "token_ids": [token]}]})
            error = None if self.futures[index].cancelled() else self.futures[index].exception()
            if error is not None:
                self._count_failure()
                _, kind, code = _failure(error)
                await _send(response, {"error": {"message": f"generation failed: {error}", "type": kind,
                                                 "code": code}})
                return
            await _send(response, {**self._head(), "choices": [{"index": index, "text": "", "logprobs": None,
                                                                "finish_reason": self._finish(generated[index]),
                                                                "token_ids": []}]})
        await self._results()  # all done: counted once

    async def _results(self) -> list[Result]:
        try:
            results = [await asyncio.shield(asyncio.wrap_future(future)) for future in self.futures]
        except DejaVuError as error:
            self._count_failure()
            status, kind, code = _failure(error)
            raise ApiError(status, str(error) if isinstance(error, RequestFailed) else
                           f"the serving pipeline failed: {error}", kind, code) from None
        self._count(results)
        return results

    def _count(self, results: list[Result]) -> None:
        if self.counted:
            return
        self.counted = True
        metrics = self.backend.metrics
        metrics.in_flight.dec(len(self.futures))
        metrics.requests.labels("ok").inc()
        metrics.prompt_tokens.inc(sum(len(ids) for ids in self.completion.prompts))
        metrics.generated_tokens.inc(sum(result.tokens.numel() for result in results))
        metrics.latency.observe(time.monotonic() - self.started)
        if not self.completion.stream and results:
            metrics.first_token.observe(min(result.first_token for result in results) - self.started)

    def _count_failure(self) -> None:
        if self.counted:
            return
        self.counted = True
        self.backend.metrics.in_flight.dec(len(self.futures))
        self.backend.metrics.requests.labels("failed").inc()

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.backend.model_id}

    def _text(self, tokens: list[int]) -> str:
        tokenizer = self.backend.tokenizer
        return "" if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True)

    def _finish(self, tokens: list[int]) -> str:
        return "stop" if tokens and tokens[-1] in self.backend.eos else "length"

    def _usage(self, results: list[Result]) -> dict[str, int]:
        prompt = sum(len(ids) for ids in self.completion.prompts)
        generated = sum(result.tokens.numel() for result in results)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _failure(error: BaseException) -> tuple[int, str, str | None]:
    """The HTTP status, error type and code of a failed request: its own input (400) or computation (500), or
    the pipeline's failure (503)."""
    if isinstance(error, RequestFailed):
        return (400, "invalid_request_error", "bad_request") if error.input_error else \
            (500, "server_error", "request_failed")
    return 503, "server_error", "pipeline_failed"


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())


async def _models(_: web.Request, backend: CompletionBackend) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": backend.model_id, "object": "model", "created": 0,
                                                          "owned_by": "dejavu-sdk"}]})


async def _status(_: web.Request, backend: CompletionBackend) -> web.Response:
    return web.json_response(backend.status())


async def _workers(_: web.Request, backend: CompletionBackend) -> web.Response:
    """Where a stage worker joins (`dejavu worker --controller URL` asks here first)."""
    return web.json_response({"join": backend.join_url, "model": backend.model_id})


async def _metrics(_: web.Request, backend: CompletionBackend) -> web.Response:
    return web.Response(body=backend.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status)


def _prompts(prompt: Any, tokenizer: Any | None) -> list[list[int]]:
    """The prompts as lists of token ids: text (tokenized), a list of texts, token ids, or lists of them."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        if tokenizer is None:
            raise ApiError(400, "this model is served without a tokenizer: send the prompt as token ids")
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [list(tokenizer(text)["input_ids"]) for text in texts]
    if isinstance(prompt, list) and prompt and all(_is_id(token) for token in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(ids, list) and ids and all(_is_id(t) for t in ids)
                                                   for ids in prompt):
        return [list(ids) for ids in prompt]
    raise ApiError(400, "'prompt' must be a non-empty text, a list of texts, a list of token ids or a list of "
                   "such lists")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: dict[str, Any], name: str, default: int | None, minimum: int) -> Any:
    value = body.get(name, default)
    if value is None:
        return None
    if not _is_id(value) or value < minimum:
        raise ApiError(400, f"{name!r} must be an integer of at least {minimum}, got {value!r}")
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"{name!r} must be a number from {low} to {high}, got {value!r}")
    return float(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name!r} must be true or false, got {value!r}")
    return value


def _decoding(body: dict[str, Any]) -> dict[str, Any]:
    """Greedy at a temperature below 1e-5; else sampled with the request's temperature, top_p, top_k and min_p
    (off unless given: OpenAI's API has none, and top_k -1 means off as in vLLM) from a generator seeded with
    `seed`. Ranges as vLLM checks them (`Decoding.of`: ConfigError, a 400)."""
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature == 0:
        return {"do_sample": False}
    seed = body.get("seed")
    if seed is not None and not _is_id(seed):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}")
    return {"do_sample": True, "temperature": temperature, "top_p": body.get("top_p", 1.0),
            "top_k": body.get("top_k", 0), "min_p": body.get("min_p", 0.0), "seed": seed}
