"""Small-tensor round trips between two processes: what one pipeline hop of a decode step costs.

A decode step moves a few kilobytes of activations from stage to stage, so the latency of a small tensor
bounds a pipeline. `run_pingpong` times round trips of 4-64 KiB tensors, two ways, back to back in every
repeat:
    socket    a plain TCP socket to a child that echoes the bytes (the least a round trip can cost)
    <scheme>  `post_tensor` to a child's server, which takes the tensor from its inbox and posts it back
              to ours, as a pipeline stage passes its output on

Run as a child process (`python -m dejavu_sdk.bench.pingpong URL`), this module is that echo: it serves
an inbox of URL's scheme, prints its address, and returns every tensor to URL until an empty one comes.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import attrs
import torch
from tqdm import tqdm

from ..backends import open_transport, serve
from ..report import format_size, markdown_table
from ..transports.base import Server, Transport
from .plain_socket import PlainSocketPeer

#: The transports whose round trips are measured (those a pipeline's links use).
PINGPONG = ("tcp", "gloo", "ucx")
TOKEN = "bench-token"
#: Seconds any one round trip may take before the benchmark gives up on a peer.
TIMEOUT = 60.0


@attrs.frozen
class PingPong:
    """Round-trip seconds per (tensor size, what), one median per repeat: what is a scheme, or
    "<scheme> | socket" for the plain socket measured beside it."""

    sizes: tuple[int, ...]
    schemes: tuple[str, ...]
    rounds: int
    seconds: dict[tuple[int, str], list[float]]

    def ratios(self, size: int, scheme: str) -> list[float]:
        """Per repeat: the transport's round trip over the plain socket's, measured back to back."""
        return [ours / plain for ours, plain in zip(self.seconds[(size, scheme)],
                                                    self.seconds[(size, f"{scheme} | socket")], strict=True)]

    def to_markdown(self) -> str:
        rows = []
        for size in self.sizes:
            for scheme in self.schemes:
                plain = statistics.median(self.seconds[(size, f"{scheme} | socket")])
                ratios = self.ratios(size, scheme)
                rows.append([format_size(size), scheme, f"{statistics.median(self.seconds[(size, scheme)]) * 1e6:.0f}",
                             f"{plain * 1e6:.0f}", f"{statistics.median(ratios):.2f}x",
                             f"{min(ratios):.2f}-{max(ratios):.2f}"])
        return (f"Small-tensor round trips (two processes on 127.0.0.1; median of {self.rounds} round trips per "
                f"repeat, {len(next(iter(self.seconds.values())))} repeats):\n\n" +
                markdown_table(["tensor", "transport", "round trip (µs)", "plain socket (µs)",
                                "transport / socket", "range"], rows))

    def to_json(self) -> dict:
        return {"sizes": list(self.sizes), "rounds": self.rounds,
                "seconds": {f"{size} {what}": values for (size, what), values in self.seconds.items()}}


class _TensorEcho:
    """The echo child, and our inbox it answers to."""

    def __init__(self, scheme: str) -> None:
        self.inbox: Server = serve(f"{scheme}://127.0.0.1:0", token=TOKEN)
        self.process = subprocess.Popen([sys.executable, "-m", __name__, self.inbox.url], stdout=subprocess.PIPE,
                                        text=True, env=_with_token())
        assert self.process.stdout is not None  # a pipe: stdout=PIPE
        self.peer: Transport = open_transport(self.process.stdout.readline().strip(), token=TOKEN, timeout=TIMEOUT)

    def round_trip(self, tensor: torch.Tensor) -> None:
        self.peer.post_tensor(tensor)
        self.inbox.recv_tensor(timeout=TIMEOUT)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.peer.send_tensor(torch.empty(0, dtype=torch.uint8))
        self.process.wait(timeout=30)
        self.peer.close()
        self.inbox.close()


def _with_token() -> dict[str, str]:
    import os

    return {**os.environ, "DEJAVU_TOKEN": TOKEN}


def _median_round_trip(action: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        action()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_pingpong(sizes: list[int], schemes: list[str], repeats: int = 5, rounds: int = 200,
                 progress: bool = True) -> PingPong:
    """Median round trip of each size over each scheme and over a plain socket, back to back per repeat.

    Schemes run one after another, each with only its own echo alive (UCX and gloo keep progress threads
    busy, which would slow the others on a small machine)."""
    seconds: dict[tuple[int, str], list[float]] = defaultdict(list)
    with contextlib.closing(PlainSocketPeer()) as plain, \
            tqdm(total=repeats * len(sizes) * len(schemes), desc="bench ping-pong", unit="step",
                 disable=not progress) as bar:
        for scheme in schemes:
            with contextlib.closing(_TensorEcho(scheme)) as echo:
                for size in sizes:  # warm up, unmeasured
                    warm = torch.zeros(size, dtype=torch.uint8)
                    _median_round_trip(lambda warm=warm: plain.echo(warm.numpy()), 10)
                    _median_round_trip(lambda warm=warm: echo.round_trip(warm), 10)
                for _ in range(repeats):
                    for size in sizes:
                        tensor = torch.randint(0, 256, (size,), dtype=torch.uint8)
                        seconds[(size, f"{scheme} | socket")].append(
                            _median_round_trip(lambda t=tensor: plain.echo(t.numpy()), rounds))
                        seconds[(size, scheme)].append(_median_round_trip(lambda t=tensor: echo.round_trip(t),
                                                                          rounds))
                        bar.update()
    return PingPong(tuple(sizes), tuple(schemes), rounds, dict(seconds))


def _echo(reply_url: str) -> None:
    """The child: return every tensor to `reply_url` until an empty one arrives."""
    scheme = reply_url.partition("://")[0]
    with serve(f"{scheme}://127.0.0.1:0", token=TOKEN) as inbox, \
            open_transport(reply_url, token=TOKEN, timeout=TIMEOUT) as reply:
        print(inbox.url, flush=True)
        while True:
            tensor = inbox.recv_tensor(timeout=600)
            if tensor.numel() == 0:
                return
            reply.post_tensor(tensor)


if __name__ == "__main__":
    _echo(sys.argv[1])
