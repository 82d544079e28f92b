"""What the API and its admission serve from (`ServedModel`): the `Controller` is one; the tests' stub model
another."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from .journal import Journal
from .metrics import ControllerMetrics
from .openai_requests import Choice


class ServedModel(Protocol):
    """What the API serves from (the `Controller`)."""

    model_id: str
    tokenizer: Any | None
    context: int | None
    eos: list[int]
    metrics: ControllerMetrics
    journal: Journal | None

    @property
    def names(self) -> Sequence[str]: ...

    def submit(self, choices: list[Choice], on_token: Callable[[int, int], None],
               on_logprobs: Callable[[int, Any], None] | None = None,
               tags: Sequence[Any] | None = None) -> list[Future[Any]]: ...

    def health(self) -> tuple[str, str]:
        """("serving" | "degraded" | "starting" | "recovering" | "draining" | "failed" | "journal_failed", why)."""

    def waiting(self) -> int:
        """Choices waiting to start."""

    def none_started(self, futures: Sequence[Future[Any]]) -> bool:
        """Whether none of `futures`' requests has started (nor ended)."""

    def started_at(self, future: Future[Any]) -> float | None: ...

    def status(self, readable: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """The serving layout and what it took over from a journal (the request ids `readable` says a caller may
        know of; None: every one)."""

    @property
    def join_url(self) -> str:
        """Where stage workers join the pipeline's head (a transport URL)."""
