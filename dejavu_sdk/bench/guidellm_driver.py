"""One load of `dejavu bench http` driven by guidellm, the load generator users point at any OpenAI server.

Each load is one `guidellm run` process: streamed `/v1/completions` of synthetic prompts of `prompt_tokens`
tokens (counted with the model directory's own tokenizer, offline), `max_tokens` new tokens each, greedy
(`temperature` 0), without `ignore_eos` (transformers serve refuses it); `streams` clients one request after another
(one client: guidellm's synchronous profile), or requests arriving at `rate` a second (its Poisson profile), until
`requests` were sent. Its figures are guidellm's own, read from its JSON: output tokens/s over the measured
window, time to first token and inter-token latency (p50, p99; each request's mean gap, as guidellm counts it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DejaVuError

#: Seconds one guidellm run may take, its start (about 20 s: it imports torch and transformers) included.
RUN_TIMEOUT = 1200.0
#: Environment guidellm runs with: offline (the tokenizer is the model directory's), one process.
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "GUIDELLM__MAX_WORKER_PROCESSES": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}


def guidellm_command() -> str:
    """The `guidellm` executable (beside this Python's, or on the PATH); ConfigError where it is not installed."""
    beside = Path(sys.executable).with_name("guidellm")
    found = str(beside) if beside.is_file() else shutil.which("guidellm")
    if found is None:
        raise ConfigError("guidellm is not installed: pip install 'dejavu-sdk[bench]' (or --client builtin)")
    return found


def guidellm_load(url: str, model: str, token: str, streams: int, rate: float, requests: int, prompt_tokens: int,
                  max_tokens: int) -> dict[str, float]:
    """Drive the server at `url` with one load (see the module) and return its figures: `tokens_per_second`,
    `ttft_p50`/`ttft_p99`/`itl_p50`/`itl_p99` (seconds), `tokens` and `seconds` (the measured window)."""
    profile: dict[str, Any] = ({"kind": "poisson", "rate": rate} if rate else
                               {"kind": "synchronous"} if streams == 1 else {"kind": "concurrent", "streams": streams})
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
               "api_key": token, "extras": {"body": {"ignore_eos": None, "temperature": 0}}}
    with tempfile.TemporaryDirectory(prefix="dejavu-guidellm-") as folder:
        results, log = Path(folder, "results.json"), Path(folder, "log")
        command = [guidellm_command(), "run", "--backend", json.dumps(backend),
                   "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": model}),
                   "--data", json.dumps({"kind": "synthetic_text", "prompt_tokens": prompt_tokens,
                                         "output_tokens": max_tokens}),
                   "--profile", json.dumps(profile),
                   "--constraint", json.dumps({"kind": "max_requests", "count": requests}),
                   "--output", json.dumps({"kind": "json", "path": str(results)}), "--disable-console"]
        with open(log, "w") as output:
            try:
                finished = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT,
                                          env={**os.environ, **ENVIRONMENT}, check=False)
            except subprocess.TimeoutExpired:
                raise DejaVuError(f"guidellm ran past {RUN_TIMEOUT:.0f} s: {log.read_text()[-2000:]}") from None
        if finished.returncode != 0 or not results.is_file():
            raise DejaVuError(f"guidellm exited with status {finished.returncode}: {log.read_text()[-2000:]}")
        return guidellm_figures(json.loads(results.read_text()))


def guidellm_figures(report: dict[str, Any]) -> dict[str, float]:
    """The figures of guidellm's JSON report of one load (its only benchmark); DejaVuError where a request
    failed or none succeeded (a load's figures are of every request it sent)."""
    (benchmark,) = report["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    if totals["errored"] or not totals["successful"]:
        errors = [request.get("info", {}).get("error") for request in benchmark["requests"].get("errored", [])]
        raise DejaVuError(f"guidellm: {totals['successful']} request(s) succeeded, {totals['errored']} failed: "
                          f"{errors[:3]}")

    def successful(name: str) -> dict[str, Any]:
        return metrics[name]["successful"]

    return {"tokens_per_second": successful("output_tokens_per_second")["mean"],
            "ttft_p50": successful("time_to_first_token_ms")["percentiles"]["p50"] / 1000,
            "ttft_p99": successful("time_to_first_token_ms")["percentiles"]["p99"] / 1000,
            "itl_p50": successful("inter_token_latency_ms")["percentiles"]["p50"] / 1000,
            "itl_p99": successful("inter_token_latency_ms")["percentiles"]["p99"] / 1000,
            "tokens": int(successful("output_token_count")["total_sum"]), "seconds": benchmark["duration"]}
