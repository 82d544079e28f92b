"""The prefix bench's requests sent to `dejavu serve` (`dejavu bench prefix --serve`): a `Controller` of the model
started with or without a prefix cache, each request streamed through the OpenAI client as a user's would be, its
time to first token taken at its first streamed text, and its cached positions from its usage
(`prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

from .prefix_runs import Run, Turn

#: Seconds a request may take before the bench gives up on it.
REQUEST_TIMEOUT = 600.0


@contextlib.contextmanager
def served(model: str, prefix_cache: str | None, chunk: int, stages: int) -> Iterator[Callable[[Sequence[Turn], int],
                                                                                               Run]]:
    """A running `dejavu serve` of `model` in `stages` mixed stages (prompts prefilled `chunk` positions a round),
    with `prefix_cache` (None: none), and the function that sends it a workload's turns one after another."""
    import openai

    from ..controller import Controller

    options = {} if prefix_cache is None else {"prefix_cache": prefix_cache, "prefix_chunk": chunk}
    with Controller(model, stages=stages, port=0, ignore_eos=True, max_prefill_tokens=chunk, **options) as controller:
        client = openai.OpenAI(base_url=controller.url + "/v1", api_key=controller.token, max_retries=0,
                               timeout=REQUEST_TIMEOUT)

        def run(turns: Sequence[Turn], new_tokens: int) -> Run:
            first, cached, tokens = [], [], 0
            started = time.perf_counter()
            for turn in turns:
                sent, arrived, usage = time.perf_counter(), None, None
                for event in client.completions.create(model=model, prompt=[list(turn.ids)], max_tokens=new_tokens,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}):
                    if arrived is None and event.choices and event.choices[0].text:
                        arrived = time.perf_counter()
                    usage = event.usage or usage
                first.append((arrived or time.perf_counter()) - sent)
                details = usage.prompt_tokens_details if usage is not None else None
                cached.append(details.cached_tokens or 0 if details is not None else 0)
                tokens += usage.completion_tokens if usage is not None else 0
            return Run(tuple(first), tuple(cached), time.perf_counter() - started, tokens)

        yield run
