"""How a request's answer goes out over HTTP: whole, as one JSON body once it ended, or as server-sent events while
it runs (and again, past a client's `Last-Event-ID`, to a client that resumes it). The shapes are
openai_responses.py's; what is sent is the request's transcript (transcripts.py).

Each event carries `id: <request id>:<position>`, a position per choice (comma-separated when there are several):
the choice's tokens sent so far, and its end as one more. A stream ends with an error event where its request
failed, the usage where the client asked for it, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Executor
from typing import Any

from aiohttp import web

from .api_errors import ApiError
from .openai_responses import error_event, shape_of, usage
from .runs import Run
from .transcripts import Transcript

#: The response header that names a streamed request (its resumable id) before its first event.
REQUEST_HEADER = "X-Dejavu-Request-Id"


async def respond(run: Run, request: web.Request, headers: dict[str, str], text_threads: Executor
                  ) -> web.StreamResponse:
    """The answer to a completions or chat request: streamed where it asked, else whole once every choice ended
    (its JSON made on the text threads: megabytes with n choices' log-probabilities)."""
    if run.request.stream:
        return await stream(run, request, headers)
    answer = await run.complete()
    body = await asyncio.get_running_loop().run_in_executor(text_threads, json.dumps, answer)
    return web.Response(text=body, content_type="application/json", headers=headers)


async def stream(transcript: Transcript, request: web.Request, headers: dict[str, str],
                 after: list[int] | None = None) -> web.StreamResponse:
    """Server-sent events past the positions `after` (None: the whole stream, opened as its API opens it): a chunk
    per update with its event id, an error event if a choice fails, the usage when asked for (in every chunk too,
    counting the tokens sent up to it, with `continuous_usage`), then `data: [DONE]`. A client that leaves ends the
    response alone: what becomes of the request is the API's to decide."""
    shape, start = shape_of(transcript.kind), [0] * transcript.choices
    sent = transcript.generated_tokens(after or start)

    def so_far() -> dict[str, int] | None:
        return usage(transcript, sent) if transcript.continuous_usage else None

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_HEADER: transcript.id, **headers})
    try:
        await response.prepare(request)
        if after is None:
            for opening in shape.openings(transcript.choices):
                await _write(response, shape.chunk(transcript, [opening], so_far()), transcript.event_id(start))
        try:
            async for update, event_id in transcript.follow(after or start):
                sent += len(update.tokens)
                await _write(response, shape.chunk(transcript, [shape.chunk_choice(update)], so_far()), event_id)
        except ApiError as error:
            await _write(response, error_event(error))
        else:
            if transcript.include_usage:
                await _write(response, shape.chunk(transcript, [], usage=usage(transcript)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response


async def _write(response: web.StreamResponse, chunk: dict[str, Any], event_id: str | None = None) -> None:
    head = "" if event_id is None else f"id: {event_id}\n"
    await response.write(f"{head}data: {json.dumps(chunk)}\n\n".encode())
