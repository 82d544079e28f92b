"""DejaVuEngine: generation equals model.generate, and a stream interrupted mid-decode resumes exactly."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tiny_models import Crash, tiny_llama
from transformers import LlamaForCausalLM, LogitsProcessorList

import dejavu_sdk as dv
from dejavu_sdk.cache import prompt_streaming_for
from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.manifest import load_manifest
from dejavu_sdk.stores import MemoryStore

NEW = 10


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(layers=3)


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    return ids, mask


def _interrupted(model, store, inputs, after_steps: int, stream_id: str = "r", **kwargs) -> None:
    """Start a replicated generation that dies after `after_steps` decode steps."""
    ids, mask = inputs
    with pytest.raises(KeyboardInterrupt):
        DejaVuEngine(model, store=store, **kwargs.pop("engine", {})).generate(
            ids, attention_mask=mask, max_new_tokens=NEW, stream_id=stream_id,
            logits_processor=LogitsProcessorList([Crash(after_steps)]), **kwargs)


def _reference(model, inputs, **kwargs) -> torch.Tensor:
    ids, mask = inputs
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kwargs)


def test_without_a_store_the_engine_is_model_generate(model, inputs) -> None:
    ids, mask = inputs
    assert torch.equal(DejaVuEngine(model).generate(ids, attention_mask=mask, max_new_tokens=NEW),
                       _reference(model, inputs))
    with pytest.raises(dv.ConfigError, match="needs a store"):
        DejaVuEngine(model, transport="tcp://127.0.0.1:9")


@pytest.mark.parametrize("replicate_every", [1, 3])
def test_generate_equals_model_generate_and_leaves_nothing_behind(model, inputs, replicate_every) -> None:
    store = MemoryStore()
    engine = DejaVuEngine(model, store=store, replicate_every=replicate_every)
    ids, mask = inputs
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, stream_id="req-1")
    assert torch.equal(out, _reference(model, inputs))
    assert store.records.names("") == []  # finished streams are not kept by default: no block, no record
    with pytest.raises(dv.BlockNotFound):
        store.read_manifest("req-1")


@pytest.mark.parametrize(("replicate_every", "crash_after"), [(1, 4), (3, 5), (1, 1)])
def test_an_interrupted_stream_resumes_to_the_same_tokens(model, inputs, replicate_every, crash_after) -> None:
    store = MemoryStore()
    ids, mask = inputs
    first = DejaVuEngine(model, store=store, replicate_every=replicate_every)
    with pytest.raises(KeyboardInterrupt):
        first.generate(ids, attention_mask=mask, max_new_tokens=NEW, stream_id="req-1",
                       logits_processor=LogitsProcessorList([Crash(crash_after)]))
    manifest = load_manifest(store, "req-1")
    assert manifest.durable_positions >= ids.shape[1]
    assert len(manifest.generated[0]) == crash_after
    assert {key.run for key in store.keys("req-1")} == {manifest.run}  # every block is named by this run
    assert all(name.startswith(f"req-1/r{manifest.run}.L") for name in manifest.blocks)
    second = DejaVuEngine(model, store=store, replicate_every=replicate_every)
    assert torch.equal(second.resume("req-1"), _reference(model, inputs))
    assert store.records.names("") == []


def test_a_boolean_mask_is_recorded_as_integers_and_resumes(model, inputs) -> None:
    ids, mask = inputs
    store = MemoryStore()
    _interrupted(model, store, (ids, mask.bool()), 3)
    assert load_manifest(store, "r").attention_mask == mask.tolist()
    assert torch.equal(DejaVuEngine(model, store=store).resume("r"), _reference(model, inputs))


def test_rows_that_ended_before_the_crash_stay_padded(model, inputs) -> None:
    reference = _reference(model, inputs)
    eos = int(reference[0, inputs[0].shape[1] + 1])  # row 0's second new token ends it
    expected = _reference(model, inputs, eos_token_id=eos)
    store = MemoryStore()
    _interrupted(model, store, inputs, 4, eos_token_id=eos)
    assert torch.equal(DejaVuEngine(model, store=store).resume("r"), expected)


def test_resuming_with_another_model_is_refused(model, inputs) -> None:
    store = MemoryStore()
    _interrupted(model, store, inputs, 2)
    with pytest.raises(dv.ConfigError, match="layers: stream has 3, model has 4"):
        DejaVuEngine(tiny_llama(layers=4), store=store).resume("r")


def test_missing_or_corrupt_replicas_are_errors(model, inputs) -> None:
    store = MemoryStore()
    _interrupted(model, store, inputs, 3)
    engine = DejaVuEngine(model, store=store)
    victim = store.keys("r")[0]
    from dejavu_sdk.testing.stores import rewrite_record

    rewrite_record(store, victim, lambda data: data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(dv.CorruptBlock):
        engine.resume("r")
    store.records.remove([str(victim)])
    with pytest.raises(dv.BlockNotFound, match="cannot be resumed"):
        engine.resume("r")
    with pytest.raises(dv.BlockNotFound):
        engine.resume("never-started")


def test_forget_and_keep_finished(model, inputs) -> None:
    store = MemoryStore()
    ids, mask = inputs
    engine = DejaVuEngine(model, store=store, keep_finished=True)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, stream_id="kept")
    assert load_manifest(store, "kept").finished
    assert torch.equal(engine.resume("kept"), out)  # a finished stream answers from its manifest
    assert engine.forget("kept") > 0
    assert store.keys() == []


def test_beam_search_is_refused(model, inputs) -> None:
    with pytest.raises(dv.ConfigError, match="beam search"):
        DejaVuEngine(model, store=MemoryStore()).generate(*inputs, max_new_tokens=2, num_beams=2)


def test_blocks_can_go_to_a_remote_cpu_replica_while_the_manifest_stays_local(model, inputs) -> None:
    from dejavu_sdk import open_transport, serve

    ids, mask = inputs
    manifests = MemoryStore()
    with serve("tcp://127.0.0.1:0", MemoryStore()) as replica:
        with pytest.raises(KeyboardInterrupt):
            DejaVuEngine(model, store=manifests, transport=open_transport(replica.url)).generate(
                ids, attention_mask=mask, max_new_tokens=NEW, stream_id="r",
                logits_processor=LogitsProcessorList([Crash(4)]))
        assert replica.store.keys("r")
        assert manifests.keys("r") == []
        resumed = DejaVuEngine(model, store=manifests, transport=open_transport(replica.url)).resume("r")
        assert replica.store.keys("r") == []  # a finished stream is deleted from the replica too
    assert manifests.records.names("") == []  # and its manifest and progress records from the engine's store
    assert torch.equal(resumed, _reference(model, inputs))


STREAMING_SETTINGS = [{"prompt_streaming": "layerwise"}, {"prompt_streaming": "after"},
                      {"replicate_every": 4, "replicate_within_ms": 1e6},
                      {"replicate_every": 4, "replicate_within_ms": 0.001, "prompt_streaming": "after"}]


@pytest.mark.parametrize("engine", STREAMING_SETTINGS, ids=["layerwise", "after", "groups of 4", "groups by time"])
def test_every_streaming_setting_is_recorded_and_resumes_to_the_same_tokens(model, inputs, engine) -> None:
    crash_after = random.Random().randint(1, NEW - 2)
    print(f"crashing after decode step {crash_after}")  # shown if the test fails
    store = MemoryStore()
    _interrupted(model, store, inputs, crash_after, engine=engine)
    manifest = load_manifest(store, "r")
    assert manifest.replicate_every == engine.get("replicate_every", 1)
    assert manifest.replicate_within_ms == engine.get("replicate_within_ms")
    assert manifest.prompt_streaming == engine.get("prompt_streaming", prompt_streaming_for("cpu"))
    assert len(manifest.generated[0]) == crash_after
    assert torch.equal(DejaVuEngine(model, store=store, **engine).resume("r"), _reference(model, inputs))
    assert store.records.names("") == []


@pytest.mark.parametrize(("option", "value"), [("prompt_streaming", "eventually"), ("prompt_streaming", None),
                                               ("replicate_within_ms", 0), ("replicate_within_ms", "10")])
def test_bad_streaming_settings_are_refused(model, option: str, value) -> None:
    with pytest.raises(dv.ConfigError, match=option):
        DejaVuEngine(model, store=MemoryStore(), **{option: value})


def test_auto_streams_the_prompt_layer_by_layer_only_with_something_spare(monkeypatch) -> None:
    import dejavu_sdk.cache as cache_module

    monkeypatch.setattr(cache_module, "usable_cores", lambda: 2)
    monkeypatch.setattr(cache_module.torch, "get_num_threads", lambda: 2)
    assert prompt_streaming_for("cpu") == "after"  # torch's threads take every core
    assert prompt_streaming_for("cuda:0") == "layerwise"  # the forward runs on the device
    monkeypatch.setattr(cache_module.torch, "get_num_threads", lambda: 1)
    assert prompt_streaming_for("cpu") == "layerwise"  # a core is left for the streamer
    assert prompt_streaming_for("cpu", "after") == "after"
    with pytest.raises(dv.ConfigError, match="prompt_streaming"):
        prompt_streaming_for("cpu", "sometimes")


def test_usable_cores_without_cpu_affinity(monkeypatch) -> None:
    """macOS and Windows have no os.sched_getaffinity: every core counts (and "auto" still resolves)."""
    import dejavu_sdk.cache as cache_module

    monkeypatch.delattr(cache_module.os, "sched_getaffinity", raising=False)
    assert 1 <= cache_module.usable_cores() <= (cache_module.os.cpu_count() or 1)
    assert prompt_streaming_for("cpu") in ("layerwise", "after")


def test_a_resumed_run_records_the_settings_it_streams_with(model, inputs) -> None:
    store = MemoryStore()
    _interrupted(model, store, inputs, 3, engine={"prompt_streaming": "after"})
    settings = {"replicate_every": 3, "replicate_within_ms": 50.0, "prompt_streaming": "layerwise"}
    resumed = DejaVuEngine(model, store=store, keep_finished=True, **settings).resume("r")
    assert torch.equal(resumed, _reference(model, inputs))
    manifest = load_manifest(store, "r")
    assert (manifest.replicate_every, manifest.replicate_within_ms, manifest.prompt_streaming) == (3, 50.0,
                                                                                                   "layerwise")


def test_a_model_without_an_end_of_sequence_token_generates(model, inputs) -> None:
    bare = copy.deepcopy(model)
    bare.generation_config.eos_token_id = bare.generation_config.pad_token_id = None
    bare.config.eos_token_id = bare.config.pad_token_id = None
    ids, mask = inputs
    expected = bare.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    store = MemoryStore()
    assert torch.equal(DejaVuEngine(bare, store=store).generate(ids, attention_mask=mask, max_new_tokens=NEW), expected)
    assert store.records.names("") == []
