"""What a request sent its clients, as updates with their positions (`Transcript`): streamed again to any client
that resumes it (`GET /v1/requests/<id>/stream`, past its `Last-Event-ID`) and shown by `GET /v1/requests/<id>`.

A running request (`runs.Run`) writes its transcript as it goes; once it ended, the API keeps the transcript alone
(`Run.kept()`: no request, prompts, text state nor futures), so an ended request costs what it sent, nothing more.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import attrs
from aiohttp import web

from ..errors import quoted
from .openai_requests import ApiError

#: The response header that names a streamed request (its resumable id) before its first event.
REQUEST_HEADER = "X-Dejavu-Request-Id"
#: A position of a `Last-Event-ID`: ASCII digits alone (no sign, underscore or other script's digits).
POSITION = re.compile(r"[0-9]{1,18}")


@attrs.frozen
class Update:
    """New text and tokens of choice `index` (with their log-probabilities, in the API's shape, where asked);
    `finish` set on its last. `position`: the choice's tokens through this update, and its end as one more."""

    index: int
    text: str
    tokens: list[int]
    finish: str | None
    logprobs: dict[str, Any] | None = None
    position: int = 0

    def past(self, delivered: int) -> Update:
        """What of this update a client that has `delivered` positions of its choice has not had: all of it, or
        (a position inside it, which a client can only name after an update of another controller) the tokens
        and end past it, without text."""
        first = self.position - len(self.tokens) - (self.finish is not None)
        if delivered <= first:
            return self
        return attrs.evolve(self, text="", tokens=self.tokens[delivered - first:], logprobs=None)


class Transcript:
    """Request `id`'s updates so far (`log`), what ended it (`error`, None: it ended well; `outcome`: ok, failed,
    cancelled, timed out), and whether it ended (`over`); `kind` (completion or chat), the model name it was
    answered with, whether its stream ends with the usage, its number of choices and of prompt tokens, and the owner
    id of the client token that made it (`owners`). `live`: it may change yet (a run writes it), and followers wait
    for what comes."""

    __slots__ = ("_changed", "choices", "created", "error", "id", "include_usage", "kind", "log", "model", "outcome",
                 "over", "owner", "prompt_tokens")

    def __init__(self, request_id: str, created: int, kind: str, model: str, include_usage: bool, choices: int,
                 prompt_tokens: int, live: bool = True, owner: str | None = None) -> None:
        self.id, self.created, self.kind, self.model, self.owner = request_id, created, kind, model, owner
        self.include_usage, self.choices, self.prompt_tokens = include_usage, choices, prompt_tokens
        self.log: list[Update] = []
        self.error: ApiError | None = None
        self.outcome: str | None = None
        self.over = not live
        self._changed: asyncio.Event | None = asyncio.Event() if live else None

    def _wake(self) -> None:
        """Tell those who follow that the log (or the end) changed."""
        assert self._changed is not None  # live
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: list[int]) -> AsyncIterator[tuple[Update, str]]:
        """The updates past the positions `after` (one per choice), each with its event id, as they come; the
        run's ApiError where it failed."""
        sent, positions = 0, list(after)
        while True:
            changed = self._changed
            while sent < len(self.log):
                update = self.log[sent]
                sent += 1
                if update.position > positions[update.index]:
                    update = update.past(positions[update.index])
                    positions[update.index] = update.position
                    yield update, self.event_id(positions)
            if self.over:
                if self.error is not None:
                    raise self.error
                return
            assert changed is not None  # live
            await changed.wait()

    def event_id(self, positions: list[int]) -> str:
        return f"{self.id}:{','.join(str(position) for position in positions)}"

    def positions_of(self, event_id: str) -> list[int]:
        """The positions a client's `Last-Event-ID` names, each in ASCII digits (ApiError 400: not an id of this
        run's events)."""
        run, _, listed = event_id.strip().rpartition(":")
        parts = listed.split(",")
        positions = [int(part) for part in parts] if all(POSITION.fullmatch(part) for part in parts) else []
        if run != self.id or len(positions) != self.choices:
            raise ApiError(400, f"Last-Event-ID {quoted(event_id)} is not an event of {self.id}: it has the form "
                           f"{self.id}:<position>, a position per choice")
        return positions

    async def stream(self, request: web.Request, headers: dict[str, str],
                     after: list[int] | None = None) -> web.StreamResponse:
        """Server-sent events past the positions `after` (None: the whole stream): a chunk per update with its
        event id, an error event if a choice fails, the usage when asked for, then `data: [DONE]`."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               REQUEST_HEADER: self.id, **headers})
        try:
            await response.prepare(request)
            if after is None and self.kind == "chat":  # the assistant's turn opens every choice, as OpenAI's does
                for index in range(self.choices):
                    await self._send(response, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}],
                                     event_id=self.event_id([0] * self.choices))
            try:
                async for update, event_id in self.follow(after or [0] * self.choices):
                    await self._send(response, [self._chunk_choice(update, self.kind)], event_id=event_id)
            except ApiError as error:
                await _write(response, {"error": {"message": error.message, "type": error.kind, "code": error.code}})
            else:
                if self.include_usage:
                    await self._send(response, [], usage=self._usage())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client left: the API decides what becomes of the run
            pass
        return response

    def snapshot(self) -> dict[str, Any]:
        """The request as `GET /v1/requests/<id>` answers it: its status (running, or how it ended), each
        choice's text, tokens and finish reason so far, the usage, and its error where it failed."""
        texts: list[str] = ["" for _ in range(self.choices)]
        tokens: list[list[int]] = [[] for _ in range(self.choices)]
        finish: list[str | None] = [None for _ in range(self.choices)]
        for update in self.log:
            texts[update.index] += update.text
            tokens[update.index] += update.tokens
            finish[update.index] = update.finish or finish[update.index]
        status = "running" if not self.over else "failed" if self.error is not None else \
            "finished" if self.outcome in (None, "ok") else self.outcome
        answer = {**self._head(), "object": "request", "status": status,
                  "choices": [{"index": index, "text": texts[index], "token_ids": tokens[index],
                               "finish_reason": finish[index]} for index in range(self.choices)],
                  "usage": self._usage()}
        if self.error is not None:
            answer["error"] = {"message": self.error.message, "type": self.error.kind, "code": self.error.code}
        return answer

    def _usage(self) -> dict[str, int]:
        generated = sum(len(update.tokens) for update in self.log)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": generated,
                "total_tokens": self.prompt_tokens + generated}

    def _head(self) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def _chunk_choice(update: Update, kind: str) -> dict[str, Any]:
        if kind == "chat":
            delta = {"content": update.text} if update.text or update.finish is None else {}
            return {"index": update.index, "delta": delta, "finish_reason": update.finish, "logprobs": update.logprobs}
        return {"index": update.index, "text": update.text, "logprobs": update.logprobs,
                "finish_reason": update.finish, "token_ids": update.tokens}

    async def _send(self, response: web.StreamResponse, choices: list[dict[str, Any]],
                    usage: dict[str, int] | None = None, event_id: str | None = None) -> None:
        head = self._head()
        if self.kind == "chat":
            head["object"] = "chat.completion.chunk"
        extra = {"usage": usage} if self.include_usage else {}
        await _write(response, {**head, "choices": choices, **extra}, event_id)


async def _write(response: web.StreamResponse, chunk: dict[str, Any], event_id: str | None = None) -> None:
    head = "" if event_id is None else f"id: {event_id}\n"
    await response.write(f"{head}data: {json.dumps(chunk)}\n\n".encode())
