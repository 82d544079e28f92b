"""The progress log: a decode step writes one block and one small progress record, the same size at the
first step and the thousandth, and a stream resumes exactly from its manifest and log, however often it
crashes and whatever a crash leaves of an older log."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from tiny_models import Crash, tiny_llama
from transformers import LogitsProcessorList

from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.manifest import load_manifest
from dejavu_sdk.records import NamedRecord
from dejavu_sdk.store import Store, block_key_or_none, manifest_name, progress_key_or_none
from dejavu_sdk.stores.memory import MemoryRecords

NEW = 12
SAMPLED = {"do_sample": True, "temperature": 0.9, "top_k": 40}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=3)


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    return ids, torch.ones_like(ids)


class CountingRecords(MemoryRecords):
    """Memory records that remember every batch put: its records' names and sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[str, int]]] = []

    def put_records(self, records: Sequence[NamedRecord]) -> None:
        self.batches.append([(name, memoryview(record).nbytes) for name, record in records])
        super().put_records(records)


def _reference(model, inputs, new: int = NEW, seed: int | None = None, **extra) -> torch.Tensor:
    if seed is not None:
        torch.manual_seed(seed)
    settings = SAMPLED if seed is not None else {"do_sample": False}
    return model.generate(inputs[0], attention_mask=inputs[1], max_new_tokens=new, **settings, **extra)


def _crash(call, steps: int) -> None:
    with pytest.raises(KeyboardInterrupt):
        call(logits_processor=LogitsProcessorList([Crash(steps)]))


def test_a_decode_step_writes_one_block_and_one_record_of_the_same_size_early_and_late(model, inputs) -> None:
    records = CountingRecords()
    new = 120
    out = DejaVuEngine(model, store=Store(records), keep_finished=True).generate(
        *inputs, max_new_tokens=new, min_new_tokens=new, stream_id="long", seed=1, **SAMPLED)
    assert torch.equal(out, _reference(model, inputs, new, seed=1, min_new_tokens=new))
    written = [batch for batch in records.batches if _kind(batch[0][0]) == "block"]
    for batch in written:  # each block and its progress record (several when they waited together), nothing else
        assert [_kind(name) for name, _ in batch] == ["block", "progress"] * (len(batch) // 2)
    steps = [(block, record) for batch in written for block, record in zip(batch[::2], batch[1::2], strict=True)
             if _is_decode_block(block[0])]
    assert len(steps) == new - 1  # the last token's KV is never computed
    sizes = [size for _, (_, size) in steps]
    # A record holds the tokens since the previous one (usually one per row) and the generator state after
    # them: the last records are no bigger than the first, bar more digits in the positions and the block's
    # name, and token ids of up to 5 digits each (a log that kept every token would add ~1 KB by now).
    assert max(sizes[-20:]) <= max(sizes[:20]) + 64, sizes
    manifest_writes = [batch for batch in records.batches if _kind(batch[0][0]) == "manifest"]
    assert len(manifest_writes) == 2  # once at the start, once finished


def _is_decode_block(name: str) -> bool:
    key = block_key_or_none(name)
    return key is not None and key.num_layers == 3  # a decode step's block holds every layer


def _kind(name: str) -> str:
    if block_key_or_none(name):
        return "block"
    if progress_key_or_none(name):
        return "progress"
    return "manifest" if name == manifest_name("long") else name


@pytest.mark.parametrize("seed", [None, 5])
def test_a_stream_that_crashes_again_while_resuming_still_resumes_exactly(model, inputs, seed) -> None:
    store = Store(MemoryRecords())
    sampling = {"seed": seed, **SAMPLED} if seed is not None else {}
    _crash(lambda **crash: DejaVuEngine(model, store=store).generate(*inputs, max_new_tokens=NEW, stream_id="s",
                                                                     **sampling, **crash), 3)
    _crash(lambda **crash: DejaVuEngine(model, store=store).resume("s", **crash), 4)
    assert len(load_manifest(store, "s").generated[0]) == 7
    assert {key.log for key in store.progress_keys("s")} == {1}  # the resume started a new log
    assert torch.equal(DejaVuEngine(model, store=store).resume("s"), _reference(model, inputs, seed=seed))
    assert store.records.names("") == []


def test_records_of_an_older_log_that_a_crash_left_behind_are_ignored(model, inputs) -> None:
    store = Store(MemoryRecords())
    _crash(lambda **crash: DejaVuEngine(model, store=store).generate(*inputs, max_new_tokens=NEW, stream_id="s",
                                                                     seed=2, **SAMPLED, **crash), 5)
    old_log = {key: store.read_progress(key) for key in store.progress_keys("s")}
    _crash(lambda **crash: DejaVuEngine(model, store=store).resume("s", **crash), 2)
    for key, record in old_log.items():  # as if the resume died between rewriting the manifest and removing them
        store.put_progress(key, record)
    assert len(load_manifest(store, "s").generated[0]) == 7  # not 5 + 5 + 2: the old log is not applied again
    assert torch.equal(DejaVuEngine(model, store=store).resume("s"), _reference(model, inputs, seed=2))
