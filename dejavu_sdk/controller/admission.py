"""The front door's admission policy (`AdmissionPolicy`): which requests the controller lets in, and how long one
may wait to start. The scheduler's own admission (generation/admission.py: what the KV budget holds, turns
between submissions) then takes those let in from the pipeline's waiting queue.

- A request sent while the stage workers start waits for them, up to the queue timeout (on the loop, holding no
  thread); one sent during a recovery is queued (it waits in the pipeline), one sent while degraded is served.
- 503 once starting took longer, while draining or failed (`server_<state>`), or while the journal cannot write
  (`journal_failed`), with Retry-After 5.
- 400 a request of more choices than the waiting queue holds at all; 429 `queue_full` (Retry-After 1) one whose
  choices would overfill it (`max_waiting`).
- 400 a request the pipeline refuses as it is queued (`kv_budget_exceeded`: one that could never fit the KV
  budget, and would wait for ever), 503 `pipeline_failed` when the pipeline failed or closed meanwhile.
- A request none of whose choices started within `queue_timeout` seconds is cancelled, its answer a 503
  `queue_timeout`.

Submitting runs on the admission thread (it may wait on the pipeline), never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Executor

from ..errors import ConfigError, DejaVuError, RequestTooLarge
from .api_errors import ApiError
from .journal import JournaledRequest
from .limits import ApiLimits
from .openai_requests import GenerationRequest
from .openai_responses import shape_of
from .runs import Run
from .served_model import ServedModel

#: Seconds between looks at whether the stage workers have started, while a request waits for them.
STARTING_POLL = 0.05


class AdmissionPolicy:
    """Lets requests into `backend` within `limits`: submitted on the `admission` thread (which also cancels),
    their text made on `text_threads`."""

    def __init__(self, backend: ServedModel, limits: ApiLimits, text_threads: Executor, admission: Executor) -> None:
        self.backend, self.limits, self.text_threads, self.admission = backend, limits, text_threads, admission

    async def admit(self, generation: GenerationRequest) -> Run:
        """The request queued as a started run, or the ApiError that says why it is not."""
        state, why = await self._until_serving()
        if state == "journal_failed":
            raise ApiError(503, f"the server takes no new requests: {why}", "server_error", "journal_failed", 5.0)
        if state != "serving":
            raise ApiError(503, f"the server is {state}: {why}", "server_error", f"server_{state}", 5.0)
        limit, waiting = self.limits.max_waiting, self.backend.waiting()
        if len(generation.choices) > limit:
            raise ApiError(400, f"{len(generation.choices)} choices is more than the {limit} this server queues at "
                           "all (--max-waiting)")
        if waiting + len(generation.choices) > limit:
            raise ApiError(429, f"{waiting} choices are waiting already, and this server queues at most {limit} "
                           "(--max-waiting): try again later", "rate_limit_error", "queue_full", 1.0)
        loop = asyncio.get_running_loop()
        submitted = loop.run_in_executor(self.admission, Run, self.backend, generation, loop, self.text_threads,
                                         self.admission)
        try:
            run = await asyncio.shield(submitted)
        except asyncio.CancelledError:  # the client left while its request was being queued: take it off again
            submitted.add_done_callback(_cancel_when_submitted)
            raise
        except RequestTooLarge as error:  # never queued: it would wait for ever
            self.backend.metrics.requests.labels("bad_request").inc()
            param = "max_tokens" if error.most_new_tokens is not None else shape_of(generation.kind).prompt_argument
            raise ApiError(400, f"{error}; each choice is a row of its own", code="kv_budget_exceeded",
                           param=param) from None
        except ConfigError as error:
            self.backend.metrics.requests.labels("bad_request").inc()
            raise ApiError(400, str(error)) from None
        except DejaVuError as error:  # the pipeline failed or closed meanwhile
            raise ApiError(503, f"the serving pipeline cannot take requests: {error}", "server_error",
                           "pipeline_failed", 5.0) from None
        run.start()
        return run

    def watch(self, run: Run) -> asyncio.Task[None]:
        """Time `run` out if none of its choices started within the queue timeout (cancel the task once its
        client is answered)."""
        return asyncio.get_running_loop().create_task(self._queue_timeout(run))

    async def adopt(self, journaled: JournaledRequest) -> Run:
        """Go on with a request a predecessor's journal holds, as a started run under its own id."""
        loop = asyncio.get_running_loop()
        run = await loop.run_in_executor(self.admission, functools.partial(
            Run, self.backend, journaled.request(), loop, self.text_threads, self.admission, adopted=journaled))
        run.start()
        return run

    async def _until_serving(self) -> tuple[str, str]:
        """Wait (on the loop, holding no thread) while the workers start, up to the queue timeout; the state then.
        Requests sent during a recovery are queued: they wait in the pipeline; degraded, they are served."""
        deadline = time.monotonic() + self.limits.queue_timeout
        state, why = self.backend.health()
        while state == "starting" and time.monotonic() < deadline:
            await asyncio.sleep(STARTING_POLL)
            state, why = self.backend.health()
        return ("serving", why) if state in ("recovering", "degraded") else (state, why)

    async def _queue_timeout(self, run: Run) -> None:
        """Cancel a request none of whose choices has started after the queue timeout: its answer is a 503."""
        timeout = self.limits.queue_timeout
        await asyncio.sleep(timeout)
        if await asyncio.get_running_loop().run_in_executor(self.admission, self.backend.none_started, run.futures):
            run.time_out(f"it waited {timeout:.0f} s (--queue-timeout) without starting")


def _cancel_when_submitted(submitted: asyncio.Future[Run]) -> None:
    if not submitted.cancelled() and submitted.exception() is None:
        run = submitted.result()
        run.start()  # its end is counted (and journaled) as any run's
        run.cancel("a client left %s while it was being queued")
