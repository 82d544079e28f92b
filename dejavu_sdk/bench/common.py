"""What every benchmark shares: timing, medians, the machine's description, tables and progress."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .._version import __version__


def seconds(action: Callable[[], object]) -> float:
    """Wall-clock seconds one call of `action` takes."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def parse_size(text: str) -> int:
    """Bytes in '64MiB', '1 MiB', '512KiB' or '4096'."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    cleaned = text.strip().lower().replace(" ", "")
    for unit, factor in units.items():
        if cleaned.endswith(unit):
            return int(float(cleaned[: -len(unit)]) * factor)
    return int(cleaned)


def format_size(nbytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def machine_description() -> str:
    """One line naming the CPU, cores, memory and software the figures came from."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{model}, {os.cpu_count()} cores, {memory:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, dejavu-sdk {__version__}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
