"""A `dejavu serve-store` child process: a peer that tests and benchmarks can kill, freeze or time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from ..transports.access import TOKEN_VARIABLE


class ServedStoreProcess:
    """A child process serving `store` at `url` (`scheme://127.0.0.1:<free port>`) until `stop()`."""

    def __init__(self, scheme: str, store: str = "memory://", quiet: bool = False, *,
                 options: Sequence[str] = (), token: str | None = None) -> None:
        """`options`: more `serve-store` arguments (`--tls-cert`, ...); `token`: the one token peers need."""
        command = [sys.executable, "-m", "dejavu_sdk.cli", "serve-store", "--listen", f"{scheme}://127.0.0.1:0",
                   "--store", store, *options]
        environment = {key: value for key, value in os.environ.items() if key != TOKEN_VARIABLE}
        if token is not None:
            environment[TOKEN_VARIABLE] = token
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment,
                                        stderr=subprocess.DEVNULL if quiet else None)
        assert self.process.stdout is not None  # stdout=PIPE above
        line = self.process.stdout.readline()
        if " at " not in line:
            self.stop()
            raise RuntimeError(f"dejavu serve-store did not start (printed {line!r})")
        self.url = line.rsplit(" at ", 1)[1].strip()

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def freeze(self, timeout: float = 10.0) -> None:
        """Stop the process (SIGSTOP) and return once it is stopped: a peer that hangs, sockets still open."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while self._state() not in ("T", "t"):  # the signal is delivered asynchronously
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url} did not stop within {timeout} s")
            time.sleep(0.005)

    def thaw(self) -> None:
        """Let a frozen process run again (SIGCONT)."""
        self.signal(signal.SIGCONT)

    def _state(self) -> str:
        """The process's scheduler state letter from /proc (T: stopped), or "" where /proc is not there."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as stat:
                return stat.read().rpartition(")")[2].split()[0]
        except OSError:
            return "T"  # no /proc: trust that SIGSTOP took effect

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)

    def __enter__(self) -> ServedStoreProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
