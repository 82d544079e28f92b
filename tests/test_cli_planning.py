"""`dejavu plan` and `dejavu simulate`: answers, outputs, and clear errors (exit 2, no traceback) on bad input."""

from __future__ import annotations

import json

import pytest
from tiny_models import tiny_llama

from dejavu_sdk.cli import main

OPT66_ON_4_A100 = ["--model", "opt-66b", "--hardware", "a100-80gb", "--gpus-per-machine", "4"]


def test_plan_from_a_builtin_profile(capsys) -> None:
    assert main(["plan", "--machines", "8", *OPT66_ON_4_A100, "--stream-overhead", "1.05"]) == 0
    output = capsys.readouterr().out
    assert "roofline estimate for OPT-66B on 4x A100-80GB" in output
    assert "memory bounds: at least 1 prompt and 1 token machines" in output
    assert "Disaggregate into 2 prompt + 6 token machines" in output


def test_plan_as_json_from_given_times(capsys) -> None:
    arguments = ["plan", "--machines", "8", "--prompt-time", "1", "--token-time", "0.02", "--new-tokens", "200",
                 "--json"]
    assert main(arguments) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["plan"]["disaggregate"] is True
    assert (answer["plan"]["prompt_machines"], answer["plan"]["token_machines"]) == (2, 6)
    assert answer["plan"]["predicted_speedup"] == pytest.approx(5.8575 / (32 / 6))


def test_plan_measures_a_local_model(tmp_path, capsys) -> None:
    tiny_llama().save_pretrained(tmp_path / "tiny")
    arguments = ["plan", "--machines", "4", "--measure", str(tmp_path / "tiny"), "--microbatch", "1",
                 "--prompt-tokens", "16", "--new-tokens", "8", "--json"]
    assert main(arguments) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["inputs"]["source"].startswith("measured here")
    assert answer["inputs"]["prompt_time"] > 0
    assert answer["inputs"]["token_time"] > 0


@pytest.mark.parametrize(("arguments", "message"), [
    (["plan", "--machines", "1", "--prompt-time", "1", "--token-time", "0.1"], "at least 2"),
    (["plan", "--machines", "8"], "say how fast the model is"),
    (["plan", "--machines", "8", "--prompt-time", "1"], "give both --prompt-time and --token-time"),
    (["plan", "--machines", "8", "--model", "opt-66b"], "--model needs --hardware"),
    (["plan", "--machines", "8", "--model", "opt-99b", "--hardware", "h200"], "unknown model profile"),
    (["plan", "--machines", "8", "--model", "opt-66b", "--hardware", "tpu"], "unknown hardware profile"),
    (["plan", "--machines", "4", "--model", "bloom-176b", "--hardware", "v100-16gb"], "does not fit on 4 machines"),
    (["plan", "--machines", "8", "--prompt-time", "1", "--token-time", "0.1", "--stream-overhead", "2"],
     "stream_overhead must be in"),
    (["plan", "--machines", "8", "--prompt-time", "1", "--token-time", "0.1", "--microbatch", "0"],
     "--microbatch must be at least 1"),
    (["plan", "--machines", "8", "--measure", "/nonexistent/model"], "cannot load a causal LM"),
    (["simulate", "--machines", "a-b", "--prompt-time", "1", "--token-time", "0.1"], "--machines takes a range"),
    (["simulate", "--machines", "0-4", "--prompt-time", "1", "--token-time", "0.1"], "at least one machine count"),
    (["simulate", "--requests", "0", "--prompt-time", "1", "--token-time", "0.1"], "at least one request"),
    (["simulate", "--rate", "-1", "--prompt-time", "1", "--token-time", "0.1"], "rate must be positive"),
    (["simulate", "--trace", "/nonexistent.csv", "--prompt-time", "1", "--token-time", "0.1"], "cannot read"),
])
def test_bad_input_is_a_clear_error(arguments: list[str], message: str, capsys) -> None:
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error


def test_simulate_writes_a_table_a_plot_and_json(tmp_path, capsys) -> None:
    plot, samples = tmp_path / "sweep.png", tmp_path / "sweep.json"
    arguments = ["simulate", *OPT66_ON_4_A100, "--machines", "1,2,4", "--requests", "80", "--rate", "2",
                 "--plot", str(plot), "--json", str(samples), "--quiet"]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    for expected in ("| 4 | ", "Poisson at 2.0 requests/s", "CC-BY-4.0"):
        assert expected in output
    assert plot.read_bytes().startswith(b"\x89PNG")
    rows = json.loads(samples.read_text())["rows"]
    assert [row["machines"] for row in rows] == [1, 2, 4]
    assert rows[0]["disaggregated"] is None
    assert rows[2]["disaggregated"]["makespan"] > 0
