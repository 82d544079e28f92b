"""The controller's HTTP API (aiohttp), OpenAI-compatible as vLLM's and SGLang's servers are:

    POST /v1/completions       prompt (text, texts, token ids, lists of them), max_tokens (null: up to the
                               context), temperature, top_p, top_k, min_p, seed, n, stop, stream,
                               stream_options.include_usage; each choice has its text and its `token_ids`
    POST /v1/chat/completions  messages rendered with the model's chat template; max_completion_tokens (or
                               max_tokens; default: up to the context), the same decoding, n, stop, stream
    GET  /v1/requests/<id>     a running or recently ended request (`keep_finished`): its status, each choice's
                               text, token ids and finish reason so far
    GET  /v1/requests/<id>/stream   its server-sent events again, past the `Last-Event-ID` a client got (every
                               event has `id: <request id>:<position>`), from this controller or its successor
    GET  /v1/models            the model served, under each of its names
    GET  /v1/status            the serving layout, its stages, the microbatches in flight
    GET  /metrics              Prometheus text format
    GET  /health               200 when serving (or `degraded`: serving on without its journal), 503 while
                               starting, recovering, draining, failed or `journal_failed` (no token)
    POST /tokenize, /detokenize, GET /version   as vLLM has them
    GET /tokenizer_info                         the tokenizer's special tokens and chat template (lm-eval's remote
                                                tokenizer reads them)

Every other route needs `Authorization: Bearer <token>` (401 otherwise): a client token, and for `/v1/workers`
the workers' token (neither opens the other's routes). A request belongs to the client token that made it
(`owners`): `GET /v1/requests/<id>` and its stream answer that token alone, any other gets the 404 of an unknown id
(nobody learns that another's ids exist), and `/v1/status` lists only the caller's ids among those taken over from
a journal. The journal records a digest of the owner's token, never the token, so a successor controller given the
same token answers the same client. Errors have OpenAI's shape
(`{"error": {"message", "type", "code"}}`) and the status a client understands: 400 a bad request (and its own
bad input, found while computing), 404 an unknown model, 413 a body over the cap (refused from its
Content-Length, before it is read), 429 a full waiting queue, 500 a request whose own computation failed, 503
while the pipeline starts, recovers, drains or has failed, or the journal cannot write (`journal_failed`), with
`Retry-After` where waiting helps. Nothing a client sends can take the controller down, and a request's failure is
its own. Tokenizing, rendering templates and detokenizing run on the API's text threads, submitting on its
admission thread: the event loop only moves bytes, so `/health` and `/metrics` answer while a stage hangs. Each
request gets an `X-Request-Id` (the client's, or a new one) and one access-log line. Without a journal, a client
that leaves cancels its request: a waiting one is never computed, a running one ends at its next step; either is
counted as cancelled. With a journal, the request goes on to its end, for the client to resume.

With a journal (`--journal`), a token reaches its client only once the journal holds it. A journal whose writes
fail (a full disk) tries again every second; meanwhile, by default (`--journal-failure stop`), `/health` answers
503 `journal_failed` with the reason, new requests get that 503, and a stream whose tokens the journal cannot hold
within 30 s ends with an error event `journal_failed`; once it writes again, admission reopens. With
`--journal-failure serve`, `/health` answers 200 `degraded` with the reason and tokens go on without it. A
controller whose journal another one took over (`--take-over-journal`) answers `journal_failed` for good (the
journal's lease, `--journal-lease`, and `--journal-reset`: `Controller`). `/metrics` has `dejavu_journal_healthy`
and `dejavu_journal_failed_writes_total`, `/v1/status` the journal's state.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import attrs
from aiohttp import web

from .._version import __version__
from ..errors import ConfigError, quoted
from .admission import AdmissionPolicy
from .answers import respond, stream
from .bodies import json_body
from .journal import JournaledRequest
from .limits import ApiLimits
from .metrics import CONTENT_TYPE
from .openai_requests import ApiError, GenerationRequest, parse_chat, parse_completion
from .openai_responses import snapshot
from .owners import Tokens, owns
from .run_book import RunBook
from .runs import Run
from .served_model import ServedModel
from .text_routes import detokenize, tokenize, tokenizer_info
from .transcripts import Transcript

log = logging.getLogger(__name__)
access_log = logging.getLogger("dejavu_sdk.access")

#: A client's own request id is kept when it is this plain; any other gets a new one.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: Paths answered without a token, and those that take the workers' token (and no client token).
OPEN_PATHS, WORKER_PATHS = ("/health", "/version"), ("/v1/workers",)
#: Where an app keeps its runs, and its admission policy.
BOOK, DOOR = web.AppKey("book", RunBook), web.AppKey("door", AdmissionPolicy)


@attrs.define
class _Exchange:
    """One HTTP request as its access-log line tells it: its id, and the tokens it cost; and the owner id of the
    token it presented (None: it needed none)."""

    request_id: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    owner: str | None = None


_EXCHANGE: contextvars.ContextVar[_Exchange] = contextvars.ContextVar("dejavu_exchange")


def build_app(backend: ServedModel, tokens: Collection[str], worker_token: str, limits: ApiLimits) -> web.Application:
    """The API over `backend`; clients present one of `tokens`, stage workers `worker_token`."""
    allowed = Tokens(tokens)
    if not allowed:
        raise ConfigError("the controller needs at least one token for its clients")
    workers = Tokens([worker_token])
    text_threads = ThreadPoolExecutor(2, thread_name_prefix="dejavu-api-text")
    admission = ThreadPoolExecutor(1, thread_name_prefix="dejavu-api-admission")

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        started = time.monotonic()
        given = request.headers.get("X-Request-Id", "")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex  # no log lines forged in an id
        exchange = _Exchange(request_id)
        _EXCHANGE.set(exchange)  # the handler runs in this task, and reads it
        response = await _answer(request, handler, workers if request.path in WORKER_PATHS else allowed, limits)
        if not response.prepared:
            response.headers["X-Request-Id"] = request_id
        access_log.info("%s %s %s %s %d prompt=%d generated=%d %.3fs", request_id, request.remote, request.method,
                        request.path, response.status, exchange.prompt_tokens, exchange.generated_tokens,
                        time.monotonic() - started)
        return response

    async def on_cleanup(_: web.Application) -> None:
        book.close()
        text_threads.shutdown(wait=False, cancel_futures=True)
        admission.shutdown(wait=False, cancel_futures=True)

    app = web.Application(middlewares=[guard], client_max_size=limits.max_body_bytes)
    app.on_cleanup.append(on_cleanup)
    book = RunBook(limits.keep_finished)
    door = AdmissionPolicy(backend, limits, text_threads, admission)
    app[BOOK], app[DOOR] = book, door
    generate = functools.partial(_generate, backend=backend, door=door, text_threads=text_threads, book=book)
    app.router.add_post("/v1/completions", functools.partial(generate, parse=parse_completion))
    app.router.add_post("/v1/chat/completions", functools.partial(generate, parse=parse_chat))
    app.router.add_get("/v1/requests/{id}", functools.partial(_request_now, backend=backend, book=book))
    app.router.add_get("/v1/requests/{id}/stream", functools.partial(_request_stream, backend=backend, book=book))
    app.router.add_get("/v1/models", functools.partial(_models, backend=backend))
    app.router.add_get("/v1/status", functools.partial(_status, backend=backend, book=book))
    app.router.add_get("/metrics", functools.partial(_metrics, backend=backend))
    app.router.add_get("/v1/workers", functools.partial(_workers, backend=backend))
    app.router.add_get("/health", functools.partial(_health, backend=backend))
    app.router.add_get("/version", _version)
    app.router.add_post("/tokenize", functools.partial(tokenize, backend=backend, text_threads=text_threads))
    app.router.add_post("/detokenize", functools.partial(detokenize, backend=backend, text_threads=text_threads))
    app.router.add_get("/tokenizer_info", functools.partial(tokenizer_info, backend=backend))
    return app


async def _answer(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                  allowed: Tokens, limits: ApiLimits) -> web.StreamResponse:
    """The handler's response, or the error that stopped it in OpenAI's shape; never an exception. The owner id
    of the token presented is the exchange's."""
    try:
        if request.path not in OPEN_PATHS:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            owner = allowed.owner(presented.strip()) if scheme.lower() == "bearer" else None
            if owner is None:
                raise ApiError(401, "a valid bearer token is needed (Authorization: Bearer <token>)",
                               "authentication_error", "invalid_api_key")
            _EXCHANGE.get().owner = owner
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            raise ApiError(413, f"the body is {request.content_length} bytes, more than the "
                           f"{limits.max_body_bytes} this server takes", code="body_too_large")
        return await handler(request)
    except ApiError as error:
        response = _error(error.status, error.message, error.kind, error.code, error.param)
        if error.retry_after is not None:
            response.headers["Retry-After"] = str(max(1, round(error.retry_after)))
        if error.status == 413:
            response.force_close()  # the rest of the body is not read
        return response
    except web.HTTPException as error:  # 404 route, 405 method, 413 body larger than its Content-Length said
        return _error(error.status, error.reason or "error", "invalid_request_error")
    except Exception:  # never let a request take the controller down
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return _error(500, "internal error; the controller's log says more", "server_error")


async def _generate(request: web.Request, backend: ServedModel, door: AdmissionPolicy, text_threads: Executor,
                    book: RunBook, parse: Callable[[Any, ServedModel, int], GenerationRequest]) -> web.StreamResponse:
    """A completions or chat request: checked and tokenized off the loop, let in by the admission policy,
    answered whole or streamed."""
    loop, exchange = asyncio.get_running_loop(), _EXCHANGE.get()
    try:
        body = await json_body(request)
        generation = await loop.run_in_executor(text_threads, parse, body, backend, door.limits.max_prompts)
        generation = attrs.evolve(generation, owner=exchange.owner)  # its caller's alone
    except ApiError:
        backend.metrics.requests.labels("bad_request").inc()
        raise
    run = await door.admit(generation)
    book.add(run)
    exchange.prompt_tokens = sum(len(ids) for ids in generation.prompts)
    watch = door.watch(run)
    try:
        return await respond(run, request, {"X-Request-Id": exchange.request_id}, text_threads)
    finally:
        watch.cancel()
        run.detach()
        exchange.generated_tokens = run.generated()


def _run(request: web.Request, backend: ServedModel, book: RunBook) -> Transcript:
    """The caller's request of the id in the path (running, or its transcript once it ended); another's is
    answered as an unknown one."""
    run = _owned(book, request.match_info["id"])
    state, why = backend.health()
    if run is None and state == "starting":  # it may be one of the journal's, not taken over yet
        raise ApiError(503, f"the server is starting: {why}", "server_error", "server_starting", 1.0)
    if run is None:
        raise ApiError(404, f"no request {quoted(request.match_info['id'])} here: it is unknown, or ended longer ago "
                       f"than this server keeps requests ({book.keep_finished:.0f} s, --keep-finished)",
                       code="request_not_found")
    return run


def _owned(book: RunBook, request_id: str) -> Transcript | None:
    """The request of `request_id` if the caller made it."""
    run = book.get(request_id)
    return run if run is not None and owns(run.owner, _EXCHANGE.get().owner) else None


async def _request_now(request: web.Request, backend: ServedModel, book: RunBook) -> web.Response:
    """A running or recently ended request: its status and each choice's text and tokens so far."""
    return web.json_response(snapshot(_run(request, backend, book)))


async def _request_stream(request: web.Request, backend: ServedModel, book: RunBook) -> web.StreamResponse:
    """A request's server-sent events again, past the `Last-Event-ID` the client got (none: all of them). A
    client that leaves this stream leaves the request be."""
    run = _run(request, backend, book)
    last = request.headers.get("Last-Event-ID")
    after = None if last is None else run.positions_of(last)
    return await stream(run, request, {"X-Request-Id": _EXCHANGE.get().request_id}, after)


async def adopt(app: web.Application, requests: Sequence[JournaledRequest]) -> list[Run]:
    """Go on with the requests a predecessor's journal holds (on this app's loop): each kept as a run of this
    controller under its own id, its unended choices computed again from their prompts."""
    runs = []
    for journaled in requests:
        run = await app[DOOR].adopt(journaled)
        app[BOOK].add(run)
        runs.append(run)
    return runs


async def _models(_: web.Request, backend: ServedModel) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "dejavu-sdk", "root": backend.model_id,
         "max_model_len": backend.context} for name in backend.names]})


async def _status(_: web.Request, backend: ServedModel, book: RunBook) -> web.Response:
    """The serving layout; of the requests taken over from a journal, the caller's alone."""
    return web.json_response(backend.status(lambda request_id: _owned(book, request_id) is not None))


async def _workers(_: web.Request, backend: ServedModel) -> web.Response:
    """Where a stage worker joins (`dejavu worker --controller URL` asks here first)."""
    return web.json_response({"join": backend.join_url, "model": backend.model_id})


async def _metrics(_: web.Request, backend: ServedModel) -> web.Response:
    """The counts, rendered off the event loop: a scrape may ask the stages for their figures (a bounded wait)."""
    backend.metrics.waiting.set(backend.waiting())
    body = await asyncio.get_running_loop().run_in_executor(None, backend.metrics.render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _health(_: web.Request, backend: ServedModel) -> web.Response:
    state, why = backend.health()
    ready = state in ("serving", "degraded")
    return web.json_response({"status": state, "reason": why}, status=200 if ready else 503,
                             headers=None if ready else {"Retry-After": "5"})


async def _version(_: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


def _error(status: int, message: str, kind: str, code: str | None = None, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)
