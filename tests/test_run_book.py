"""The requests a controller answers about after they ended: kept `keep_finished` seconds, at most `MAX_KEPT` of
them (the oldest go first), each as its transcript alone, and those still running whatever their number."""

from __future__ import annotations

import asyncio

from dejavu_sdk.controller import run_book
from dejavu_sdk.controller.run_book import RunBook


class _Run:
    """A run as the book sees it: its id, when it ends, and what is kept of it then."""

    def __init__(self, name: str) -> None:
        self.id = name
        self.done = asyncio.Event()
        self.abandoned = False
        self.transcript = object()

    def kept(self) -> object:
        return self.transcript

    async def ended(self) -> None:
        await self.done.wait()

    def abandon(self) -> None:
        self.abandoned = True


def test_an_ended_request_is_kept_keep_finished_seconds_and_a_running_one_until_it_ends() -> None:
    async def scenario() -> None:
        book = RunBook(keep_finished=0.3)
        ended, running = _Run("ended"), _Run("running")
        book.add(ended)
        book.add(running)
        ended.done.set()
        await asyncio.sleep(0.1)
        assert book.get("ended") is ended.transcript  # within keep_finished, as its transcript
        await asyncio.sleep(0.5)
        assert book.get("ended") is None  # past it
        assert book.get("running") is running  # running: kept however long
        running.done.set()
        await asyncio.sleep(0.5)
        assert len(book) == 0

    asyncio.run(scenario())


def test_at_most_max_kept_ended_requests_stay_the_oldest_going_first(monkeypatch) -> None:
    monkeypatch.setattr(run_book, "MAX_KEPT", 2)

    async def scenario() -> None:
        book = RunBook(keep_finished=60)
        runs = [_Run(f"r{number}") for number in range(3)]
        for run in runs:
            book.add(run)
            run.done.set()
            await asyncio.sleep(0.01)  # they end in order
        await asyncio.sleep(0.05)
        assert [book.get(run.id) is run.transcript for run in runs] == [False, True, True]
        running = _Run("running")
        book.add(running)
        await asyncio.sleep(0.01)
        book.close()  # the API stops: every running run's log stops, nothing is kept
        assert len(book) == 0
        assert running.abandoned

    asyncio.run(scenario())
