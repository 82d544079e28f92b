"""The serving simulator: hand-computed schedules, and the paper's qualitative findings."""

from __future__ import annotations

import numpy as np
import pytest

import dejavu_sdk as dv
from dejavu_sdk.planner import MemoryModel
from dejavu_sdk.profiles import Roofline, hardware_profile, model_profile
from dejavu_sdk.simulator import Workload, compare, poisson_arrivals, simulate_disaggregated, simulate_pipeline
from dejavu_sdk.traces import load_trace

OPT66 = Roofline(model_profile("opt-66b"), hardware_profile("a100-80gb"), gpus=4)


def at_once(lengths: tuple[int, ...]) -> tuple[float, ...]:
    return (0.0,) * len(lengths)


def trace_workload(count: int, prompt_time: float, token_time: float, microbatch: int = 8, overhead: float = 1.0,
                   seed: int = 0) -> Workload:
    lengths = load_trace().sample_output_lengths(count, seed=seed)
    return Workload(prompt_time, token_time, lengths, at_once(lengths), microbatch, overhead)


def test_one_machine_runs_a_microbatch_until_its_longest_request_ends() -> None:
    workload = Workload(2.0, 0.5, (3, 5), at_once((3, 5)), microbatch=2)
    outcome = simulate_pipeline(workload, machines=1)
    # Prefill gives the first token at 2; four decode steps follow; the 3-token request ends at 3.
    assert outcome.makespan == pytest.approx(4.0)
    assert outcome.mean_latency == pytest.approx(3.5)
    assert outcome.cost == pytest.approx(4.0)
    assert outcome.layout == "1 x 1 stages"


def test_a_two_stage_pipeline_by_hand() -> None:
    # Per stage: prefill 1, decode 0.5. A: prefill [0,1] [1,2]; B: [1,2] [2,3]; A's step [2,2.5] [3,3.5];
    # B's step [3,3.5] [3.5,4].
    workload = Workload(2.0, 1.0, (2, 2), at_once((2, 2)), microbatch=1)
    outcome = simulate_pipeline(workload, machines=2)
    assert outcome.makespan == pytest.approx(4.0)
    assert outcome.mean_latency == pytest.approx(3.75)


def test_disaggregated_by_hand() -> None:
    # One prompt machine prefills A [0,2] then B [2,4]; the token machine decodes A [2,4] then B [4,6].
    workload = Workload(2.0, 1.0, (3, 3), at_once((3, 3)), microbatch=1)
    outcome = simulate_disaggregated(workload, 1, 1)
    assert outcome.makespan == pytest.approx(6.0)
    assert outcome.mean_latency == pytest.approx(5.0)
    slowed = simulate_disaggregated(Workload(2.0, 1.0, (3, 3), at_once((3, 3)), 1, stream_overhead=1.5), 1, 1)
    assert slowed.makespan == pytest.approx(8.0)  # prefills take 3: A [0,3] [3,5], B [3,6] [6,8]


def test_requests_arriving_later_wait_for_nothing_but_their_arrival() -> None:
    workload = Workload(1.0, 0.1, (1, 1), (0.0, 10.0), microbatch=1)
    outcome = simulate_pipeline(workload, machines=1)
    assert outcome.makespan == pytest.approx(11.0)
    assert outcome.mean_latency == pytest.approx(1.0)


def test_disaggregation_wins_when_prefill_is_long_and_loses_when_the_condition_fails() -> None:
    machines, token_time = 8, 0.03
    slow_prefill = compare(trace_workload(300, 60 * token_time, token_time, overhead=1.05), machines)
    assert slow_prefill["disaggregated"].makespan < 0.85 * slow_prefill["pipeline"].makespan
    # Y/t = 1.2 with m = 1.5 is below the threshold (D-1)/(D(2-m)-1) = 2.33.
    fast_prefill = compare(trace_workload(300, 1.2 * token_time, token_time, overhead=1.5), machines)
    assert fast_prefill["disaggregated"].makespan > fast_prefill["pipeline"].makespan


def test_with_early_stopping_the_baseline_makespan_depends_on_which_requests_share_a_microbatch() -> None:
    lengths = load_trace().sample_output_lengths(200, seed=3)
    prompt_time, token_time = OPT66.prompt_time(8, 1000), OPT66.token_time(8, 1200)
    makespans = []
    for seed in range(4):
        order = np.random.default_rng(seed).permutation(len(lengths))
        shuffled = tuple(lengths[i] for i in order)
        makespans.append(simulate_pipeline(Workload(prompt_time, token_time, shuffled, at_once(shuffled)), 8).makespan)
    assert max(makespans) / min(makespans) > 1.03


def test_a_larger_microbatch_does_not_always_help() -> None:
    lengths = load_trace().sample_output_lengths(400, seed=0)

    def makespan(microbatch: int) -> float:
        workload = Workload(OPT66.prompt_time(microbatch, 1000), OPT66.token_time(microbatch, 1200), lengths,
                            at_once(lengths), microbatch, 1.05)
        return compare(workload, 8)["disaggregated"].makespan

    small, medium, large = makespan(2), makespan(16), makespan(64)
    assert medium < small  # batching helps at first...
    assert large > medium  # ...then the longest request of each microbatch and too few microbatches dominate


def test_pipeline_with_data_parallelism_keeps_the_best_replica_count() -> None:
    workload = trace_workload(200, 1.0, 0.02)
    outcomes = compare(workload, 8)
    best = min((simulate_pipeline(workload, 8, k) for k in (2, 4, 8)), key=lambda outcome: outcome.makespan)
    assert outcomes["pipeline+dp"] == best
    assert compare(workload, 1)["pipeline+dp"] is None
    assert compare(workload, 1)["disaggregated"] is None


def test_memory_rules_out_shallow_pipelines() -> None:
    memory = MemoryModel(memory_per_machine=40, layers=10, weight_bytes_per_layer=5, prompt_cache_bytes_per_layer=1,
                         token_cache_bytes_per_layer=1)  # D_t >= 3
    workload = trace_workload(100, 1.0, 0.02)
    assert all(outcome is None for outcome in compare(workload, 2, memory).values())
    six = compare(workload, 6, memory)
    assert six["pipeline"] is not None
    assert six["pipeline+dp"].layout == "2 x 3 stages"
    prompt, token = (int(part.split()[0]) for part in six["disaggregated"].layout.split(" + "))
    assert prompt >= 2
    assert token >= 3


def test_poisson_arrivals() -> None:
    arrivals = np.array(poisson_arrivals(20000, rate=4.0, seed=1))
    assert arrivals[0] == 0
    assert np.all(np.diff(arrivals) >= 0)
    assert np.mean(np.diff(arrivals)) == pytest.approx(0.25, rel=0.03)
    assert poisson_arrivals(3, None) == (0.0, 0.0, 0.0)
    with pytest.raises(dv.ConfigError, match="rate must be positive"):
        poisson_arrivals(3, 0.0)


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(prompt_time=0.0), "must be positive"),
    (dict(output_lengths=(1, 0)), "at least one token"),
    (dict(arrivals=(0.0,)), "one arrival time per request"),
    (dict(arrivals=(1.0, 0.0)), "sorted"),
    (dict(microbatch=0), "microbatch"),
    (dict(stream_overhead=2.0), r"\[1, 2\)"),
])
def test_bad_workloads_are_refused(arguments: dict, message: str) -> None:
    call = dict(prompt_time=1.0, token_time=0.1, output_lengths=(1, 2), arrivals=(0.0, 0.0)) | arguments
    with pytest.raises(dv.ConfigError, match=message):
        Workload(**call)
    with pytest.raises(dv.ConfigError, match="equal pipelines"):
        simulate_pipeline(Workload(1.0, 0.1, (1, 2), (0.0, 0.0)), 6, replicas=4)


def test_the_shipped_trace_carries_its_attribution(tmp_path) -> None:
    trace = load_trace()
    assert len(trace) == 1937
    assert "CC-BY-4.0" in trace.attribution
    assert trace.arrivals[0] == 0
    assert np.all(np.diff(trace.arrivals) >= 0)
    assert 100 < np.median(trace.output_tokens) < 160
    assert trace.output_tokens.max() == 1000
    lengths = trace.sample_output_lengths(1000, seed=0, clip=(20, 500))
    assert min(lengths) >= 20
    assert max(lengths) <= 500
    bad = tmp_path / "bad.csv"
    bad.write_text("when,what\n1,2\n")
    with pytest.raises(dv.ConfigError, match="TIMESTAMP, ContextTokens, GeneratedTokens"):
        load_trace(str(bad))
    with pytest.raises(dv.ConfigError, match="cannot read"):
        load_trace(str(tmp_path / "missing.csv"))
