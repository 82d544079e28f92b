"""Cache operations other than `update`: what the replica cannot follow is refused before the cache changes.

A `StreamingCache`'s replica only grows, position by position, as `update` appends. Cropping, reordering,
selecting or repeating rows, and resetting would make the cache differ from its replica, so each raises
`ConfigError` and leaves the cache (and the replica) as they were; the cache stays usable. `copy.deepcopy`
gives a plain `DynamicCache` that streams nothing.

Every test here fails on the code before these refusals: there, every operation went through silently (the
replica no longer matched the cache), and `copy.deepcopy` raised on the manager's lock.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

import dejavu_sdk as dv
from dejavu_sdk.blocks import dtype_name
from dejavu_sdk.cache import StreamingCache
from dejavu_sdk.models import random_llama
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.stream import gather
from dejavu_sdk.testing import same_bits

PROMPT, NEW, VOCAB = 7, 6, 128


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return random_llama(layers=3, vocab_size=VOCAB, max_positions=256, pad_token_id=None)


@pytest.fixture(scope="module")
def assistant() -> LlamaForCausalLM:
    return random_llama(layers=1, vocab_size=VOCAB, max_positions=256, pad_token_id=None, seed=1)


def _prompt(rows: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, PROMPT), generator=torch.Generator().manual_seed(1))


def _contents(cache: DynamicCache) -> torch.Tensor:
    """The cache as one tensor `[layers, 2, B, H_kv, positions, D]`."""
    return torch.stack([torch.stack((layer.keys, layer.values)) for layer in cache.layers])


def _steps(model, cache: DynamicCache, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    """A custom loop: feed the positions the cache lacks, then `steps` more greedy steps, one position each."""
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(tokens[:, cache.get_seq_length():], cache=cache).logits
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return tokens


def assert_replica_matches(store: dv.Store, stream_id: str, cache: StreamingCache) -> None:
    """Finish the stream, then compare the replica with the cache, bitwise: each stored block with the layers and
    positions it names, and the blocks gathered over the durable positions with the whole cache."""
    durable = cache.manager.finish()
    positions = cache.manager.durable_positions
    assert positions == cache.get_seq_length()  # every position the cache holds has reached the replica
    assert len(set(durable)) == len(durable)
    assert set(store.keys(stream_id)) == set(durable)  # nothing else was stored
    live = _contents(cache)
    for key in durable:
        (l0, l1), (t0, t1) = key.layers, key.tokens
        assert same_bits(store.fetch(key), live[l0:l1, :, :, :, t0:t1]), f"block {key} differs from the cache"
    sample = cache.layers[0].keys
    spec = dv.KVSpec(layers=len(cache.layers), kv_heads=sample.shape[1], head_dim=sample.shape[-1],
                     dtype=dtype_name(sample.dtype), batch=sample.shape[0])
    assert same_bits(gather(store, durable, spec, positions), live)


# ---- generation modes that reorder or roll back the cache --------------------------------------------------
def test_beam_search_is_refused_before_any_row_is_reordered(model) -> None:
    # Before: beam search ran to the end, reordering rows the replica had already stored as they were.
    engine = dv.DejaVuEngine(model, store=MemoryStore())
    cache = engine.cache("beams")
    ids = _prompt(rows=2)
    with pytest.raises(dv.ConfigError, match=r"beam search reorders the cache's rows.*num_beams=1"):
        model.generate(ids, max_new_tokens=NEW, num_beams=2, do_sample=False, cache=cache)
    # The refusal came at the first reorder, right after the prefill: the cache holds the prompt for 2 x 2 beams,
    # each prompt's two beams still side by side as generate laid them out, and the replica holds exactly that.
    assert cache.get_seq_length() == PROMPT
    live = _contents(cache)
    assert live.shape[2] == 4
    assert same_bits(live[:, :, 0::2], live[:, :, 1::2])
    assert_replica_matches(engine.store, "beams", cache)


@pytest.mark.parametrize("drafting", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_decoding_and_prompt_lookup_are_refused_before_the_cache_changes(model, assistant,
                                                                                  drafting: str) -> None:
    # Before: both ran, and crop removed rejected draft positions from the cache but not from the replica, which
    # then held overlapping blocks (T0-8, then T7-9) for positions the cache no longer had.
    engine = dv.DejaVuEngine(model, store=MemoryStore())
    cache = engine.cache("drafts")
    ids = _prompt()
    option = {"assistant_model": assistant} if drafting == "assistant_model" else {drafting: 3}
    with pytest.raises(dv.ConfigError, match=r"rolled back with crop \(assisted decoding, prompt lookup"):
        model.generate(ids, max_new_tokens=NEW, do_sample=False, cache=cache, **option)
    assert cache.get_seq_length() == 0  # refused before the prefill: nothing computed, nothing streamed
    assert engine.store.keys("drafts") == []
    # The cache is still good for greedy decoding, which gives the tokens of an ordinary cache.
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache=cache)
    assert torch.equal(out, model.generate(ids, max_new_tokens=NEW, do_sample=False))
    assert_replica_matches(engine.store, "drafts", cache)


# ---- reset, crop and the other operations, called directly ----------------------------------------------------
def test_reset_is_refused_and_the_cache_goes_on_streaming(model) -> None:
    # Before: reset emptied the cache while its replica kept every position.
    engine = dv.DejaVuEngine(model, store=MemoryStore())
    cache = engine.cache("reset")
    tokens = _steps(model, cache, _prompt(), steps=2)
    before = _contents(cache).clone()
    with pytest.raises(dv.ConfigError, match=r"reset\(\).*it empties the cache.*manager.finish\(\)"):
        cache.reset()
    assert same_bits(_contents(cache), before)
    tokens = _steps(model, cache, tokens, steps=2)  # reuse: the cache goes on, and so does its replica
    assert cache.get_seq_length() == tokens.shape[1] - 1
    assert_replica_matches(engine.store, "reset", cache)


def test_crop_is_refused_even_of_positions_not_yet_durable(model) -> None:
    # Before: crop dropped the last positions of the cache; with replicate_every=4 they sat in the staging
    # buffer, which later left for the replica all the same, under positions the cache then reused.
    engine = dv.DejaVuEngine(model, store=MemoryStore(), replicate_every=4)
    cache = engine.cache("crop")
    tokens = _steps(model, cache, _prompt(), steps=2)  # the prompt's blocks, then 2 steps in the staging buffer
    before = _contents(cache).clone()
    with pytest.raises(dv.ConfigError, match=r"crop\(-2\).*assisted decoding.*copy.deepcopy"):
        cache.crop(-2)
    assert same_bits(_contents(cache), before)
    cache.crop(0)  # removes no position: allowed
    assert same_bits(_contents(cache), before)
    assert not cache.is_croppable  # so transformers never plans a rollback on it
    tokens = _steps(model, cache, tokens, steps=3)
    assert_replica_matches(engine.store, "crop", cache)
    assert cache.manager.durable_positions == PROMPT + 6


REFUSED = [
    ("reorder_cache", (torch.tensor([1, 0]),), r"beam search reorders"),
    ("batch_select_indices", (torch.tensor([1]),), r"keeps only some of the cache's rows"),
    ("batch_repeat_interleave", (2,), r"repeats the cache's rows"),
    ("crop", (3,), r"crop\(3\)"),
    ("activate_past_recording", (), r"rolled back with crop"),
    ("update_conv_state", (torch.zeros(2, 4, 3), 0), r"attention keys and values only"),
    ("update_recurrent_state", (torch.zeros(2, 4, 3), 0), r"attention keys and values only"),
    ("update_indexer", (torch.zeros(2, 1, 8), 0), r"attention keys and values only"),
]


@pytest.mark.parametrize(("operation", "args", "message"), REFUSED, ids=[entry[0] for entry in REFUSED])
def test_every_other_mutating_operation_is_refused_and_reading_still_works(model, operation: str, args,
                                                                           message: str) -> None:
    # Before: each of these changed the cache without the replica knowing (the update_* methods raised a plain
    # ValueError, not a ConfigError, on attention layers).
    engine = dv.DejaVuEngine(model, store=MemoryStore())
    cache = engine.cache("ops")
    tokens = _steps(model, cache, _prompt(rows=2), steps=1)
    before = _contents(cache).clone()
    with pytest.raises(dv.ConfigError, match=message):
        getattr(cache, operation)(*args)
    assert same_bits(_contents(cache), before)
    assert not any(getattr(layer, "record_past", False) for layer in cache.layers)
    assert cache.get_seq_length() == PROMPT + 1  # reading works as before
    assert cache.get_mask_sizes(1, 0) == (PROMPT + 2, 0)
    assert len(list(cache)) == len(cache) == model.config.num_hidden_layers
    _steps(model, cache, tokens, steps=1)
    assert_replica_matches(engine.store, "ops", cache)


# ---- deepcopy: a plain DynamicCache --------------------------------------------------------------------------
def test_deepcopy_mid_generation_is_an_independent_dynamic_cache(model) -> None:
    # Before: copy.deepcopy raised TypeError, the manager's lock cannot be copied.
    engine = dv.DejaVuEngine(model, store=MemoryStore())
    cache = engine.cache("prompt")
    prefix = _steps(model, cache, _prompt(), steps=2)
    clone = copy.deepcopy(cache)
    assert type(clone) is DynamicCache
    assert not hasattr(clone, "manager")
    assert same_bits(_contents(clone), _contents(cache))
    assert all(mine.keys.data_ptr() != theirs.keys.data_ptr() for mine, theirs in zip(clone.layers, cache.layers,
                                                                                         strict=True))
    before = _contents(cache).clone()

    # transformers' prompt-reuse recipe: generate from a copy of the prompt's cache. It streams nothing, leaves
    # the original alone, and gives what a copied DynamicCache gives.
    reference = DynamicCache(config=model.config)
    _steps(model, reference, _prompt(), steps=2)
    longer = torch.cat([prefix, torch.tensor([[5, 6, 7]])], dim=1)
    out = model.generate(longer, max_new_tokens=NEW, do_sample=False, cache=clone)
    assert torch.equal(out, model.generate(longer, max_new_tokens=NEW, do_sample=False,
                                           cache=copy.deepcopy(reference)))
    assert clone.get_seq_length() > cache.get_seq_length()
    clone.crop(-2)  # a plain DynamicCache may be rolled back
    assert same_bits(_contents(cache), before)

    _steps(model, cache, prefix, steps=2)  # the original streams on, and its replica is still exact
    assert_replica_matches(engine.store, "prompt", cache)
    # The copy's longer generation wrote nothing anywhere: every stored block is one the original streamed
    # (read once the stream has finished: blocks reach the store after the step that made them).
    assert set(engine.store.keys()) == set(cache.manager.durable)


# ---- torch.export ------------------------------------------------------------------------------------------
class _WithCache(torch.nn.Module):
    def __init__(self, model, cache) -> None:
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, cache=self.cache, use_cache=True).logits


def test_torch_export_of_a_streaming_cache_is_refused(model) -> None:
    # Before: the trace handed fake tensors to the streamer thread, which failed with an obscure ReplicationError
    # (or a fake-tensor assertion) while the cache kept fake positions.
    engine = dv.DejaVuEngine(model, store=MemoryStore())
    cache = engine.cache("export")
    with torch.no_grad(), pytest.raises(dv.ConfigError, match=r"torch\.export is tracing a StreamingCache"):
        torch.export.export(_WithCache(model, cache), (_prompt(),), strict=False)
    assert cache.get_seq_length() == 0
    assert cache.manager.finish() == []
    assert engine.store.keys("export") == []
