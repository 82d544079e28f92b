"""What a pipeline picks where its caller picks nothing: torch threads per stage process and rows per slot, from the
machine (cores, memory, accelerators) and the model's KV size; what it picks on 1, 2 and 16 cores, with and
without a GPU, and that a caller's choice stands."""

from __future__ import annotations

import pytest

import dejavu_sdk as dv
from dejavu_sdk.serving import defaults
from dejavu_sdk.serving.defaults import Defaults, Machine, slot_rows, stage_threads
from dejavu_sdk.serving.options import PipelineOptions
from dejavu_sdk.swapping import positions_needed

GIB = 2**30
#: SmolLM2-135M's KV per token in float32 (30 layers, 3 KV heads of 64), and the default workload's positions.
PER_TOKEN = 30 * 2 * 3 * 64 * 4
POSITIONS = positions_needed(256, 64)


@pytest.mark.parametrize(("cores", "memory", "devices", "threads", "most", "rows"), [
    (1, 8, (), 1, 1, 16),  # one core: the stage shares it with the head
    (2, 24, (), 1, 2, 32),  # this machine's kind: a core for the stage, the other too where it is idle
    (16, 64, (), 15, 16, 256),
    (16, 24, (), 15, 16, 219),  # a quarter of 24 GiB holds 219 rows of 319 positions in each of two slots
    (16, 64, (80 * GIB,), 15, 16, 256),  # an accelerator: vLLM's max_num_seqs
    (2, 8, (80 * GIB,), 1, 2, 256),  # the caches live on the accelerator: the host's memory does not bound them
])
def test_one_stage_on_each_kind_of_machine(cores, memory, devices, threads, most, rows) -> None:
    machine = Machine(cores, memory * GIB, devices)
    chosen = Defaults.of(machine, None, None, PER_TOKEN, POSITIONS, 2, 1, None)
    assert (chosen.threads, chosen.most_threads, chosen.rows) == (threads, most, rows)
    assert f"{rows} rows per slot" in chosen.why
    assert f"{cores} core(s)" in chosen.why
    assert (f"{threads} to {most} torch threads" if most > threads else f"{threads} torch thread(s)") in chosen.why


def test_stages_share_the_cores_but_one_and_each_gets_at_least_one_and_at_most_its_share() -> None:
    assert [stage_threads(Machine(16, GIB), stages) for stages in (1, 2, 3, 4, 15, 16, 30)] == [
        (15, 16), (7, 8), (5, 5), (3, 4), (1, 1), (1, 1), (1, 1)]
    assert stage_threads(Machine(2, GIB), 2) == (1, 1)


def test_rows_are_bounded_by_the_memory_the_caches_live_in() -> None:
    row = POSITIONS * PER_TOKEN
    small = Machine(16, int(40 * 2 * row / defaults.MEMORY_SHARE))  # a quarter of it holds 40 rows in each of 2 slots
    rows, why = slot_rows(small, PER_TOKEN, POSITIONS, 2, 1, None)
    assert rows == 40
    assert "host's available memory holds 40 rows" in why
    assert slot_rows(small, PER_TOKEN, POSITIONS, 2, 2, None)[0] == 20  # two stage processes share the host
    assert slot_rows(small, PER_TOKEN, POSITIONS, 2, 1, 10 * 2 * row)[0] == 10  # a KV budget: it, not the memory
    gpu = Machine(2, 1024 * GIB, (int(6 * 4 * row / defaults.MEMORY_SHARE),))
    assert slot_rows(gpu, PER_TOKEN, POSITIONS, 4, 1, None)[0] == 6  # the accelerator's memory, not the host's
    assert slot_rows(Machine(2, 0), PER_TOKEN, POSITIONS, 2, 1, None)[0] == 1  # never none


def test_a_caller_s_threads_and_microbatch_stand(monkeypatch) -> None:
    monkeypatch.setattr(Machine, "here", classmethod(lambda cls: Machine(16, 64 * GIB)))
    given = PipelineOptions.check("tiny_models:llama", 2, microbatch=3, threads=5)
    assert (given.microbatch, given.threads, given.defaults.why.split(",")[0]) == (3, 5, "as given")
    assert given.defaults.most_threads == 5  # as given: they do not follow the machine's load
    chosen = PipelineOptions.check("tiny_models:llama", 2)
    assert (chosen.microbatch, chosen.threads) == (256, 7)  # 16 cores: 15 shared by two stages; 16 rows a core
    assert chosen.defaults.most_threads == 8
    with pytest.raises(dv.ConfigError, match="microbatch"):
        PipelineOptions.check("tiny_models:llama", 1, microbatch=0)


def test_this_machine_is_read_as_it_is() -> None:
    here = Machine.here()
    assert here.cores >= 1
    assert here.memory_bytes > 0
    assert "core(s)" in here.describe()


@pytest.mark.slow
def test_a_stage_s_threads_follow_the_machine_unless_the_caller_chose_them() -> None:
    """The default: the stage process starts with the cores but one and follows the cores the other processes leave
    idle, up to its share (`ThreadShare`); threads= given: exactly those, whatever the machine's load."""
    here = Machine.here()
    with dv.Pipeline("tiny_models:llama", 1) as pipe:
        stats = pipe.stage_stats()["stage 0"]
        assert stats["threads_follow_load"] is (here.cores > 1)  # one core: nothing to follow
        assert 1 <= stats["threads"] <= here.cores
        assert pipe.status()["defaults"]["most_threads"] == here.cores
    with dv.Pipeline("tiny_models:llama", 1, threads=1) as pipe:
        stats = pipe.stage_stats()["stage 0"]
        assert (stats["threads_follow_load"], stats["threads"]) == (False, 1)
