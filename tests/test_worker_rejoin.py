"""The head's side of workers that outlive their controller: a worker of a former head (a heartbeat from an inbox
the head never gave its stage) is told to exit, and one asking to rejoin a stage it cannot have (another worker
serves it, or it holds other layers) is told to stop. The whole way (a controller killed, its worker rejoining
the successor; one stopped past the orphan timeout) is tests/test_controller_chaos.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.serving import Pipeline
from dejavu_sdk.serving.wire.messages import AskRejoin, Fenced, Heartbeat, Rejoin, Shutdown, pack, unpack

TOKEN = "rejoin-token"
pytestmark = pytest.mark.usefixtures("workers_import_tiny_models")


def _next_kind(inbox, timeout: float = 30) -> type:
    return type(unpack(inbox.recv_tensor(timeout=timeout)))


def _rejoin(url: str, stage: str, layers: list[int], model: str = "tiny_models:llama") -> Rejoin:
    return Rejoin(url=url, pid=1, worker="former", stage=stage, layers=layers, model=model, epoch=3)


def test_a_former_heads_worker_is_fenced_and_late_rejoins_are_turned_away() -> None:
    with Pipeline("tiny_models:llama", token=TOKEN) as pipe, \
            dv.serve("tcp://127.0.0.1:0", token=TOKEN) as former, dv.open_transport(pipe.url, token=TOKEN) as head:
        head.send_tensor(pack(Heartbeat(stage="stage 0", epoch=0, url=former.url)))
        assert _next_kind(former) is Fenced  # same stage name and epoch, but not the inbox the head assigned
        head.send_tensor(pack(_rejoin(former.url, "stage 0", list(pipe.stage_table[0].layers))))
        assert _next_kind(former) is Shutdown  # the stage has its worker
        ids = torch.tensor([[5, 6, 7]])
        assert len(pipe.generate(ids, max_new_tokens=4)[0]) == 4  # the real worker still serves


def test_a_rejoin_for_other_layers_is_turned_away_and_the_stage_gets_a_new_worker() -> None:
    pipe = Pipeline("tiny_models:llama", token=TOKEN)
    try:
        pipe.listen()
        with dv.serve("tcp://127.0.0.1:0", token=TOKEN) as former, dv.open_transport(pipe.url, token=TOKEN) as head:
            head.send_tensor(pack(_rejoin(former.url, "stage 0", [0, 1])))  # a layout this pipeline does not have
            pipe.start(rejoin_wait=1.0)
            assert _next_kind(former) is Shutdown
        assert pipe.fleet.rejoined == []
        assert len(pipe.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)[0]) == 2
    finally:
        pipe.close()


@pytest.mark.slow
def test_a_worker_whose_head_is_gone_stops_after_its_own_orphan_timeout() -> None:
    """`dejavu worker --orphan-timeout 1` overrides the head's 60 s: once the head's address refuses, it asks to
    rejoin for a second and exits cleanly."""
    pipe = Pipeline("tiny_models:llama", token=TOKEN, launch=False, heartbeat=0.5)
    worker = None
    try:
        url = pipe.listen()
        environment = {**os.environ, "DEJAVU_TOKEN": TOKEN}
        worker = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "worker", "--join", url,
                                   "--orphan-timeout", "1"], env=environment)
        pipe.start()
        assert pipe.options.watch.orphan_timeout == 60
        assert len(pipe.generate([[5, 6, 7]], max_new_tokens=2)[0]) == 2
        pipe.head.inbox.close()  # the head's address refuses, as a dead head's does (no shutdown is sent)
        gone = time.monotonic()
        assert worker.wait(timeout=30) == 0
        assert 1 < time.monotonic() - gone < 15  # missed heartbeats (0.5 s x 3), then the orphan's second
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        pipe.close()


def test_a_heartbeat_counts_a_busy_head_as_there_and_a_silent_one_as_gone() -> None:
    from dejavu_sdk.serving.processes.bootstrap import Heartbeat

    head = dv.serve("tcp://127.0.0.1:0", token=TOKEN, inbox_size=1)
    os.environ["DEJAVU_TOKEN"] = TOKEN  # the heartbeat's link presents the worker's token, from its environment
    try:
        with dv.open_transport(head.url, token=TOKEN) as other:
            other.send_tensor(torch.zeros(1))  # the inbox is full from now on: every heartbeat is refused as busy
        beat = Heartbeat(head.url, "stage 0", interval=0.05, timeout=0.3)
        time.sleep(1.0)
        assert beat.error is None  # refused as busy for a second: the head is there
        head.close()
        deadline = time.monotonic() + 10
        while beat.error is None:
            assert time.monotonic() < deadline, "a closed head was not noticed"
            time.sleep(0.05)
        beat.close()
    finally:
        os.environ.pop("DEJAVU_TOKEN", None)
        head.close()


def test_a_former_heads_worker_that_beats_at_a_starting_head_is_asked_to_rejoin() -> None:
    """A worker with a long heartbeat may find the successor before it notices its head died (its link reconnects
    by itself): the starting head asks it to rejoin, once."""
    pipe = Pipeline("tiny_models:llama", token=TOKEN)
    try:
        pipe.listen()
        with dv.serve("tcp://127.0.0.1:0", token=TOKEN) as former, dv.open_transport(pipe.url, token=TOKEN) as head:
            for _ in range(2):
                head.send_tensor(pack(Heartbeat(stage="stage 0", epoch=4, url=former.url)))
            pipe.start(rejoin_wait=1.0)
            assert _next_kind(former) is AskRejoin
            with pytest.raises(dv.TransportError):
                former.recv_tensor(timeout=0.5)  # asked once
        assert len(pipe.generate([[5, 6, 7]], max_new_tokens=2)[0]) == 2
    finally:
        pipe.close()


def test_a_rejoined_worker_gone_before_its_assignment_is_replaced(caplog) -> None:
    pipe = Pipeline("tiny_models:llama", token=TOKEN)
    try:
        pipe.listen()
        with dv.serve("tcp://127.0.0.1:0", token=TOKEN) as former, dv.open_transport(pipe.url, token=TOKEN) as head:
            layers = list(pipe.stage_table[0].layers)  # the stage's own: the rejoin is taken
            head.send_tensor(pack(_rejoin(former.url, "stage 0", layers)))  # then it goes, before it is assigned
        pipe.start(rejoin_wait=1.0)
        assert "the former stage 0 worker that rejoined is gone" in caplog.text  # taken, then found gone
        assert pipe.fleet.rejoined == []
        assert len(pipe.generate([[5, 6, 7]], max_new_tokens=2)[0]) == 2
    finally:
        pipe.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_a_worker_rejoining_a_head_that_takes_nothing_over_drops_what_it_held() -> None:
    """A worker orphaned while a microbatch decodes rejoins a new head at the same address that does not take it
    over (`start` without `hold`): it drops that microbatch, and the new head's own microbatches, numbered from 0
    again, run on it."""
    port, environment = _free_port(), {**os.environ, "DEJAVU_TOKEN": TOKEN}
    first = Pipeline("tiny_models:llama", token=TOKEN, launch=False, heartbeat=0.5, port=port, batching="static")
    second = Pipeline("tiny_models:llama", token=TOKEN, launch=False, port=port, batching="static")
    worker = None
    try:
        url = first.listen()
        worker = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "worker", "--join", url], env=environment)
        first.start()
        arrived: list[int] = []
        first.submit([5, 6, 7], max_new_tokens=2000, ignore_eos=True, on_token=arrived.append)
        deadline = time.monotonic() + 60
        while len(arrived) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first.head.inbox.close()  # the head is gone (no shutdown sent), microbatch 0 in the worker's cache
        second.start(rejoin_wait=15.0)
        assert second.fleet.rejoined == ["stage 0"]
        outs = second.generate([[5, 6, 7], [8, 9]], max_new_tokens=4)
        assert [len(out) for out in outs] == [4, 4]
    finally:
        second.close()
        first.close()
        if worker is not None and worker.poll() is None:
            worker.kill()
