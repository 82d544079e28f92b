"""A stage worker's torch threads follow the cores the machine's other processes leave idle (`ThreadShare`)."""

from __future__ import annotations

import pytest
import torch

from dejavu_sdk.serving.worker.thread_share import INTERVAL, ThreadShare, machine_cpu_seconds, own_cpu_seconds


class FakeMachine:
    """CPU seconds of a machine of `cores` cores, where this process and the others each use some cores."""

    def __init__(self, cores: int) -> None:
        self.cores, self.now, self.machine, self.own = cores, 0.0, 0.0, 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.machine += (own_cores + other_cores) * seconds

    def share(self, most: int) -> ThreadShare:
        return ThreadShare(most, machine=lambda: (self.machine, self.cores), own=lambda: self.own,
                           clock=lambda: self.now)


@pytest.fixture(autouse=True)
def _threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_take_the_cores_the_others_leave_and_give_one_back_when_another_process_wants_it() -> None:
    machine = FakeMachine(cores=2)
    share = machine.share(most=2)
    torch.set_num_threads(1)
    machine.run(INTERVAL, own_cores=1.0, other_cores=0.2)  # the head's bursts: a core stays idle
    assert share.adjust() == 2 == torch.get_num_threads()
    for _ in range(3):  # another process spins on a core
        machine.run(INTERVAL, own_cores=1.0, other_cores=1.2)
        share.adjust()
    assert torch.get_num_threads() == 1
    for _ in range(3):  # it stopped
        machine.run(INTERVAL, own_cores=2.0, other_cores=0.1)
        share.adjust()
    assert torch.get_num_threads() == 2


def test_threads_stay_between_one_and_the_stage_s_share_and_change_once_an_interval() -> None:
    machine = FakeMachine(cores=16)
    share = machine.share(most=7)  # two stages on 16 cores: 7 each
    torch.set_num_threads(3)
    machine.run(INTERVAL / 2, own_cores=3.0, other_cores=0.0)
    assert share.adjust() == 3  # not an interval yet: as they were
    machine.run(INTERVAL, own_cores=3.0, other_cores=0.0)
    assert share.adjust() == 7  # an idle machine: its share, no more
    for _ in range(4):
        machine.run(INTERVAL, own_cores=7.0, other_cores=16.0)  # everything else busy
        share.adjust()
    assert torch.get_num_threads() == 1


def test_the_machine_s_readings_are_this_machine_s() -> None:
    reading = machine_cpu_seconds()
    assert reading is not None  # Linux: /proc/stat
    seconds, cores = reading
    assert seconds > 0
    assert cores >= 1
    assert own_cpu_seconds() > 0
