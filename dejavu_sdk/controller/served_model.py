"""What the front door serves from, as two protocols: `GenerationBackend`, what a request's run needs (runs.py),
and `ServedModel`, what the whole API and its admission need besides (the `Controller` is one; the tests' stub
model another)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from ..generation.batching import Result
from ..generation.logprobs import PromptLogprobs, TokenLogprobs
from .journal import Journal
from .metrics import ControllerMetrics
from .openai_requests import Choice


class GenerationBackend(Protocol):
    """What a run is served by: the tokenizer and end-of-sequence ids, the metrics, and a way to submit choices."""

    tokenizer: Any | None
    eos: list[int]
    metrics: ControllerMetrics
    journal: Journal | None

    def submit(self, choices: list[Choice], on_token: Callable[[int, int], None],
               on_logprobs: Callable[[int, TokenLogprobs | PromptLogprobs], None] | None = None,
               tags: Sequence[Any] | None = None, salt: str = "") -> list[Future[Result]]:
        """Queue every choice (all checked first: ConfigError); `on_token(index, id)` as tokens arrive, each after
        its log-probabilities to `on_logprobs(index, entry)` where the choices ask for them; `tags[index]` names
        choice `index` in the journal's microbatch records; `salt`: the tenant of their prompt prefixes."""

    def started_at(self, future: Future[Result]) -> float | None:
        """When the choice of `future` left the waiting queue (`time.monotonic()`)."""

    def cached_positions(self, future: Future[Result]) -> int:
        """The prompt positions the choice of `future` read from the prompt prefixes (known once its first token
        came)."""


class ServedModel(GenerationBackend, Protocol):
    """What the API serves from (the `Controller`): besides what a run needs, the model's names and context,
    whether it serves, its waiting queue, its status and where stage workers join."""

    model_id: str
    context: int | None

    @property
    def names(self) -> Sequence[str]: ...

    def health(self) -> tuple[str, str]:
        """("serving" | "degraded" | "starting" | "recovering" | "draining" | "failed" | "journal_failed", why)."""

    def waiting(self) -> int:
        """Choices waiting to start."""

    def none_started(self, futures: Sequence[Future[Result]]) -> bool:
        """Whether none of `futures`' requests has started (nor ended)."""

    def status(self, readable: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """The serving layout and what it took over from a journal (the request ids `readable` says a caller may
        know of; None: every one)."""

    @property
    def join_url(self) -> str:
        """Where stage workers join the pipeline's head (a transport URL)."""
