"""`dejavu bench http`: dejavu serve beside transformers serve on the same weights, each driven by streaming clients
over HTTP, with their figures side by side, the ratio per repeat and a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models

from dejavu_sdk.cli import main


@pytest.mark.slow
@pytest.mark.peers  # run on its own (-m peers): two servers starting take both cores for a minute
def test_bench_http_drives_both_servers_and_reports_their_ratio(tmp_path, smollm2_tokenizer, capsys) -> None:
    model = tmp_path / "model"
    tiny_models.llama_text().save_pretrained(model)  # SmolLM2's vocabulary, two random layers
    smollm2_tokenizer.save_pretrained(model)
    out, plot = tmp_path / "http.json", tmp_path / "http.png"
    assert main(["bench", "http", "--model", str(model), "--client", "builtin", "--streams", "2", "--rounds", "1",
                 "--max-tokens", "4", "--prompt-tokens", "20", "--repeats", "1", "--json", str(out),
                 "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    assert sorted((run["server"], run["streams"]) for run in runs) == [("dejavu", 2), ("transformers", 2)]
    for run in runs:
        figures = run["figures"]
        assert 0 < figures["tokens"] <= 4 * run["streams"]  # every client got tokens, none beyond max_tokens
        assert figures["tokens_per_second"] > 0
        assert 0 < figures["ttft_p50"] <= figures["ttft_p99"]
    assert "| 2 stream(s) |" in printed  # the table's row of two streams, with its ratio
    assert plot.stat().st_size > 0


@pytest.mark.slow
@pytest.mark.peers
def test_bench_http_drives_both_servers_with_guidellm_concurrent_and_poisson(tmp_path, smollm2_tokenizer,
                                                                             capsys) -> None:
    model = tmp_path / "model"
    tiny_models.llama_text().save_pretrained(model)
    smollm2_tokenizer.save_pretrained(model)
    out = tmp_path / "http.json"
    assert main(["bench", "http", "--model", str(model), "--streams", "2", "--rounds", "2", "--rate", "4",
                 "--rate-requests", "3", "--max-tokens", "4", "--prompt-tokens", "16", "--repeats", "1",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    assert sorted((run["server"], run["load"]) for run in runs) == [
        ("dejavu", "2 stream(s)"), ("dejavu", "Poisson 4.00/s"),
        ("transformers", "2 stream(s)"), ("transformers", "Poisson 4.00/s")]
    for run in runs:
        figures = run["figures"]
        assert 0 < figures["tokens"] <= 4 * run["requests"]  # guidellm's count: none beyond max_tokens
        assert 0 < figures["ttft_p50"] <= figures["ttft_p99"]
    assert "| Poisson 4.00/s |" in printed


def test_guidellm_figures_are_read_from_its_report_and_a_failed_request_fails_the_load() -> None:
    from dejavu_sdk.bench.guidellm_driver import guidellm_figures
    from dejavu_sdk.errors import DejaVuError

    reports = json.loads((Path(__file__).parent / "data" / "guidellm_reports.json").read_text())  # guidellm 0.8.1's
    figures = guidellm_figures(reports["synchronous"])  # JSON (trimmed) of a run against its mock server
    assert figures["tokens"] == 80
    assert figures["tokens_per_second"] == pytest.approx(80 / figures["seconds"], rel=1e-3)  # over its window
    assert figures["ttft_p50"] == pytest.approx(0.028, abs=1e-3)  # milliseconds there, seconds here
    assert figures["ttft_p50"] <= figures["ttft_p99"]
    assert figures["itl_p50"] <= figures["itl_p99"]
    with pytest.raises(DejaVuError, match=r"2 request.s. succeeded, 2 failed"):
        guidellm_figures(reports["failing"])


def test_bench_http_refuses_what_is_not_a_model_directory(tmp_path) -> None:
    from dejavu_sdk.bench.http import run_http_bench
    from dejavu_sdk.errors import ConfigError

    with pytest.raises(ConfigError, match="model directory"):
        run_http_bench(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="positive"):
        run_http_bench(str(tmp_path), streams=[0])
    with pytest.raises(ConfigError, match="client must be one of"):
        run_http_bench(str(tmp_path), client="ab")
    with pytest.raises(ConfigError, match=r"Poisson load .* needs .* the guidellm client"):
        run_http_bench(str(tmp_path), client="builtin", rate=1.0)
    with pytest.raises(ConfigError, match="no load"):
        run_http_bench(str(tmp_path), client="builtin", streams=[])
