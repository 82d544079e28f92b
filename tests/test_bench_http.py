"""`dejavu bench http`: dejavu serve beside transformers serve on the same weights, each driven by streaming clients
over HTTP, with their figures side by side, the ratio per repeat and a plot."""

from __future__ import annotations

import json

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
    assert main(["bench", "http", "--model", str(model), "--streams", "2", "--rounds", "1", "--max-tokens", "4",
                 "--prompt-words", "20", "--repeats", "1", "--json", str(out), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    assert sorted((run["server"], run["streams"]) for run in runs) == [("dejavu", 2), ("transformers", 2)]
    for run in runs:
        figures = run["figures"]
        assert 0 < figures["tokens"] <= 4 * run["streams"]  # every client got tokens, none beyond max_tokens
        assert figures["tokens_per_second"] > 0
        assert 0 < figures["ttft_p50"] <= figures["ttft_p99"]
    assert "| 2 |" in printed  # the table's row of two streams, with its ratio
    assert plot.stat().st_size > 0


def test_bench_http_refuses_what_is_not_a_model_directory(tmp_path) -> None:
    from dejavu_sdk.bench.http import run_http_bench
    from dejavu_sdk.errors import ConfigError

    with pytest.raises(ConfigError, match="model directory"):
        run_http_bench(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="positive"):
        run_http_bench(str(tmp_path), streams=[0])
