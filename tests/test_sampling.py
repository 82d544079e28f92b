"""Sampled generation replicates exactly: `engine.generate(do_sample=True, seed=s)` equals
`torch.manual_seed(s)` and `model.generate`, and a crash at any step resumes to the very same tokens;
a damaged or mismatched sampling record is a typed error, never different tokens."""

from __future__ import annotations

import json

import pytest
import torch
from test_architectures import MODELS
from tiny_models import Crash
from transformers import LogitsProcessorList

import dejavu_sdk as dv
from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.stores import MemoryStore

NEW = 10
SETTINGS = {"do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01,
            "repetition_penalty": 1.1}


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2"])
def model(request):
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    return ids, mask


def _reference(model, inputs, seed: int, new: int = NEW, **extra) -> torch.Tensor:
    torch.manual_seed(seed)
    return model.generate(inputs[0], attention_mask=inputs[1], max_new_tokens=new, **SETTINGS, **extra)


def _crashed(model, store, inputs, steps: int, seed: int = 11, **extra) -> None:
    with pytest.raises(KeyboardInterrupt):
        DejaVuEngine(model, store=store).generate(inputs[0], attention_mask=inputs[1], max_new_tokens=NEW,
                                                  stream_id="s", seed=seed, **SETTINGS, **extra,
                                                  logits_processor=LogitsProcessorList([Crash(steps)]))


def test_sampled_tokens_equal_model_generate_after_manual_seed(model, inputs) -> None:
    out = DejaVuEngine(model, store=MemoryStore()).generate(inputs[0], attention_mask=inputs[1],
                                                            max_new_tokens=NEW, seed=3, **SETTINGS)
    assert torch.equal(out, _reference(model, inputs, 3))
    other = DejaVuEngine(model, store=MemoryStore()).generate(inputs[0], attention_mask=inputs[1],
                                                              max_new_tokens=NEW, seed=4, **SETTINGS)
    assert not torch.equal(other, out)  # the seed matters: this is sampling, not greedy


@pytest.mark.parametrize("steps", [1, 4, NEW - 1])
def test_a_sampled_stream_resumes_exactly_after_a_crash(model, inputs, steps: int) -> None:
    store = MemoryStore()
    _crashed(model, store, inputs, steps)
    torch.manual_seed(999)  # whatever the process did meanwhile
    assert torch.equal(DejaVuEngine(model, store=store).resume("s"), _reference(model, inputs, 11))


def test_without_a_seed_one_is_drawn_and_recorded(model, inputs) -> None:
    store = MemoryStore()
    engine = DejaVuEngine(model, store=store, keep_finished=True)
    out = engine.generate(inputs[0], attention_mask=inputs[1], max_new_tokens=NEW, stream_id="s", **SETTINGS)
    seed = json.loads(store.read_manifest("s"))["sampling"]["seed"]
    assert torch.equal(out, _reference(model, inputs, seed))


def test_rows_that_stop_at_different_steps_resume_exactly(inputs) -> None:
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    reference = _reference(model, inputs, 11, new=NEW)
    eos = int(reference[1, inputs[0].shape[1] + 2])  # row 1 stops at its third token; row 0 goes on
    assert eos not in reference[0, inputs[0].shape[1]:inputs[0].shape[1] + 3].tolist()
    expected = _reference(model, inputs, 11, eos_token_id=eos, pad_token_id=0)
    store = MemoryStore()
    _crashed(model, store, inputs, 6, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(DejaVuEngine(model, store=store).resume("s"), expected)


def _tampered(store: MemoryStore, edit, where: str) -> None:
    """Edit the stream's manifest, or the progress record that holds the generator state to resume from."""
    if where == "manifest":
        manifest = json.loads(store.read_manifest("s"))
        edit(manifest)
        store.write_manifest("s", json.dumps(manifest).encode())
        return
    for key in reversed(store.progress_keys("s")):
        record = json.loads(store.read_progress(key))
        if record["rng"]:
            edit(record)
            store.put_progress(key, json.dumps(record).encode())
            return
    raise AssertionError("no progress record holds a generator state")


@pytest.mark.parametrize(("where", "edit", "error", "match"), [
    ("record", lambda m: m.update(rng=m["rng"][:-8]), dv.CorruptBlock, "rng"),
    ("record", lambda m: m.update(rng="not base64!"), dv.CorruptBlock, "rng"),
    ("record", lambda m: m.update(rng=""), dv.CorruptBlock, "rng"),
    ("record", lambda m: m.update(rng=None), dv.CorruptBlock, "rng"),
    ("manifest", lambda m: m.update(sampling=None), dv.CorruptBlock, "rng"),
    ("manifest", lambda m: m["sampling"].pop("seed"), dv.CorruptBlock, "sampling"),
    ("manifest", lambda m: m["sampling"]["settings"].update(top_k=[1]), dv.CorruptBlock, "top_k"),
    ("manifest", lambda m: m["sampling"]["versions"].update(torch="0.1"), dv.ConfigError, "versions|sampled with"),
    ("manifest", lambda m: m["sampling"].update(device="cuda"), dv.ConfigError, "cuda"),
])
def test_a_damaged_or_foreign_sampling_record_is_a_typed_error(model, inputs, where, edit, error, match) -> None:
    store = MemoryStore()
    _crashed(model, store, inputs, 4)
    _tampered(store, edit, where)
    with pytest.raises(error, match=match):
        DejaVuEngine(model, store=store).resume("s")


@pytest.mark.parametrize("given", [{"temperature": 0.5}, {"top_k": 3}, {"do_sample": False}])
def test_resuming_with_other_settings_is_refused(model, inputs, given) -> None:
    store = MemoryStore()
    _crashed(model, store, inputs, 4)
    with pytest.raises(dv.ConfigError, match="sampled"):
        DejaVuEngine(model, store=store).resume("s", **given)
    assert torch.equal(DejaVuEngine(model, store=store).resume("s"), _reference(model, inputs, 11))


@pytest.mark.parametrize(("option", "match"), [
    ({"num_beams": 2}, "beam search"), ({"num_return_sequences": 2, "do_sample": True}, "one sequence"),
    ({"prompt_lookup_num_tokens": 3}, "speculative"), ({"seed": 3}, "do_sample=True"),
    ({"temperature": 0.7}, "do_sample=True"), ({"do_sample": True, "seed": -1}, "seed"),
])
def test_what_cannot_resume_exactly_is_refused_with_the_reason(model, inputs, option, match) -> None:
    with pytest.raises(dv.ConfigError, match=match):
        DejaVuEngine(model, store=MemoryStore()).generate(*inputs, max_new_tokens=2, **option)
