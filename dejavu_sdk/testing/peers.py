"""A `dejavu serve-store` child process: a peer that tests and benchmarks can kill, freeze or time."""

from __future__ import annotations

import os
import subprocess
import sys


class ServedStoreProcess:
    """A child process serving `store` at `url` (`scheme://127.0.0.1:<free port>`) until `stop()`."""

    def __init__(self, scheme: str, store: str = "memory://", quiet: bool = False) -> None:
        command = [sys.executable, "-m", "dejavu_sdk.cli", "serve-store", "--listen", f"{scheme}://127.0.0.1:0",
                   "--store", store]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                        stderr=subprocess.DEVNULL if quiet else None)
        line = self.process.stdout.readline()
        if " at " not in line:
            self.stop()
            raise RuntimeError(f"dejavu serve-store did not start (printed {line!r})")
        self.url = line.rsplit(" at ", 1)[1].strip()

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)

    def __enter__(self) -> ServedStoreProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
