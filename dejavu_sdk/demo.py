"""`dejavu demo`: a generation replicated to LMDB is killed with SIGKILL mid-decode and resumed in a new process.

Three processes, as in production: the first generates while its KV cache streams to LMDB and is killed
half way; the second resumes the stream from LMDB, then, for comparison, generates the same answer again
from scratch. The demo checks that both texts are identical and shows how much faster resuming was.
Uses SmolLM2-135M-Instruct when its weights are installed, else a small random model (and says so).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from tqdm import tqdm

from .backends import open_store
from .errors import ConfigError

QUESTION = "Explain in a few sentences why a language model keeps a key-value cache while it generates."
STREAM = "demo"


def _model(random_model: bool) -> tuple[Any, Any, str]:
    from .models import load_smollm2, random_llama, smollm2_available

    if not random_model and smollm2_available():
        model, tokenizer = load_smollm2()
        return model, tokenizer, "SmolLM2-135M-Instruct"
    model = random_llama(layers=8, hidden_size=256, intermediate_size=512, heads=8, vocab_size=512, max_positions=2048)
    return model, None, "a small random Llama (SmolLM2 weights are not installed)"


def _prompt(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if tokenizer is None:
        ids = torch.randint(1, 512, (1, 200), generator=torch.Generator().manual_seed(0))
        return ids, torch.ones_like(ids)
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    return encoded["input_ids"], encoded["attention_mask"]


def _text(tokenizer: Any, tokens: torch.Tensor, prompt_length: int) -> str:
    new = tokens[0, prompt_length:]
    return tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else str(new.tolist())


#: `dejavu demo --sample`: nucleus sampling with a fixed seed, so the uninterrupted run can be reproduced.
SAMPLING: dict[str, Any] = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}
SEED = 7


def _decoding(sample: bool) -> dict[str, Any]:
    return {**SAMPLING, "seed": SEED} if sample else {}


def _generate_child(store: str, new_tokens: int, random_model: bool, sample: bool) -> None:
    """Generate with replication, printing each step so the parent knows when to kill us."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from .engine import DejaVuEngine

    class Progress(LogitsProcessor):
        def __init__(self) -> None:
            self.step = 0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.step += 1
            print(f"step {self.step}", flush=True)
            return scores

    model, tokenizer, name = _model(random_model)
    print(f"model {name}", flush=True)
    ids, mask = _prompt(tokenizer)
    DejaVuEngine(model, store=store).generate(ids, attention_mask=mask, max_new_tokens=new_tokens, stream_id=STREAM,
                                              replace=True,  # a demo left behind in a --store starts over
                                              logits_processor=LogitsProcessorList([Progress()]), **_decoding(sample))
    print("finished", flush=True)


def _resume_child(store: str, new_tokens: int, random_model: bool, sample: bool) -> None:
    """Resume the stream, then generate the same answer from scratch; report both."""
    from .engine import DejaVuEngine

    model, tokenizer, _ = _model(random_model)
    ids, mask = _prompt(tokenizer)
    engine = DejaVuEngine(model, store=store)
    start = time.perf_counter()
    resumed = engine.resume(STREAM)
    resume_seconds = time.perf_counter() - start
    start = time.perf_counter()
    if sample:  # what the uninterrupted sampled run draws: the same seed, the same settings
        torch.manual_seed(SEED)
    again = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                           **(SAMPLING if sample else {"do_sample": False}))
    restart_seconds = time.perf_counter() - start
    print(json.dumps({"identical": torch.equal(resumed, again), "text": _text(tokenizer, resumed, ids.shape[1]),
                      "resume_seconds": resume_seconds, "restart_seconds": restart_seconds}), flush=True)


def _child(role: str, store: str, new_tokens: int, random_model: bool, sample: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "dejavu_sdk.demo", role, "--store", store, "--new-tokens", str(new_tokens)]
    command += ["--random-model"] if random_model else []
    command += ["--sample"] if sample else []
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


def run_demo(store_url: str | None = None, new_tokens: int = 96, kill_at: int | None = None,
             random_model: bool = False, sample: bool = False) -> bool:
    """Run the demo and print a summary; True when the resumed text equals the uninterrupted one.
    `sample`: the generation samples (temperature 0.8, top-p 0.9, seed 7) instead of decoding greedily."""
    kill_at = kill_at or new_tokens // 2
    with tempfile.TemporaryDirectory(prefix="dejavu-demo-") as scratch:
        store = store_url or f"lmdb://{scratch}/kv"
        with open_store(store) as opened:
            if not opened.shared:
                raise ConfigError(f"{store} lives in one process; the demo resumes in another, so use a store other "
                                  "processes can read: lmdb://, file://, s3:// or tcp://")
        how = f"sampling (seed {SEED}, temperature 0.8, top-p 0.9)" if sample else "greedily"
        print(f"1. Generating {new_tokens} tokens {how} with the KV cache streaming to {store}; SIGKILL at step "
              f"{kill_at}.")
        writer = _child("generate", store, new_tokens, random_model, sample)
        assert writer.stdout is not None  # a pipe: stdout=PIPE
        name = writer.stdout.readline().removeprefix("model ").strip()
        print(f"   model: {name}")
        with tqdm(total=kill_at, desc="   decoding", unit="token") as bar:
            for line in writer.stdout:
                if not line.startswith("step "):
                    break
                bar.update()
                if int(line.split()[1]) >= kill_at:
                    os.kill(writer.pid, signal.SIGKILL)
                    break
        writer.wait(timeout=60)
        if writer.returncode != -signal.SIGKILL:
            print(f"The generating process ended on its own (exit code {writer.returncode}) before step {kill_at}.")
            return False
        print("   killed (SIGKILL), mid-decode.")
        print("2. A new process resumes the stream from the replica, then generates it again from scratch.")
        report = json.loads(_child("resume", store, new_tokens, random_model, sample).communicate(timeout=600)[0])
    print(f"\nResumed text:\n  {report['text']}\n")
    verdict = "identical" if report["identical"] else "DIFFERENT"
    speedup = report["restart_seconds"] / report["resume_seconds"]
    print(f"Resumed and from-scratch outputs are {verdict}. Resuming took {report['resume_seconds']:.2f} s, "
          f"starting again {report['restart_seconds']:.2f} s: {speedup:.1f}x faster.")
    return bool(report["identical"])


def main() -> None:
    parser = argparse.ArgumentParser(description="child processes of `dejavu demo`")
    parser.add_argument("role", choices=["generate", "resume"])
    parser.add_argument("--store", required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--random-model", action="store_true")
    parser.add_argument("--sample", action="store_true")
    args = parser.parse_args()
    role = _generate_child if args.role == "generate" else _resume_child
    role(args.store, args.new_tokens, args.random_model, args.sample)


if __name__ == "__main__":
    main()
