"""`dejavu simulate`'s sweep: every strategy over a range of machine counts, as a table and a plot."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import attrs
from tqdm import tqdm

from .planner import MemoryModel
from .report import markdown_table
from .simulator import STRATEGIES, Outcome, Workload, compare


@attrs.frozen
class Sweep:
    """Outcomes per machine count (None where a strategy cannot run there) and a description of the inputs."""

    title: str
    rows: tuple[tuple[int, dict[str, Outcome | None]], ...]

    def to_json(self) -> dict:
        return {"title": self.title, "rows": [
            {"machines": machines, **{name: None if outcome is None else attrs.asdict(outcome)
                                      for name, outcome in outcomes.items()}} for machines, outcomes in self.rows]}

    def speedups(self, baseline: str) -> list[float | None]:
        """Disaggregated makespan vs `baseline`'s, per machine count (None where either is missing)."""
        result = []
        for _, outcomes in self.rows:
            mine, theirs = outcomes["disaggregated"], outcomes[baseline]
            result.append(None if mine is None or theirs is None else theirs.makespan / mine.makespan)
        return result


def run_sweep(workload: Workload, machine_counts: Sequence[int], memory: MemoryModel | None = None,
              title: str = "", progress: bool = True) -> Sweep:
    rows = tuple((machines, compare(workload, machines, memory))
                 for machines in tqdm(machine_counts, desc="simulate", unit="machine count", disable=not progress))
    return Sweep(title, rows)


def sweep_markdown(sweep: Sweep) -> str:
    def cell(outcome: Outcome | None) -> str:
        return "-" if outcome is None else f"{outcome.makespan:.0f} s ({outcome.layout})"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def hours(outcome: Outcome | None) -> str:
        return "-" if outcome is None else f"{outcome.cost / 3600:.2f}"

    makespans = markdown_table(
        ["machines", *STRATEGIES, "vs pipeline", "vs pipeline+dp"],
        [[machines, *(cell(outcomes[name]) for name in STRATEGIES), ratio(versus_pipeline), ratio(versus_dp)]
         for (machines, outcomes), versus_pipeline, versus_dp in
         zip(sweep.rows, sweep.speedups("pipeline"), sweep.speedups("pipeline+dp"), strict=True)])
    costs = markdown_table(
        ["machines", *(f"{name} cost (machine-hours)" for name in STRATEGIES)],
        [[machines, *(hours(outcomes[name]) for name in STRATEGIES)]
         for machines, outcomes in sweep.rows])
    return (f"{sweep.title}\n\nMakespan (layout), and the disaggregated system's speed-up:\n\n{makespans}"
            f"\n\nCost, makespan x machines:\n\n{costs}\n")


def plot_sweep(sweep: Sweep, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (makespan_axis, cost_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, marker in zip(STRATEGIES, "osD", strict=True):
        points = [(machines, outcome) for machines, outcomes in sweep.rows if (outcome := outcomes[name]) is not None]
        machines = [m for m, _ in points]
        makespan_axis.plot(machines, [o.makespan for _, o in points], marker=marker, label=name)
        cost_axis.plot(machines, [o.cost / 3600 for _, o in points], marker=marker, label=name)
    makespan_axis.set(xlabel="machines", ylabel="makespan (s)", title="makespan", yscale="log")
    cost_axis.set(xlabel="machines", ylabel="machine-hours", title="cost (makespan x machines)")
    for axis in (makespan_axis, cost_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(textwrap.fill(sweep.title, 170), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
