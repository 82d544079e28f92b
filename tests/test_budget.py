"""The in-flight budget: reservations up to a limit, waiters served in order, a deadline for each."""

from __future__ import annotations

import threading
import time

import pytest

from dejavu_sdk.errors import ConfigError
from dejavu_sdk.transports.budget import InflightBudget


def _recorder(log: list, name: str):
    return lambda granted: log.append((name, granted))


def test_reservations_fit_the_limit_and_waiters_are_granted_in_order_as_room_comes_back() -> None:
    budget = InflightBudget(100)
    assert budget.try_reserve(60)
    assert not budget.try_reserve(50)
    log: list = []
    budget.wait(50, time.monotonic() + 60, _recorder(log, "first"))
    budget.wait(10, time.monotonic() + 60, _recorder(log, "second"))  # fits now, but waits its turn
    assert not budget.try_reserve(10), "a newcomer jumped the queue"
    assert log == []
    budget.release(60)
    assert log == [("first", True), ("second", True)]
    assert budget.used == 60
    budget.release(50)
    budget.release(10)
    assert budget.used == 0


def test_a_record_larger_than_the_limit_goes_alone() -> None:
    budget = InflightBudget(100)
    assert budget.try_reserve(10)
    log: list = []
    budget.wait(500, time.monotonic() + 60, _recorder(log, "large"))
    assert log == []
    budget.release(10)
    assert log == [("large", True)]
    assert not budget.try_reserve(1)
    budget.release(500)
    assert budget.try_reserve(100)


def test_a_waiter_past_its_deadline_gets_nothing_and_the_next_goes_on() -> None:
    budget = InflightBudget(100)
    assert budget.try_reserve(100)
    log: list = []
    now = time.monotonic()
    budget.wait(80, now + 1, _recorder(log, "late"))
    budget.wait(20, now + 60, _recorder(log, "patient"))
    budget.expire(now + 0.5)
    assert log == []
    budget.expire(now + 2)
    assert log == [("late", False)]
    budget.release(100)
    assert log == [("late", False), ("patient", True)]
    assert budget.used == 20


def test_a_blocking_reservation_waits_for_room_or_its_timeout() -> None:
    budget = InflightBudget(10)
    assert budget.try_reserve(10)
    started = time.monotonic()
    assert not budget.reserve(5, timeout=0.2)
    assert 0.15 < time.monotonic() - started < 2
    threading.Timer(0.1, budget.release, args=(10,)).start()
    assert budget.reserve(5, timeout=5)
    assert budget.used == 5


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "1MiB", None])
def test_bad_limits_are_refused(limit) -> None:
    with pytest.raises(ConfigError):
        InflightBudget(limit)
