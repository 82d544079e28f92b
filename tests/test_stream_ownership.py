"""A stream id names one generation at a time, and a resume uses only the blocks of the run its manifest names.

Each `generate` is a run with its own id, written into its manifest and into every block name it streams, so
two generations started under one stream id (two processes, different prompts) never write the same block
names, and a manifest naming blocks of another stream or run is refused as corrupt, never resumed from.

Every test here fails on the code before runs existed (noted in each): `generate` then took no `replace`
and overwrote any stream; block names carried no run, so a second run overwrote the first's blocks and a
resume mixed both; the manifest (format 1) named any blocks, and was read without a format check of runs.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import Crash, tiny_llama
from transformers import LlamaForCausalLM, LogitsProcessorList

import dejavu_sdk as dv
from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.manifest import Manifest, load_manifest
from dejavu_sdk.store import manifest_name
from dejavu_sdk.stores import MemoryStore

NEW = 10
STREAM = "req-1"


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(layers=3)


def _prompt(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


FIRST, SECOND = _prompt(11), _prompt(12)


def _reference(model, prompt) -> torch.Tensor:
    ids, mask = prompt
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)


def _crashed(model, store, prompt, after_steps: int, stream_id: str = STREAM, **options) -> Manifest:
    """Start a generation of `prompt` that dies after `after_steps` decode steps; return the manifest it left."""
    ids, mask = prompt
    with pytest.raises(KeyboardInterrupt):
        DejaVuEngine(model, store=store).generate(ids, attention_mask=mask, max_new_tokens=NEW, stream_id=stream_id,
                                                  logits_processor=LogitsProcessorList([Crash(after_steps)]),
                                                  **options)
    return load_manifest(store, stream_id)


def _drop_manifest(store, stream_id: str = STREAM) -> None:
    """Remove only the manifest: what a second process that started at the same moment saw (none yet)."""
    store.records.remove([manifest_name(stream_id)])


# (1) Before: generate had no notion of an existing stream; it overwrote it (and passed replace= on to
# model.generate, which refuses unknown arguments), so the ConfigError expected here was never raised.
def test_generate_refuses_a_stream_that_is_still_unfinished(model) -> None:
    store = MemoryStore()
    _crashed(model, store, FIRST, 4)
    ids, mask = SECOND
    with pytest.raises(dv.ConfigError, match="unfinished") as refused:
        DejaVuEngine(model, store=store).generate(ids, attention_mask=mask, max_new_tokens=NEW, stream_id=STREAM)
    assert "resume" in str(refused.value)
    assert "forget" in str(refused.value)
    assert "replace=True" in str(refused.value)
    replaced = _crashed(model, store, SECOND, 3, replace=True)  # forgets the first run, then starts over
    assert replaced.input_ids == ids.tolist()
    assert {key.run for key in store.keys(STREAM)} == {replaced.run}  # nothing of the first run is left
    assert torch.equal(DejaVuEngine(model, store=store).resume(STREAM), _reference(model, SECOND))
    assert store.keys() == []


def test_a_stream_of_format_3_resumes(model) -> None:
    """Format 4 added how far the replica may lag; a stream the SDK before it left behind resumes as it was."""
    store = MemoryStore()
    _crashed(model, store, FIRST, 4)
    old = json.loads(store.read_manifest(STREAM))  # as written, before its progress log
    del old["replicate_within_ms"], old["prompt_streaming"]
    old["format"] = 3
    store.write_manifest(STREAM, json.dumps(old).encode())
    assert torch.equal(DejaVuEngine(model, store=store).resume(STREAM), _reference(model, FIRST))


def test_generate_refuses_a_kept_finished_stream_unless_replacing_it(model) -> None:
    store = MemoryStore()
    engine = DejaVuEngine(model, store=store, keep_finished=True)
    kept = engine.generate(*FIRST, max_new_tokens=NEW, stream_id=STREAM)
    with pytest.raises(dv.ConfigError, match="finished generation kept with keep_finished=True") as refused:
        engine.generate(*SECOND, max_new_tokens=NEW, stream_id=STREAM)
    assert "replace=True" in str(refused.value)
    assert torch.equal(engine.resume(STREAM), kept)  # the kept result is intact
    again = engine.generate(*SECOND, max_new_tokens=NEW, stream_id=STREAM, replace=True)
    assert torch.equal(again, _reference(model, SECOND))
    assert torch.equal(engine.resume(STREAM), again)


# (2) Before: both runs wrote blocks under the same names (req-1/L0-1.T0-6, ...), so the other run's writes
# replaced blocks the last manifest names, and resume fed that run's tokens through the other prompt's KV: the
# tokens matched neither run (checked against the code before this change for both step counts below). Now
# the names differ per run, and resume reads only the blocks of the run whose manifest it read.
@pytest.mark.parametrize(("winner_steps", "other_steps"), [(3, 6), (6, 3)])
def test_two_runs_interleaved_on_one_stream_resume_exactly_the_run_whose_manifest_was_written_last(
        model, winner_steps, other_steps) -> None:
    store = MemoryStore()
    # Two processes start req-1 at once (different prompts) and both see no manifest. In this replay the
    # winner streams its blocks and dies; the other run's blocks land after them (its generate is replayed
    # with no manifest in the store, as it saw at its start) and it dies too; the winner's manifest is written
    # last (as if its generate had written it a moment after the other's).
    winner = _crashed(model, store, SECOND, winner_steps)
    written = store.read_manifest(STREAM)
    _drop_manifest(store)
    other = _crashed(model, store, FIRST, other_steps)
    store.write_manifest(STREAM, written)
    assert winner.run != other.run
    assert not set(winner.blocks) & set(other.blocks)  # never one name for blocks of two runs
    resumed = DejaVuEngine(model, store=store).resume(STREAM)
    assert torch.equal(resumed, _reference(model, SECOND))
    assert not torch.equal(resumed, _reference(model, FIRST))
    # Finishing deleted the winner's blocks and manifest; the other run's blocks stay until forget.
    assert {key.run for key in store.keys(STREAM)} == {other.run}
    with pytest.raises(dv.BlockNotFound):
        store.read_manifest(STREAM)
    assert DejaVuEngine(model, store=store).forget(STREAM) == len(other.blocks)


# (3) Before: a manifest's block names were followed wherever they pointed, so another stream's blocks were
# fetched (they pass their own checksum) and resumed from; and names carried no run to compare.
def test_a_manifest_naming_another_streams_blocks_is_corrupt(model) -> None:
    store = MemoryStore()
    ours = _crashed(model, store, FIRST, 4)
    theirs = _crashed(model, store, SECOND, 4, stream_id="req-2")
    forged = json.loads(ours.to_bytes())
    forged["blocks"] = theirs.blocks
    store.write_manifest(STREAM, json.dumps(forged).encode())
    with pytest.raises(dv.CorruptBlock, match=r"blocks\[0\].*req-2") as raised:
        DejaVuEngine(model, store=store).resume(STREAM)
    assert theirs.blocks[0] in str(raised.value)


def test_a_manifest_naming_another_runs_blocks_is_corrupt(model) -> None:
    store = MemoryStore()
    other = _crashed(model, store, FIRST, 4)
    _drop_manifest(store)
    ours = _crashed(model, store, SECOND, 4)
    mixed = json.loads(ours.to_bytes())
    mixed["blocks"] = [*ours.blocks[:3], *other.blocks[3:]]  # our prefill, the other run's decode steps
    store.write_manifest(STREAM, json.dumps(mixed).encode())
    with pytest.raises(dv.CorruptBlock, match=rf"blocks\[3\].*run {other.run}, not of this manifest's run {ours.run}"):
        DejaVuEngine(model, store=store).resume(STREAM)


def test_a_record_of_another_run_stored_under_our_name_fails_its_label_check(model) -> None:
    store = MemoryStore()
    other = _crashed(model, store, FIRST, 4)
    _drop_manifest(store)
    ours = _crashed(model, store, SECOND, 4)
    with store.records.get_record(other.blocks[0]) as record:  # the same layers and positions, another run
        foreign = bytes(record)
    store.records.put_records([(ours.blocks[0], bytearray(foreign))])
    with pytest.raises(dv.CorruptBlock, match="the record holds block"):
        DejaVuEngine(model, store=store).resume(STREAM)


# (4) Before: format 1 was the format, read without a run; now a format-1 manifest (whose blocks carry no run)
# is refused, as is any other format, with a ConfigError naming both formats and how to clear the stream.
# Format 2 (a manifest rewritten whole at every step, without a progress log) is refused the same way.
@pytest.mark.parametrize("version", [1, 2, 5])
def test_manifests_of_other_formats_are_refused(model, version) -> None:
    store = MemoryStore()
    manifest = _crashed(model, store, FIRST, 4)
    old = json.loads(manifest.to_bytes())
    old["format"] = version
    if version <= 2:  # as the SDK before progress logs wrote it
        del old["log"]
    if version == 1:  # as the SDK before runs wrote it
        del old["run"]
        old["blocks"] = [name.replace(f"/r{manifest.run}.", "/") for name in manifest.blocks]
    store.write_manifest(STREAM, json.dumps(old).encode())
    engine = DejaVuEngine(model, store=store)
    with pytest.raises(dv.ConfigError, match=f"manifest format {version}; this SDK reads formats 3 and 4") as refused:
        engine.resume(STREAM)
    assert "forget" in str(refused.value)
    with pytest.raises(dv.ConfigError, match="cannot resume"):  # generate does not silently overwrite it either
        engine.generate(*FIRST, max_new_tokens=NEW, stream_id=STREAM)
    assert torch.equal(engine.generate(*FIRST, max_new_tokens=NEW, stream_id=STREAM, replace=True),
                       _reference(model, FIRST))
    assert store.keys() == []
