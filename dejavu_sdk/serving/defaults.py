"""What a pipeline chooses where its caller chose nothing: each stage process's torch threads and the rows a slot
holds (its microbatch), from this machine (`Machine`: cores, memory, accelerators) and the model's KV size.

Why these rules (docs/benchmarks.md, "Against `transformers serve`", `--busy`): a stage process that runs as
many torch threads as there are cores slows down several times over as soon as another process wants a core
(its threads wait on each other at every operator), while on an idle machine every core shortens a prefill: so
each stage process starts with the cores but one (the head's and the front door's) and follows the cores the
other processes leave idle, up to its share (`worker.thread_share`); and a larger batch amortises each step's
read of the weights. So a slot holds as many rows as vLLM's `max_num_seqs` lets a batch hold (256), fewer on a
CPU (ROWS_PER_CORE a core), and never more than the memory the caches live in holds at the workload's length.
"""

from __future__ import annotations

import os

import attrs
import torch

#: The most rows a slot holds on an accelerator (vLLM's default `max_num_seqs`).
MAX_ROWS = 256
#: Rows a slot holds per core on a CPU: a step's time grows with its rows there, and tokens/s stops growing.
ROWS_PER_CORE = 16
#: The share of the memory the caches live in (an accelerator's, or the host's) that the default slots may fill,
#: where no KV budget was given: the weights, activations and other processes keep the rest.
MEMORY_SHARE = 0.25


@attrs.frozen
class Machine:
    """What the defaults are chosen from: this machine's `cores` (those this process may run on), its host memory
    available (`memory_bytes`), and each accelerator's free memory (`devices`; none: a CPU machine)."""

    cores: int
    memory_bytes: int
    devices: tuple[int, ...] = ()

    @classmethod
    def here(cls) -> Machine:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        memory = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        devices = tuple(torch.cuda.mem_get_info(index)[0] for index in range(torch.cuda.device_count())) \
            if torch.cuda.is_available() else ()
        return cls(max(1, cores), memory, devices)

    def describe(self) -> str:
        accelerators = f", {len(self.devices)} accelerator(s)" if self.devices else ", no accelerator"
        return f"{self.cores} core(s), {self.memory_bytes / 2**30:.1f} GiB available{accelerators}"


def stage_threads(machine: Machine, stage_processes: int) -> tuple[int, int]:
    """Torch threads for each of `stage_processes` stage processes on `machine`: to start with, its cores but one
    (the head's and the front door's) shared between them, at least one each; at most, its share of every core.
    Between the two, each stage runs on the cores the machine's other processes leave idle
    (`worker.thread_share`), so that together they never ask for a core another process is using."""
    return max(1, (machine.cores - 1) // stage_processes), max(1, machine.cores // stage_processes)


def slot_rows(machine: Machine, kv_bytes_per_token: int, positions: int, slots: int, stage_processes: int,
              kv_budget: int | None) -> tuple[int, str]:
    """The rows each slot holds, and why: at most MAX_ROWS (on a CPU, ROWS_PER_CORE a core), and no more than
    `slots` slots of rows `positions` long (`kv_bytes_per_token` each, on the widest stage) fit in each stage's
    `kv_budget`, or, without one, in MEMORY_SHARE of the memory the caches live in (an accelerator's; on a CPU, the
    host's, shared by the `stage_processes`)."""
    cap = MAX_ROWS if machine.devices else min(MAX_ROWS, ROWS_PER_CORE * machine.cores)
    if kv_budget is not None:
        memory, where = kv_budget, "the KV budget"
    elif machine.devices:
        memory, where = int(min(machine.devices) * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of an accelerator's memory"
    else:
        memory, where = int(machine.memory_bytes * MEMORY_SHARE) // stage_processes, \
            f"{MEMORY_SHARE:.0%} of the host's available memory"
    fit = memory // max(1, slots * positions * kv_bytes_per_token)
    rows = max(1, min(cap, fit))
    bound = f"{where} holds {fit} rows of {positions} positions in each of {slots} slots" if fit < cap else \
        f"at most {cap} rows" + ("" if machine.devices else f" ({ROWS_PER_CORE} a core)")
    return rows, bound


@attrs.frozen
class Defaults:
    """A pipeline's torch threads per stage process (`threads` to start with, up to `most_threads` where the
    others leave cores idle; the same where the caller chose) and rows per slot, each the caller's or chosen here
    (`why` says which, and from what machine)."""

    threads: int
    rows: int
    why: str
    most_threads: int

    @classmethod
    def of(cls, machine: Machine, threads: int | None, rows: int | None, kv_bytes_per_token: int, positions: int,
           slots: int, stage_processes: int, kv_budget: int | None) -> Defaults:
        """`threads` and `rows` as given, each that is None chosen for `stage_processes` stage processes holding
        `slots` slots of rows `positions` long (`slot_rows`)."""
        reasons = []
        if threads is None:
            threads, most = stage_threads(machine, stage_processes)
            counts = f"{threads} torch thread(s)" if most == threads else f"{threads} to {most} torch threads"
            reasons.append(f"{counts} per stage process ({stage_processes} of them, following the cores the other "
                           "processes leave idle)")
        else:
            most = threads  # as given: they do not follow the machine's load
        if rows is None:
            rows, bound = slot_rows(machine, kv_bytes_per_token, positions, slots, stage_processes, kv_budget)
            reasons.append(f"{rows} rows per slot ({bound})")
        why = "; ".join(reasons) if reasons else "as given"
        return cls(threads, rows, f"{why}, on {machine.describe()}", most)

    def status(self) -> dict[str, object]:
        """What `/v1/status` and `Pipeline.status` show of them."""
        return {"threads": self.threads, "most_threads": self.most_threads, "microbatch": self.rows, "why": self.why}
