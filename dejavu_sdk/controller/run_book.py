"""The requests a controller answers about (`GET /v1/requests/<id>`, `.../stream`): those running, and those that
ended in the last `keep_finished` seconds, at most `MAX_KEPT` of them (the oldest go first).

Everything here runs on the API's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from .runs import Run

log = logging.getLogger(__name__)

#: The most ended requests kept at once, whatever `keep_finished` says: what a burst of requests keeps is bounded.
MAX_KEPT = 10_000


class RunBook:
    """Runs by id; an ended one stays `keep_finished` seconds (0: it goes as it ends)."""

    def __init__(self, keep_finished: float) -> None:
        self.keep_finished = keep_finished
        self._runs: dict[str, Run] = {}
        self._ended: collections.deque[str] = collections.deque()  # ids of ended runs, oldest first
        self._keeping: set[asyncio.Task[None]] = set()

    def add(self, run: Run) -> None:
        """Keep `run` while it runs, and `keep_finished` seconds after it ended."""
        self._runs[run.id] = run
        task = asyncio.get_running_loop().create_task(self._forget_when_kept(run))
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)

    def __len__(self) -> int:
        return len(self._runs)

    def close(self) -> None:
        """Keep nothing more, and stop every run's log (the API stops)."""
        for task in list(self._keeping):
            task.cancel()
        for run in self._runs.values():
            run.abandon()
        self._runs.clear()

    async def _forget_when_kept(self, run: Run) -> None:
        try:
            await run.ended()
        except Exception:  # the run's own failure is in its log; it is kept all the same
            log.debug("%s ended with an error", run.id, exc_info=True)
        self._ended.append(run.id)
        while len(self._ended) > MAX_KEPT:
            self._runs.pop(self._ended.popleft(), None)
        await asyncio.sleep(self.keep_finished)
        if self._runs.get(run.id) is run:
            del self._runs[run.id]
        with contextlib.suppress(ValueError):  # already dropped for MAX_KEPT
            self._ended.remove(run.id)
