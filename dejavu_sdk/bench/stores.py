"""`dejavu bench stores`: flush and fetch throughput of each store beside ceilings measured in the same run.

Ceilings: memcpy (for memory://), the XXH3 checksum every block carries, and a plain file written
sequentially (with and without fsync) and read back (for lmdb:// and file://). Every repeat measures every
ceiling and every store in turn, so slow phases of a shared machine hit them alike; figures are medians.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator

import attrs
import numpy as np
import torch
import xxhash
from tqdm import tqdm

from ..backends import open_store
from ..blocks import BlockKey
from ..errors import ConfigError
from ..report import format_size, markdown_table
from ..store import Store
from .common import Throughputs, machine_description, plot_operations, seconds, seconds_each

CEILINGS = ("memcpy", "xxh3 checksum", "file write", "file write+fsync", "file read")


@attrs.frozen
class Target:
    """A store to measure and the ceilings its flush and fetch are compared with."""

    name: str
    open: Callable[[str], Store]
    flush_ceiling: str
    fetch_ceiling: str


TARGETS = {
    "memory": Target("memory", lambda _dir: open_store("memory://"), "memcpy", "memcpy"),
    "lmdb": Target("lmdb", lambda d: open_store(f"lmdb://{d}", sync=True, map_size=1 << 34),
                   "file write+fsync", "file read"),
    "lmdb-nosync": Target("lmdb-nosync", lambda d: open_store(f"lmdb://{d}", sync=False, map_size=1 << 34),
                          "file write+fsync", "file read"),
    "file": Target("file", lambda d: open_store(f"file://{d}"), "file write", "file read"),
}


def store_bench_markdown(results: Throughputs, targets: tuple[str, ...]) -> str:
    """The ceilings table and the stores table, each store beside the ceilings that bound it."""
    def ratio(size: int, target: str, operation: str) -> str:
        ceiling = getattr(TARGETS[target], f"{operation}_ceiling")
        return f"{results.gbps(size, f'{target} {operation}') / results.gbps(size, ceiling):.0%} of {ceiling}"

    ceilings = markdown_table(
        ["block", *CEILINGS],
        [[format_size(s), *(f"{results.gbps(s, c):.2f}" for c in CEILINGS)] for s in results.sizes],
    )
    stores = markdown_table(
        ["block", "store", "flush GB/s", "fetch GB/s", "flush vs ceiling", "fetch vs ceiling"],
        [[format_size(size), target, f"{results.gbps(size, f'{target} flush'):.2f}",
          f"{results.gbps(size, f'{target} fetch'):.2f}", ratio(size, target, "flush"), ratio(size, target, "fetch")]
         for size in results.sizes for target in targets],
    )
    return (f"Machine: {results.machine}\nMedians of {results.repeats} repeats.\n\nCeilings (GB/s):\n\n"
            f"{ceilings}\n\nStores:\n\n{stores}\n")


def _ceilings(size: int, count: int, source: np.ndarray, directory: str) -> Iterator[tuple[str, float]]:
    """Yield (ceiling, seconds) for each ceiling, moving `count` blocks of `size` bytes."""
    # Distinct sources, like the records of a store, so small blocks are not copied from a warm cache.
    sources = [source.copy() for _ in range(count)]
    destination = np.empty_like(source)
    np.copyto(destination, source)  # touch the pages first
    yield "memcpy", seconds_each(lambda each: np.copyto(destination, each), sources)
    yield "xxh3 checksum", seconds_each(lambda each: xxhash.xxh3_64_intdigest(each.data), sources)
    sources.clear()  # free them before the file ceilings
    paths = [os.path.join(directory, f"plain-{i}") for i in range(count)]

    def write(sync: bool) -> None:
        for path in paths:
            with open(path, "wb") as file:
                file.write(source.data)
                if sync:
                    file.flush()
                    os.fsync(file.fileno())

    def read() -> None:
        for path in paths:
            with open(path, "rb") as file:
                file.readinto(destination.data)

    yield "file write", seconds(lambda: write(sync=False))
    yield "file write+fsync", seconds(lambda: write(sync=True))
    yield "file read", seconds(read)
    for path in paths:
        os.remove(path)


def _store(target: Target, count: int, block: torch.Tensor, directory: str) -> Iterator[tuple[str, float]]:
    """Yield (flush or fetch, seconds) for `count` blocks through a fresh store of `target`."""
    keys = [BlockKey("bench", layers=(0, 1), tokens=(i, i + 1)) for i in range(count)]
    out = torch.empty_like(block)
    out.zero_()
    store_dir = os.path.join(directory, target.name)
    with target.open(store_dir) as store:
        yield "flush", seconds_each(lambda key: store.flush(key, block), keys)
        yield "fetch", seconds_each(lambda key: store.fetch(key, out=out), keys)
        if not torch.equal(out.view(torch.uint8), block.view(torch.uint8)):
            raise AssertionError(f"{target.name} returned different bytes")
    shutil.rmtree(store_dir, ignore_errors=True)


def run_store_bench(sizes: list[int], targets: list[str], repeats: int = 5, volume: int = 128 << 20,
                    directory: str | None = None, progress: bool = True) -> Throughputs:
    """Measure every target and ceiling `repeats` times for each block size; `volume` bytes per measurement."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ConfigError(f"unknown bench target(s) {unknown}; choose from {sorted(TARGETS)}")
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    steps = repeats * len(sizes) * (len(CEILINGS) + 2 * len(targets))
    with tempfile.TemporaryDirectory(dir=directory, prefix="dejavu-bench-") as scratch, \
            tqdm(total=steps, desc="bench stores", unit="step", disable=not progress) as bar:
        for repeat in range(repeats):
            for size in sizes:
                count = max(2, volume // size)
                block = torch.randint(0, 256, (size,), dtype=torch.uint8).view(torch.float16)
                measured = [*_ceilings(size, count, block.view(torch.uint8).numpy(), scratch)]
                bar.update(len(CEILINGS))
                for name in targets:
                    for operation, elapsed in _store(TARGETS[name], count, block, scratch):
                        measured.append((f"{name} {operation}", elapsed))
                        bar.update()
                for what, elapsed in measured:
                    samples[(size, what)].append(count * size / elapsed / 1e9)
                bar.set_postfix(repeat=f"{repeat + 1}/{repeats}")
    return Throughputs(machine_description(), tuple(sizes), dict(samples))


def plot_store_bench(results: Throughputs, targets: tuple[str, ...], path: str) -> None:
    plot_operations(path, "dejavu bench stores", results, targets,
                    lambda target, operation: getattr(TARGETS[target], f"{operation}_ceiling"))
