"""What every benchmark shares: timing, medians, the machine's description, and throughputs with their plot."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs
import torch

from .._version import __version__
from ..report import format_size

T = TypeVar("T")


def seconds(action: Callable[[], object]) -> float:
    """Wall-clock seconds one call of `action` takes."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def seconds_each(action: Callable[[T], object], items: Iterable[T]) -> float:
    """Wall-clock seconds `action(item)` takes for every item, one after another."""
    start = time.perf_counter()
    for item in items:
        action(item)
    return time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


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


def smollm2_or_its_shape(random_model: bool = False) -> tuple[Any, str]:
    """SmolLM2-135M-Instruct when installed (and not `random_model`), else a random model of its shape; with
    a description of which."""
    from ..models import load_smollm2, random_llama, smollm2_available

    if not random_model and smollm2_available():
        return load_smollm2()[0], "SmolLM2-135M-Instruct (float32)"
    model = random_llama(layers=30, hidden_size=576, intermediate_size=1536, heads=9, kv_heads=3, vocab_size=49152,
                         max_positions=2048, initializer_range=0.02, pad_token_id=None, tie_embeddings=True)
    return model, "random weights in SmolLM2-135M's shape"


@attrs.frozen
class Spread:
    """A median over repeats, and the least and most of them."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def text(self, digits: int = 2) -> str:
        if len({round(self.low, digits), round(self.high, digits)}) == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"


@attrs.frozen
class Throughputs:
    """Per-repeat throughputs in GB/s, keyed by (block size, what was measured), and where they came from."""

    machine: str
    sizes: tuple[int, ...]
    samples: dict[tuple[int, str], list[float]]

    def gbps(self, size: int, what: str) -> float:
        return median(self.samples[(size, what)])

    @property
    def repeats(self) -> int:
        return len(next(iter(self.samples.values())))

    def to_json(self) -> dict:
        return {"machine": self.machine, "samples": [
            {"block_bytes": size, "what": what, "gbps": values} for (size, what), values in self.samples.items()]}


def plot_operations(path: str, title: str, results: Throughputs, targets: Sequence[str],
                    ceiling_of: Callable[[str, str], str]) -> None:
    """Bars of '<target> flush' and '<target> fetch' per block size, with each one's ceiling as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(1, len(results.sizes), figsize=(6 * len(results.sizes), 4), squeeze=False)
    for axis, size in zip(axes[0], results.sizes, strict=True):
        positions = np.arange(len(targets))
        for offset, operation in ((-0.2, "flush"), (0.2, "fetch")):
            values = [results.gbps(size, f"{t} {operation}") for t in targets]
            ceilings = [results.gbps(size, ceiling_of(t, operation)) for t in targets]
            axis.bar(positions + offset, values, width=0.4, label=operation)
            axis.scatter(positions + offset, ceilings, marker="_", s=400, color="black",
                         label="ceiling" if operation == "flush" else None)
        axis.set_xticks(positions, targets)
        axis.set_ylabel("GB/s")
        axis.set_title(f"{format_size(size)} blocks")
        axis.legend()
    figure.suptitle(f"{title} (medians of {results.repeats}; black ticks: ceilings from the same run)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
