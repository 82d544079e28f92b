"""Stage workers forked from a process that has imported them already, so that a worker starts without the
seconds its imports take.

A worker's process spends seconds of CPU importing torch and transformers before it can join (`python -X importtime`
shows where). The zygote (`python -m dejavu_sdk.serving.processes.zygote`, one per head process, started on the first
launch, or first thing by `dejavu serve`: `prestart`) imports them once (and what every model's modeling code imports),
then forks a worker for each request: the child takes the head's environment and working directory of the moment,
and runs `bootstrap.main` as `python -m dejavu_sdk.serving.processes.bootstrap` would. The zygote runs no torch
operation and starts no thread of its own (numpy's and scipy's BLAS may hold idle pools, which are fork-aware), so
forking it is safe: the CUDA runtime and torch's thread pools start in the child. Settings read at import
(`OMP_NUM_THREADS`, Hugging Face's cache paths) keep the values the zygote started with: the worker sets its threads
itself. It reaps its children and tells the head how each ended; it exits when the head's end of its pipe closes (the
head is gone), leaving its workers to find their head gone as they would.

Head and zygote speak one JSON object per line over two pipes: the head asks `{"id", "join", "environment",
"cwd"}` (a new worker) or `{"kill": id}`; the zygote answers `{"started": id, "pid"}` (or `{"failed": id,
"error"}`) and, later, `{"exited": id, "status"}`. Kills go through the zygote, the workers' parent: it signals
only a child it has not reaped, so a pid the system gave to another process is never killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from ...errors import TransportError

#: Seconds the head waits for the zygote to import the workers' modules and fork the first one.
START_TIMEOUT = 120.0
#: Seconds `kill` waits for the zygote to report a killed worker's end.
KILL_TIMEOUT = 10.0


class ForkedWorker:
    """A worker forked by the zygote: not this process's child, so its end is what the zygote reports."""

    def __init__(self, zygote: Zygote, id: str, pid: int) -> None:
        self.zygote, self.id, self.pid = zygote, id, pid

    def alive(self) -> bool:
        if self.zygote.status(self.id) is not None:
            return False
        return self.zygote.alive() or _running(self.pid)  # a zygote gone cannot tell: ask the system

    def exit_status(self) -> str:
        status = self.zygote.status(self.id)
        return "an unknown status (its zygote is gone)" if status is None else _described(status)

    def kill(self) -> None:
        self.zygote.kill(self.id, self.pid)
        self.zygote.wait(self.id, self.pid, KILL_TIMEOUT)

    def stop(self, timeout: float) -> None:
        if not self.zygote.wait(self.id, self.pid, timeout):
            self.kill()


class Zygote:
    """The head's side: starts the zygote, asks it for workers, and keeps how each ended."""

    def __init__(self) -> None:
        requests_read, self._requests = os.pipe()
        replies, replies_write = os.pipe()
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.serving.processes.zygote",
                                             str(requests_read), str(replies_write)],
                                            pass_fds=(requests_read, replies_write))
        finally:
            os.close(requests_read)
            os.close(replies_write)
        self._replies = os.fdopen(replies, "r")
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._started: dict[str, int | str] = {}  # a worker's pid, or why it could not be forked
        self._ended: dict[str, int] = {}  # by worker id: its wait status
        self._gone = False
        threading.Thread(target=self._read, name="dejavu-zygote-replies", daemon=True).start()

    def alive(self) -> bool:
        return not self._gone

    def fork(self, id: str, join: str, environment: dict[str, str]) -> ForkedWorker:
        """A worker joining `join`, with `environment`; TransportError if the zygote cannot fork one."""
        with self._lock:
            self._ask({"id": id, "join": join, "environment": environment, "cwd": os.getcwd()})
            with self._changed:
                if not self._changed.wait_for(lambda: id in self._started or self._gone, START_TIMEOUT):
                    self._ask({"kill": id})  # should it fork it after all
                    raise TransportError(f"the worker zygote did not fork a worker within {START_TIMEOUT:.0f} s")
                if id not in self._started:
                    raise TransportError("the worker zygote exited")
                pid = self._started.pop(id)
        if isinstance(pid, str):
            raise TransportError(f"the worker zygote could not fork a worker: {pid}")
        return ForkedWorker(self, id, pid)

    def kill(self, id: str, pid: int) -> None:
        """Kill worker `id` (the zygote does, if it has not ended); with the zygote gone, by its `pid`."""
        if self.alive():
            with contextlib.suppress(TransportError):
                self._ask({"kill": id})
                return
        if self.status(id) is None and _running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def status(self, id: str) -> int | None:
        """How worker `id` ended (a wait status), or None while it runs (or nobody can tell)."""
        with self._changed:
            return self._ended.get(id)

    def wait(self, id: str, pid: int, timeout: float) -> bool:
        """Wait up to `timeout` seconds for worker `id` to end; whether it did."""
        deadline = time.monotonic() + timeout
        with self._changed:
            if self._changed.wait_for(lambda: id in self._ended or self._gone, timeout) and id in self._ended:
                return True
        while _running(pid):  # the zygote is gone: watch the process itself
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _ask(self, request: dict[str, Any]) -> None:
        data = (json.dumps(request) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._requests, data):]
        except OSError as error:
            raise TransportError(f"the worker zygote is gone: {error}") from None

    def _read(self) -> None:
        try:
            for line in self._replies:
                reply = json.loads(line)
                with self._changed:
                    if "started" in reply:
                        self._started[reply["started"]] = reply["pid"]
                    elif "failed" in reply:
                        self._started[reply["failed"]] = str(reply["error"])
                    else:
                        self._ended[reply["exited"]] = reply["status"]
                    self._changed.notify_all()
        except (OSError, ValueError):  # a broken reply: the zygote is of no more use
            pass
        finally:
            with self._changed:
                self._gone = True
                self._changed.notify_all()
            with contextlib.suppress(OSError):
                os.close(self._requests)  # it exits, if it still runs
            self.process.wait()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def fork_worker(id: str, join: str, environment: dict[str, str]) -> ForkedWorker:
    """A worker forked by this process's zygote (started on first use, and again if it died)."""
    return _started().fork(id, join, environment)


def prestart() -> None:
    """Start this process's zygote now, where it will fork workers (Linux): its seconds of imports then run while
    the head loads its own model and waits for rejoining workers, instead of after. A process that never forks a
    worker keeps an idle zygote until it exits."""
    if sys.platform.startswith("linux"):
        _started()


def _started() -> Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():
            _zygote = Zygote()
        return _zygote


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _described(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"status {os.waitstatus_to_exitcode(status)}"


# ---- the zygote's side ---------------------------------------------------------------------------------
def serve(requests: int, replies: int) -> None:
    """Fork a worker for each request on `requests` until it closes; report starts and ends on `replies`."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, or a stop of every process of the service, is the
        signal.signal(signum, signal.SIG_IGN)        # head's to handle: it ends when the head closes its pipe
    # (set first: a Ctrl-C while the imports below run must not end it either)
    # the imports every worker needs, and those every model's modeling code makes (seconds of CPU), once
    import transformers.activations
    import transformers.generation
    import transformers.integrations
    import transformers.modeling_layers
    import transformers.modeling_outputs
    import transformers.modeling_rope_utils
    import transformers.modeling_utils
    import transformers.processing_utils  # noqa: F401

    from . import bootstrap  # noqa: F401

    children: dict[int, str] = {}  # pid -> worker id, until reaped
    pending = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.2)
        _reap(replies, children)
        if not readable:
            continue
        chunk = os.read(requests, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "kill" in request:
                for pid in [pid for pid, id in children.items() if id == request["kill"]]:
                    os.kill(pid, signal.SIGKILL)  # not reaped yet: this pid is still that worker's
                continue
            try:
                pid = os.fork()
            except OSError as error:
                _reply(replies, {"failed": request["id"], "error": str(error)})
                continue
            if pid == 0:
                _run_child(request, (requests, replies))
            children[pid] = request["id"]
            _reply(replies, {"started": request["id"], "pid": pid})


def _reap(replies: int, children: dict[int, str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(replies, {"exited": children.pop(pid, str(pid)), "status": status})


def _reply(replies: int, reply: dict[str, Any]) -> None:
    data = (json.dumps(reply) + "\n").encode()
    while data:
        data = data[os.write(replies, data):]


def _run_child(request: dict[str, Any], pipes: Sequence[int]) -> None:
    """In the forked child: become a worker as `python -m dejavu_sdk.serving.processes.bootstrap` would, with the head's
    environment and working directory, then exit with its status."""
    status = 1
    try:
        for fd in pipes:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["environment"])
        os.chdir(request["cwd"])
        paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
        sys.path[:0] = [os.path.abspath(path) for path in paths if os.path.abspath(path) not in sys.path]
        from .bootstrap import main

        status = main(["--join", request["join"], "--worker-id", request["id"]])
    except BaseException:  # whatever happens, the child exits here, never returns to the loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
