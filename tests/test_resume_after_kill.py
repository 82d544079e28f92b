"""A generation killed with SIGKILL mid-decode resumes in another process to identical tokens,
without recomputing its prompt, from LMDB and from S3 (a loopback server): greedy, and sampled, killed at a
random step."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.cache import prompt_streaming_for
from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.manifest import load_manifest

TESTS = Path(__file__).parent
NEW = 40

CHILD = """
    import json, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads({threads})  # the test's own: it expects what "auto" settings choose with them
    import dejavu_sdk as dv
    from dejavu_sdk.engine import DejaVuEngine
    from transformers import LogitsProcessor, LogitsProcessorList
    from tiny_models import prompt, tiny_llama

    class Progress(LogitsProcessor):
        def __init__(self):
            self.step = 0
        def __call__(self, input_ids, scores):
            self.step += 1
            print(self.step, flush=True)
            time.sleep(600 if self.step == {kill_at} else 0.05)  # held for the kill, or a bigger model's step
            return scores

    store = dv.open_store({url!r}, **json.loads({options!r}))
    ids, mask = (tensor.to({device!r}) for tensor in prompt())
    progress = LogitsProcessorList([Progress()])
    model = tiny_llama().to({device!r})
    DejaVuEngine(model, store=store, **json.loads({engine!r})).generate(ids, attention_mask=mask, max_new_tokens={new},
                                                     stream_id="victim", logits_processor=progress,
                                                     **json.loads({decoding!r}))
    print("finished", flush=True)
"""


SAMPLED = {"do_sample": True, "temperature": 0.8, "top_k": 30, "top_p": 0.9, "seed": 1234}


def _kill_mid_decode(url: str, options: dict, decoding: dict | None = None, kill_at: int = 15,
                     device: str = "cpu", engine: dict | None = None) -> None:
    code = textwrap.dedent(CHILD.format(tests=str(TESTS), url=url, options=json.dumps(options), new=NEW,
                                        decoding=json.dumps(decoding or {}), device=device,
                                        engine=json.dumps(engine or {}), threads=torch.get_num_threads(),
                                        kill_at=kill_at))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    deadline, step = time.monotonic() + 120, 0
    while step < kill_at and time.monotonic() < deadline:
        line = child.stdout.readline()
        assert line, "the child ended before it could be killed"
        assert line.strip() != "finished", "the child finished before it could be killed"
        step = int(line)
    _wait_until_a_step_is_durable(dv.open_store(url, **options), deadline)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def _wait_until_a_step_is_durable(store: dv.Store, deadline: float) -> None:
    """Holds the kill until the replica has a decode step beyond the prompt: replication runs beside the
    steps (grouped ones wait for their group or its time bound), so under load it lags the step count."""
    from tiny_models import prompt

    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(KeyError):
                if load_manifest(store, "victim").durable_positions > prompt()[0].shape[1]:
                    return
            time.sleep(0.02)
    finally:
        store.close()


def _resume_and_check(store: dv.Store, decoding: dict | None = None, device: str = "cpu",
                      recomputed_at_most: int = 2) -> None:
    from tiny_models import prompt, tiny_llama

    manifest = load_manifest(store, "victim")
    ids, mask = (tensor.to(device) for tensor in prompt())
    assert manifest.durable_positions > ids.shape[1]  # the prompt and some steps survived the kill
    assert len(manifest.generated[0]) < NEW
    model = tiny_llama().to(device)
    fed: list[int] = []
    model.register_forward_pre_hook(lambda _m, args, kwargs: fed.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    resumed = DejaVuEngine(model, store=store).resume("victim")
    assert max(fed) <= recomputed_at_most, f"resume fed {max(fed)} positions at once: the prompt was recomputed"
    fed.clear()
    settings = dict(decoding or {"do_sample": False})
    torch.manual_seed(settings.pop("seed", 0))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **settings)
    assert torch.equal(resumed, expected)


@pytest.mark.slow
def test_resume_from_lmdb_after_sigkill(tmp_path) -> None:
    sys.path.insert(0, str(TESTS))
    url = f"lmdb://{tmp_path / 'kv'}"
    _kill_mid_decode(url, {})
    _resume_and_check(dv.open_store(url))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lmdb", pytest.param("s3", marks=pytest.mark.matrix)])
def test_a_sampled_generation_resumes_exactly_after_sigkill_at_a_random_step(tmp_path, s3_options,
                                                                            backend: str) -> None:
    sys.path.insert(0, str(TESTS))
    kill_at = random.Random().randint(5, NEW - 8)
    if backend == "lmdb":
        url, options = f"lmdb://{tmp_path / 'kv'}", {}
    else:
        url, options = f"s3://dejavu-resume/{uuid.uuid4().hex}", {"storage_options": s3_options}
    print(f"killing the child at decode step {kill_at}")  # shown if the test fails
    _kill_mid_decode(url, options, SAMPLED, kill_at)
    _resume_and_check(dv.open_store(url, **options), SAMPLED)


@pytest.mark.slow
@pytest.mark.parametrize("engine", [{"prompt_streaming": "layerwise"}, {"prompt_streaming": "after"},
                                    {"replicate_every": 4, "replicate_within_ms": 120}],
                         ids=["layerwise", "after", "grouped steps"])
def test_every_streaming_setting_resumes_exactly_after_sigkill_at_a_random_step(tmp_path, engine: dict) -> None:
    """Prompt streamed layer by layer or after the forward, decode steps alone or grouped (by steps and by
    time): killed at a random step, the stream resumes to the same samples, and its manifest says how far
    the durable replica may lag."""
    sys.path.insert(0, str(TESTS))
    kill_at = random.Random().randint(5, NEW - 8)
    print(f"killing the child at decode step {kill_at}")  # shown if the test fails
    url = f"lmdb://{tmp_path / 'kv'}"
    _kill_mid_decode(url, {}, SAMPLED, kill_at, engine=engine)
    store = dv.open_store(url)
    manifest = load_manifest(store, "victim")
    every = engine.get("replicate_every", 1)
    assert (manifest.replicate_every, manifest.replicate_within_ms) == (every, engine.get("replicate_within_ms"))
    assert manifest.prompt_streaming == engine.get("prompt_streaming", prompt_streaming_for("cpu"))
    _resume_and_check(store, SAMPLED, recomputed_at_most=every + 1)


@pytest.mark.slow
def test_resume_from_s3_after_sigkill(s3_options) -> None:
    sys.path.insert(0, str(TESTS))
    url = f"s3://dejavu-resume/{uuid.uuid4().hex}"
    _kill_mid_decode(url, {"storage_options": s3_options})
    _resume_and_check(dv.open_store(url, storage_options=s3_options))


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="sampling on a GPU needs CUDA")
def test_a_sampled_generation_on_cuda_resumes_exactly_after_sigkill(tmp_path) -> None:
    """The CUDA generator's state (not the CPU one's) goes with every durable step and is put back."""
    sys.path.insert(0, str(TESTS))
    url = f"lmdb://{tmp_path / 'kv'}"
    _kill_mid_decode(url, {}, SAMPLED, kill_at=random.Random().randint(5, NEW - 8), device="cuda")
    store = dv.open_store(url)
    assert load_manifest(store, "victim").sampling["device"] == "cuda"
    _resume_and_check(store, SAMPLED, device="cuda")
