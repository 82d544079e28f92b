"""The requests a controller answers about (`GET /v1/requests/<id>`, `.../stream`): those running, and those that
ended in the last `keep_finished` seconds, at most `MAX_KEPT` of them (the oldest go first). An ended request is
kept as its transcript alone (`Run.kept()`), so what the ended ones cost is bounded whatever passed through.

Everything here runs on the API's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from .limits import MAX_KEPT
from .runs import Run
from .transcripts import Transcript

log = logging.getLogger(__name__)

__all__ = ["MAX_KEPT", "RunBook"]


class RunBook:
    """Runs by id; an ended one stays `keep_finished` seconds (0: it goes as it ends), as its transcript."""

    def __init__(self, keep_finished: float) -> None:
        self.keep_finished = keep_finished
        self._runs: dict[str, Transcript] = {}
        #: The ended ones, the first ended first: until when each is kept (time.monotonic()), its id, its transcript.
        self._ended: collections.deque[tuple[float, str, Transcript]] = collections.deque()
        self._running: dict[asyncio.Task[None], Run] = {}  # each waits for its run's end

    def add(self, run: Run) -> None:
        """Keep `run` while it runs, and its transcript `keep_finished` seconds after it ended."""
        self._runs[run.id] = run
        task = asyncio.get_running_loop().create_task(self._keep_when_ended(run))
        self._running[task] = run
        task.add_done_callback(self._running.pop)

    def get(self, run_id: str) -> Transcript | None:
        self._forget_expired()
        return self._runs.get(run_id)

    def __len__(self) -> int:
        self._forget_expired()
        return len(self._runs)

    def close(self) -> None:
        """Keep nothing more, and stop every run's log (the API stops)."""
        for task, run in list(self._running.items()):
            task.cancel()
            run.abandon()
        self._runs.clear()
        self._ended.clear()

    async def _keep_when_ended(self, run: Run) -> None:
        try:
            await run.ended()
        except Exception:  # the run's own failure is in its log; it is kept all the same
            log.debug("%s ended with an error", run.id, exc_info=True)
        if self._runs.get(run.id) is run:
            kept = self._runs[run.id] = run.kept()
            self._ended.append((time.monotonic() + self.keep_finished, run.id, kept))
        self._forget_expired()

    def _forget_expired(self) -> None:
        """Drop the ended requests kept past `keep_finished`, and the oldest past `MAX_KEPT`."""
        now = time.monotonic()
        while self._ended and (len(self._ended) > MAX_KEPT or self._ended[0][0] <= now):
            _, run_id, kept = self._ended.popleft()
            if self._runs.get(run_id) is kept:
                del self._runs[run_id]
