"""A stage process's torch threads, following the cores that the machine's other processes leave it.

A forward pass split over several threads waits for the slowest of them at every operator: when another process
takes one of their cores, a thread is late at each of those barriers and a step slows down several times over,
while on an idle machine every core shortens a prompt's prefill (docs/benchmarks.md, "Against `transformers
serve`"). So a worker whose caller chose no thread count reads, every INTERVAL seconds between steps, the CPU time
the machine spent outside this process (`/proc/stat`, less this process's own), and runs as many threads as the
cores left idle by the others, at most its share of the machine (`most`), at least one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: Seconds between two readings of the machine's CPU time.
INTERVAL = 1.0
#: The weight of the latest reading in the smoothed share of the cores the other processes use.
SMOOTHING = 0.5
#: A core counts as left idle when the others use less than this share of it (their bursts, such as the head's
#: and the front door's, take a thread's core only now and then).
IDLE_SHARE = 0.5


def machine_cpu_seconds() -> tuple[float, int] | None:
    """The CPU seconds that every process has used (all but idle and I/O wait time) on the cores this process may
    run on, and how many those are, as `/proc/stat` counts them; None where there is no such file (then the
    threads stay as they are)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy, cores = 0, 0
    for line in lines:
        name, _, values = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        if allowed is not None and int(name[3:]) not in allowed:
            continue
        ticks = [int(value) for value in values.split()]
        busy += sum(ticks[:8]) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
        cores += 1
    return (busy / os.sysconf("SC_CLK_TCK"), cores) if cores else None


def own_cpu_seconds() -> float:
    """The CPU seconds this process (every thread of it) has used."""
    times = os.times()
    return times.user + times.system


class ThreadShare:
    """Sets this process's torch threads between steps (`adjust`) to the cores the other processes leave idle,
    between 1 and `most`. `machine` and `own` read the CPU time (the machine's, with its core count, and this
    process's); `clock` the time."""

    def __init__(self, most: int, machine: Callable[[], tuple[float, int] | None] = machine_cpu_seconds,
                 own: Callable[[], float] = own_cpu_seconds, clock: Callable[[], float] = time.monotonic) -> None:
        self.most, self._machine, self._own, self._clock = most, machine, own, clock
        self.others: float | None = None  # the cores the other processes use, smoothed
        self._last = self._reading()

    def _reading(self) -> tuple[float, float, float, int] | None:
        machine = self._machine()
        return None if machine is None else (self._clock(), machine[0], self._own(), machine[1])

    def adjust(self) -> int:
        """Once every INTERVAL seconds: read the CPU time the others used since the last reading, and set the
        threads to the cores they left idle; the threads now."""
        if self._last is None or self._clock() - self._last[0] < INTERVAL:
            return torch.get_num_threads()
        reading = self._reading()
        if reading is None:
            return torch.get_num_threads()
        (then, machine_then, own_then, _), (now, machine_now, own_now, cores) = self._last, reading
        self._last = reading
        used = max(0.0, (machine_now - machine_then) - (own_now - own_then)) / max(now - then, 1e-6)
        self.others = used if self.others is None else SMOOTHING * used + (1 - SMOOTHING) * self.others
        threads = max(1, min(self.most, int(cores - self.others + (1 - IDLE_SHARE))))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads
