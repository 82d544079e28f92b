"""Who waits for the journal to write: the API sends a stream's tokens once the journal holds them, so each waits
for its entries (`Waiting.when`), and is told once they are written, or never will be."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Waiting:
    """Callbacks that wait for entries up to a sequence number: each is called with `verdict(sequence)` once that
    is True or False (None: not yet), here if it is already, else at the first `tell()` after."""

    def __init__(self, verdict: Callable[[int], bool | None]) -> None:
        self._verdict = verdict
        self._lock = threading.Lock()
        self._waiting: list[tuple[int, Callable[[bool], object]]] = []

    def when(self, sequence: int, callback: Callable[[bool], object]) -> None:
        with self._lock:
            due = self._verdict(sequence)
            if due is None:
                self._waiting.append((sequence, callback))
                return
        callback(due)

    def tell(self) -> None:
        """Call the callbacks whose verdict came."""
        with self._lock:
            verdicts = [(callback, self._verdict(sequence)) for sequence, callback in self._waiting]
            self._waiting = [waiting for waiting, (_, due) in zip(self._waiting, verdicts, strict=True) if due is None]
        for callback, due in verdicts:
            if due is None:
                continue
            try:
                callback(due)
            except Exception:  # a waiter gone meanwhile (its event loop closed): none to tell
                log.debug("a journal waiter could not be told", exc_info=True)
