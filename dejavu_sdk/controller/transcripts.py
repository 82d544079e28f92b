"""What a request sent its clients, as updates with their positions (`Transcript`): streamed again to any client
that resumes it (`GET /v1/requests/<id>/stream`, past its `Last-Event-ID`) and shown by `GET /v1/requests/<id>`.

A running request (`runs.Run`) writes its transcript as it goes (`append`, then `close`); once it ended, the API
keeps the transcript alone (`Run.kept()`: no request, prompts, text state nor futures), so an ended request costs
what it sent, nothing more. How it goes out over HTTP is answers.py's; its shapes are openai_responses.py's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import attrs

from ..errors import quoted
from .api_errors import ApiError
from .request_state import RequestState, Update

#: A position of a `Last-Event-ID`: ASCII digits alone (no sign, underscore or other script's digits).
POSITION = re.compile(r"[0-9]{1,18}")

__all__ = ["POSITION", "Transcript", "Update"]


class Transcript:
    """Request `id`'s updates so far (`log`), its `state` (running, or how it ended) and the error it failed with
    (`error`), and whether its log is complete (`over`: no update comes any more); `kind` (completion or chat), the
    model name it was answered with, whether its stream ends with the usage (and `continuous_usage`: every chunk
    carries it), its number of choices and of prompt tokens (`cached_tokens` of them read from the prompt
    prefixes), and the owner id of the client token that made it (`owners`). `live`: it may change yet (a run
    writes it), and followers wait for what comes."""

    __slots__ = ("_changed", "_positions", "cached_tokens", "choices", "continuous_usage", "created", "error", "id",
                 "include_usage", "kind", "log", "model", "over", "owner", "prompt_tokens", "state")

    def __init__(self, request_id: str, created: int, kind: str, model: str, include_usage: bool, choices: int,
                 prompt_tokens: int, live: bool = True, owner: str | None = None,
                 continuous_usage: bool = False) -> None:
        self.id, self.created, self.kind, self.model, self.owner = request_id, created, kind, model, owner
        self.include_usage, self.choices, self.prompt_tokens = include_usage, choices, prompt_tokens
        self.continuous_usage = continuous_usage
        #: Prompt positions read from the prompt prefixes instead of computed (known once a choice ends).
        self.cached_tokens = 0
        self.log: list[Update] = []
        self.error: ApiError | None = None
        self.state = RequestState.RUNNING
        self.over = not live
        self._changed: asyncio.Event | None = asyncio.Event() if live else None
        self._positions = [0] * choices if live else []

    def append(self, update: Update) -> None:
        """Add `update` to the log, with its position (on the event loop)."""
        self._positions[update.index] += len(update.tokens)
        position = self._positions[update.index] + (update.finish is not None)
        self.log.append(attrs.evolve(update, position=position))
        self._wake()

    def close(self, error: ApiError | None = None) -> None:
        """The log is complete (with the request's `error`, where it failed): followers get what is left, then
        the end."""
        if error is not None:
            self.error = error
        self.over = True
        self._wake()

    def kept(self) -> Transcript:
        """This transcript as it stays once its request ended: what it sent, nothing to follow."""
        kept = Transcript(self.id, self.created, self.kind, self.model, self.include_usage, self.choices,
                          self.prompt_tokens, live=False, owner=self.owner, continuous_usage=self.continuous_usage)
        kept.log, kept.error, kept.state = list(self.log), self.error, self.state
        return kept

    def status(self) -> str:
        """Running, or how it ended: finished, failed, cancelled, timed_out (or refused: taken over from a journal
        and refused)."""
        if not self.over:
            return "running"
        if self.error is not None:
            return "failed"
        return "finished" if self.state in (RequestState.RUNNING, RequestState.FINISHED) else self.state.value

    def generated_tokens(self, positions: list[int] | None = None) -> int:
        """The tokens sent so far, of every choice (up to each choice's position of `positions`)."""
        if positions is None:
            return sum(len(update.tokens) for update in self.log)
        sent = [0] * self.choices
        for update in self.log:
            sent[update.index] += len(update.tokens)
        return sum(min(tokens, position) for tokens, position in zip(sent, positions, strict=True))

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
