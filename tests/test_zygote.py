"""Stage workers forked from the zygote: each runs with the head's environment of the moment, serves as a worker
started from the command line does, and the head learns how each ended."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.serving.processes.zygote import ForkedWorker

pytestmark = pytest.mark.slow


def test_forked_workers_serve_and_report_how_they_ended(workers_import_tiny_models) -> None:
    with dv.Pipeline("tiny_models:llama", stages=2, timeout=60, recovery=None) as pipe:
        handles = list(pipe.fleet.processes)
        assert all(isinstance(handle, ForkedWorker) for handle in handles)
        assert {handle.pid for handle in handles}.isdisjoint({os.getpid(), handles[0].zygote.process.pid})
        assert len(pipe.generate([torch.tensor([5, 6, 7])], 4)[0]) == 4  # tiny_models came from PYTHONPATH
        os.kill(handles[1].pid, signal.SIGKILL)  # as a crash would
        assert handles[0].zygote.wait(handles[1].id, handles[1].pid, 10)
        assert not handles[1].alive()
        assert handles[1].exit_status() == "signal 9"
        assert handles[0].alive()
    assert not handles[0].alive()  # closing stopped it
    assert handles[0].exit_status() in ("status 0", "status 2", "signal 9")


def test_without_fork_workers_are_started_from_the_command_line(workers_import_tiny_models) -> None:
    from dejavu_sdk.serving.processes.launchers import LocalProcesses, ProcessHandle

    with dv.Pipeline("tiny_models:llama", stages=1, timeout=60, launch=LocalProcesses(fork=False)) as pipe:
        assert isinstance(pipe.fleet.processes[0], ProcessHandle)
        assert len(pipe.generate([torch.tensor([5, 6, 7])], 3)[0]) == 3


def test_a_zygote_started_ahead_is_the_one_that_forks_the_workers(workers_import_tiny_models) -> None:
    from dejavu_sdk.serving.processes import zygote

    zygote.prestart()  # as `dejavu serve` does first thing
    ahead = zygote._zygote
    assert ahead is not None
    assert ahead.alive()
    with dv.Pipeline("tiny_models:llama", stages=1, timeout=60) as pipe:
        (handle,) = pipe.fleet.processes
        assert isinstance(handle, ForkedWorker)
        assert handle.zygote is ahead
