"""Launchers: how a pipeline starts the stage workers it needs (at start, and to replace a dead one).

A launcher starts a worker that joins the head at a transport URL with the pipeline's token, and returns a
`WorkerHandle`: the id the launcher gave the worker (which the worker sends when it joins, so that the head
knows which launched worker is which: process ids collide across machines), its process id, whether it still
runs, and a way to stop it. `LocalProcesses` starts workers on this machine (the default: forked from a zygote
that has their imports done, else `python -m dejavu_sdk.serving.processes.bootstrap --join URL --worker-id ID`);
`dejavu_sdk.cluster.ray.RayWorkers` starts Ray actors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Mapping
from typing import Protocol

from ...transports.access import TOKEN_VARIABLE


class WorkerHandle(Protocol):
    """A started worker."""

    id: str  # given by its launcher, unique across machines; the worker sends it in `join` as `worker`
    pid: int

    def alive(self) -> bool:
        """Whether the worker still runs (a hung one counts as running: heartbeats catch those)."""

    def exit_status(self) -> str:
        """How it ended, for messages (call once it is no longer alive)."""

    def kill(self) -> None:
        """End it at once, and wait until it has ended."""

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a worker told to shut down to end; then kill it."""


class Launcher(Protocol):
    """Starts stage workers that join a head. `outlives_head`: whether its workers go on when the head's process
    dies (they then wait for a successor to take their stages back; a head started again waits for them; a
    launcher without the attribute counts as True)."""

    outlives_head: bool

    def start(self, join: str, token: str, environment: Mapping[str, str]) -> WorkerHandle:
        """A worker that joins the head at `join`, presenting `token`, with `environment` added to its own (the
        pipeline's link settings: `link_tls.worker_environment`)."""


class ProcessHandle:
    """A worker process on this machine."""

    def __init__(self, process: subprocess.Popen[bytes], id: str) -> None:
        self.process, self.id = process, id
        self.pid = process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_status(self) -> str:
        return f"status {self.process.returncode}"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self, timeout: float) -> None:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


class JoinedWorker:
    """A worker that joined on its own (started by hand, or by a scheduler): nothing here can see its process,
    so it counts as alive while its heartbeats come, and it cannot be stopped from here. `id`: the one its
    `join` gave (`worker`), or `pid N` for a worker started by hand without one."""

    def __init__(self, pid: int, id: str | None = None) -> None:
        self.pid = pid
        self.id = id if id is not None else f"pid {pid}"

    def alive(self) -> bool:
        return True

    def exit_status(self) -> str:
        return "an unknown status"

    def kill(self) -> None:
        """Nothing to kill from here: its epoch is over, so whatever it sends is dropped."""

    def stop(self, timeout: float) -> None:
        """It was told to shut down; nothing more can be done from here."""


class LocalProcesses:
    """Stage workers as processes of this machine, with this process's environment, each with an id of its own.

    On Linux they are forked from a zygote that has imported torch and transformers once (`zygote.py`): a
    worker then starts without the seconds of CPU its imports take. `fork=False` (or another system)
    starts each as `python -m dejavu_sdk.serving.processes.bootstrap`."""

    outlives_head = True  # forked from the zygote or started by the head, they are not ended with it

    def __init__(self, fork: bool = True) -> None:
        self.fork = fork and sys.platform.startswith("linux")

    def start(self, join: str, token: str, environment: Mapping[str, str]) -> WorkerHandle:
        environment = {**os.environ, TOKEN_VARIABLE: token, **environment}
        worker_id = uuid.uuid4().hex
        if self.fork:
            from .zygote import (
                fork_worker,  # not at import: `python -m dejavu_sdk.serving.processes.zygote` runs it as main
            )

            return fork_worker(worker_id, join, environment)
        command = [sys.executable, "-m", "dejavu_sdk.serving.processes.bootstrap", "--join", join,
                   "--worker-id", worker_id]
        return ProcessHandle(subprocess.Popen(command, env=environment), worker_id)
