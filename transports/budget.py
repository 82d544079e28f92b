"""How many bytes of records a server holds for transfers at once: its memory, bounded by configuration.

A server copies a record out of a store that lends buffers (LMDB) before sending it, and receives a record
into memory before storing it. Each such buffer is reserved here first, up to `limit` bytes in all; a
transfer that does not fit waits its turn (first come, first served), so a hundred slow readers of one
large block hold `limit` bytes between them, not a copy each. A record larger than `limit` is served
alone, when nothing else is in flight.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import attrs

from ..errors import ConfigError

_log = logging.getLogger(__name__)


@attrs.define
class _Waiter:
    size: int
    deadline: float
    granted: Callable[[bool], None]


class InflightBudget:
    """Reservations of bytes against `limit`; thread-safe. A waiter's `granted(True)` is called once its bytes are
    reserved for it, `granted(False)` once its deadline passed first; either on the thread that freed the room
    or expired it, so it must be short (hand the work to a pool)."""

    def __init__(self, limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ConfigError(f"max_inflight_bytes must be a positive integer, got {limit!r}")
        self.limit = limit
        self._used = 0
        self._lock = threading.Condition()
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def used(self) -> int:
        """Bytes reserved now."""
        return self._used

    def _fits(self, size: int) -> bool:
        return self._used + size <= self.limit or self._used == 0

    def try_reserve(self, size: int) -> bool:
        """Reserve `size` bytes if they fit now and nobody waits before them."""
        with self._lock:
            if self._waiters or not self._fits(size):
                return False
            self._used += size
            return True

    def reserve(self, size: int, timeout: float | None) -> bool:
        """Reserve `size` bytes, waiting up to `timeout` seconds (None: forever) for room; whether it did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._waiters or not self._fits(size):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
            self._used += size
            return True

    def wait(self, size: int, deadline: float, granted: Callable[[bool], None]) -> None:
        """Reserve `size` bytes once they fit, after everyone already waiting; `granted` says when (or that
        `deadline`, a `time.monotonic()`, passed first: see `expire`)."""
        with self._lock:
            if not self._waiters and self._fits(size):
                self._used += size
                ready = True
            else:
                self._waiters.append(_Waiter(size, deadline, granted))
                ready = False
        if ready:
            granted(True)

    def release(self, size: int) -> None:
        """Give back `size` reserved bytes; waiters that now fit are granted, in order."""
        if not size:
            return
        with self._lock:
            self._used -= size
            ready = self._grant()
            self._lock.notify_all()
        self._tell(ready, True)

    def expire(self, now: float) -> None:
        """Tell each waiter whose deadline is past that it gets nothing."""
        with self._lock:
            late = [waiter for waiter in self._waiters if waiter.deadline <= now]
            for waiter in late:
                self._waiters.remove(waiter)
            ready = self._grant()
        self._tell(late, False)
        self._tell(ready, True)

    def _tell(self, waiters: list[_Waiter], granted: bool) -> None:
        """Call each waiter's `granted`; one that fails is logged and its bytes given back, and the rest still
        hear."""
        for waiter in waiters:
            try:
                waiter.granted(granted)
            except Exception:  # noqa: PERF203 - each waiter on its own
                _log.exception("a waiter for %d bytes failed to take its answer", waiter.size)
                if granted:
                    self.release(waiter.size)

    def _grant(self) -> list[_Waiter]:
        """Reserve for the waiters at the front that fit now; called with the lock held."""
        ready = []
        while self._waiters and self._fits(self._waiters[0].size):
            waiter = self._waiters.popleft()
            self._used += waiter.size
            ready.append(waiter)
        return ready
