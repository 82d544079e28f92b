"""The controller's HTTP API over a stub model, in this process: what the API and the journal cost, with no pipeline.

`StubModel` stands where the `Controller` does (`api.ServedModel`): each choice's tokens, `(sum(prompt) + step) % 1000`
for each of its `max_tokens` steps, come at once on a receiver thread of its own, as the pipeline's receiver thread
gives them; a prompt with an id outside its vocabulary of 1000 is refused as the pipeline refuses it (ConfigError).
Submitted choices are recorded in the journal's microbatch rows as the pipeline records them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from aiohttp import web

from dejavu_sdk.controller.api import build_app
from dejavu_sdk.controller.journal import Journal
from dejavu_sdk.controller.limits import ApiLimits
from dejavu_sdk.controller.metrics import ControllerMetrics
from dejavu_sdk.errors import ConfigError
from dejavu_sdk.generation.batching import Result

TOKEN, VOCABULARY = "stub-token", 1000


class StubModel:
    """A served model whose tokens are a function of the prompt."""

    model_id, tokenizer, context, eos, names, join_url = "stub", None, 4096, [], ["stub"], "tcp://127.0.0.1:9"

    def __init__(self, journal: Journal | None) -> None:
        self.journal, self.metrics = journal, ControllerMetrics()
        self._receiver = ThreadPoolExecutor(1, thread_name_prefix="stub-receiver")
        self._microbatches = itertools.count()

    def submit(self, choices: list[Any], on_token: Any, on_logprobs: Any = None, tags: Any = None,
               salt: str = "") -> list[Future]:
        for choice in choices:
            if not all(0 <= token < VOCABULARY for token in choice.prompt):
                raise ConfigError(f"a prompt holds token ids outside the vocabulary of {VOCABULARY}")
        if self.journal is not None and tags is not None:
            number = next(self._microbatches)
            self.journal.slot_group(number, list(range(len(tags))), list(tags))
        futures: list[Future] = [Future() for _ in choices]
        self._receiver.submit(self._generate, choices, on_token, futures)
        return futures

    @staticmethod
    def _generate(choices: list[Any], on_token: Any, futures: list[Future]) -> None:
        for index, (choice, future) in enumerate(zip(choices, futures, strict=True)):
            tokens = [(sum(choice.prompt) + step) % VOCABULARY for step in range(choice.max_tokens)]
            for token in tokens:
                on_token(index, token)
            if future.set_running_or_notify_cancel():
                future.set_result(Result(torch.tensor(tokens), 0, 0, 1, 0))

    def health(self) -> tuple[str, str]:
        return "serving", ""

    def waiting(self) -> int:
        return 0

    def none_started(self, futures: Any) -> bool:
        return False

    def started_at(self, future: Any) -> float | None:
        return None

    def cached_positions(self, future: Any) -> int:
        return 0

    def status(self) -> dict[str, Any]:
        return {}


@contextlib.contextmanager
def serving(model: StubModel, limits: ApiLimits | None = None) -> Iterator[str]:
    """The API over `model` on a loopback port, on a thread and event loop of its own; its URL."""
    loop = asyncio.new_event_loop()
    ready: Future[str] = Future()

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(build_app(model, [TOKEN], "stub-worker-token", limits or ApiLimits()), access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        ready.set_result(f"http://127.0.0.1:{runner.addresses[0][1]}")
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, name="stub-api", daemon=True)
    thread.start()
    try:
        yield ready.result(timeout=30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
