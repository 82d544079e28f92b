"""`dejavu bench transports`: flush and fetch throughput between two processes on loopback, per transport.

Each networked transport talks to a `dejavu serve-store` child holding memory://; the ceiling is a plain
TCP socket to another child that does nothing but move bytes, measured in the same repeat:
    socket send     the child receives every block into one warm buffer, as memory:// reuses its records
    socket send + checksums  the same, with the least checksum work a verified flush needs: we hash each
                    block before sending it, the child hashes it once received
    socket receive  the child sends from a buffer; we receive into a warm one, as fetch(out=) does
`local` (same-process copies into memory://) is measured against memcpy. `tcp+token` is tcp to a
server that checks a token, and `tcp+tls` tcp over TLS with a token: the cost of each beside plain tcp.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import torch
from tqdm import tqdm

from ..backends import TRANSPORTS, open_store, open_transport
from ..blocks import BlockKey
from ..errors import BackendUnavailable, ConfigError
from ..report import format_size, markdown_table
from ..testing.certificates import self_signed_certificate
from ..testing.peers import ServedStoreProcess
from ..transports.base import Transport
from .common import Throughputs, machine_description, plot_operations, seconds_each
from .pingpong import PingPong
from .plain_socket import PlainSocketPeer

NETWORKED = ("tcp", "ucx", "gloo")
#: Variants of tcp: what a server that checks tokens, and one that speaks TLS, cost.
SECURED = ("tcp+token", "tcp+tls")
BENCH_TOKEN = "bench-token"
CEILINGS = ("socket send", "socket send + checksums", "socket receive", "memcpy")
OPERATIONS = ("flush", "fetch")


def ceiling_of(target: str, operation: str) -> str:
    """The ceiling measured beside `target` that bounds its `operation`."""
    if target == "local":
        return f"{target} | memcpy"
    return f"{target} | {'socket send' if operation == 'flush' else 'socket receive'}"


def _ceilings(peer: PlainSocketPeer, block: np.ndarray, count: int) -> Iterator[tuple[str, float]]:
    out = np.zeros_like(block)  # touched: a fetch into `out` finds its pages mapped too
    yield "socket send", seconds_each(lambda _: peer.send(block), range(count))
    yield "socket send + checksums", seconds_each(lambda _: peer.send(block, checksums=True), range(count))
    yield "socket receive", seconds_each(lambda _: peer.receive(out), range(count))
    sources = [block.copy() for _ in range(count)]
    yield "memcpy", seconds_each(lambda source: np.copyto(out, source), sources)


def _transport(transport: Transport, block: torch.Tensor, count: int) -> Iterator[tuple[str, float]]:
    keys = [BlockKey("bench", layers=(0, 1), tokens=(i, i + 1)) for i in range(count)]
    out = torch.zeros_like(block)
    yield "flush", seconds_each(lambda key: transport.flush(key, block), keys)
    yield "fetch", seconds_each(lambda key: transport.fetch(key, out=out), keys)
    if not torch.equal(out, block):
        raise AssertionError(f"{transport.url} returned different bytes")


def available(targets: list[str]) -> tuple[list[str], list[str]]:
    """Split targets into those whose backend loads here and notes on those that do not."""
    usable, notes = [], []
    for target in targets:
        scheme = target.partition("+")[0] if target in SECURED else target
        backend = TRANSPORTS.find(scheme)
        if backend is None:
            raise ConfigError(f"unknown bench target {target!r}; choose from "
                              f"{', '.join((*NETWORKED, *SECURED, 'local'))}")
        try:
            TRANSPORTS.load(scheme, backend, Transport)
            usable.append(target)
        except BackendUnavailable as error:
            notes.append(f"{target}: skipped, {error}")
    return usable, notes


def run_transport_bench(sizes: list[int], targets: list[str], repeats: int = 5, volume: int = 256 << 20,
                        progress: bool = True) -> Throughputs:
    """Measure each target `repeats` times per block size, each beside the ceilings of the same repeat.

    Targets run one after another, each with only its own server alive: UCX and gloo keep progress
    threads busy, which would slow everything else on a small machine. `volume` bytes move per measurement.
    """
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    steps = repeats * len(sizes) * len(targets)
    with tqdm(total=steps, desc="bench transports", unit="step", disable=not progress) as bar, \
            contextlib.closing(PlainSocketPeer()) as peer:
        for target in targets:
            bar.set_description(f"bench transports: {target}")
            with _connected(target) as transport:
                for size in sizes:  # warm up both processes' memory once, unmeasured
                    list(_transport(transport, torch.zeros(size, dtype=torch.uint8), max(2, volume // size)))
                for _ in range(repeats):
                    for size in sizes:
                        count = max(2, volume // size)
                        block = torch.randint(0, 256, (size,), dtype=torch.uint8)
                        measured = [(f"{target} | {ceiling}", elapsed)
                                    for ceiling, elapsed in _ceilings(peer, block.numpy(), count)]
                        measured += [(f"{target} {operation}", elapsed)
                                     for operation, elapsed in _transport(transport, block, count)]
                        for what, elapsed in measured:
                            samples[(size, what)].append(count * size / elapsed / 1e9)
                        bar.update()
    return Throughputs(machine_description(), tuple(sizes), dict(samples))


@contextlib.contextmanager
def _connected(target: str) -> Iterator[Transport]:
    if target == "local":
        with open_transport("local", store=open_store("memory://")) as transport:
            yield transport
        return
    scheme, _, variant = target.partition("+")
    with tempfile.TemporaryDirectory(prefix="dejavu-bench-tls-") as scratch:
        options: list[str] = []
        client: dict[str, Any] = {"token": BENCH_TOKEN} if variant else {}
        if variant == "tls":
            cert, key = self_signed_certificate(scratch)
            options = ["--tls-cert", cert, "--tls-key", key]
            client.update(tls=True, ca=cert)
        with ServedStoreProcess(scheme, quiet=True, options=options, token=BENCH_TOKEN if variant else None) \
                as served, open_transport(served.url, timeout=120, **client) as transport:
            yield transport


def transport_bench_markdown(results: Throughputs, targets: list[str]) -> str:
    ceilings = markdown_table(
        ["block", "measured beside", *CEILINGS],
        [[format_size(size), target, *(f"{results.gbps(size, f'{target} | {c}'):.2f}" for c in CEILINGS)]
         for size in results.sizes for target in targets])

    def ratio(size: int, target: str, operation: str) -> str:
        ceiling = ceiling_of(target, operation)
        share = results.gbps(size, f"{target} {operation}") / results.gbps(size, ceiling)
        return f"{share:.0%} of {ceiling.split(' | ')[1]}"

    def checked_ratio(size: int, target: str) -> str:
        if target == "local":
            return "-"
        ceiling = results.gbps(size, f"{target} | socket send + checksums")
        return f"{results.gbps(size, f'{target} flush') / ceiling:.0%}"

    rows = [[format_size(size), target, f"{results.gbps(size, f'{target} flush'):.2f}",
             f"{results.gbps(size, f'{target} fetch'):.2f}", ratio(size, target, "flush"),
             checked_ratio(size, target), ratio(size, target, "fetch")]
            for size in results.sizes for target in targets]
    table = markdown_table(["block", "transport", "flush GB/s", "fetch GB/s", "flush vs ceiling",
                            "flush vs socket send + checksums", "fetch vs ceiling"], rows)
    return (f"Machine: {results.machine}\nMedians of {results.repeats} repeats.\n\nCeilings (GB/s), measured in "
            f"the same repeats as each transport:\n\n{ceilings}\n\nTransports (two processes on 127.0.0.1):\n\n"
            f"{table}\n{_security_cost(results, targets)}")


def _security_cost(results: Throughputs, targets: list[str]) -> str:
    """Tokens and TLS beside plain tcp: each variant's share of the plain socket, relative to tcp's share."""
    variants = [target for target in targets if target in SECURED]
    if "tcp" not in targets or not variants:
        return ""

    def share(size: int, target: str, operation: str) -> float:
        return results.gbps(size, f"{target} {operation}") / results.gbps(size, ceiling_of(target, operation))

    rows = [[format_size(size), variant,
             *(f"{share(size, variant, operation) / share(size, 'tcp', operation):.0%}" for operation in OPERATIONS)]
            for size in results.sizes for variant in variants]
    table = markdown_table(["block", "variant", "flush, relative to tcp", "fetch, relative to tcp"], rows)
    return (f"\nWhat a token and TLS cost (each variant's share of its plain-socket ceiling, over tcp's share):"
            f"\n\n{table}\n")


@attrs.frozen
class TransportReport:
    """What `dejavu bench transports` measured: block throughputs and small-tensor round trips (either may be
    None when not asked for)."""

    throughputs: Throughputs | None
    pingpong: PingPong | None

    def to_json(self) -> dict[str, Any]:
        return {"throughputs": self.throughputs.to_json() if self.throughputs else None,
                "pingpong": self.pingpong.to_json() if self.pingpong else None}


def plot_transport_bench(results: Throughputs, targets: list[str], path: str) -> None:
    plot_operations(path, "dejavu bench transports", results, targets, ceiling_of)
