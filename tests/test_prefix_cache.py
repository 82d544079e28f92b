"""Prompt prefixes from the KV tiers: a prompt started from cached chunks gives exactly the tokens of the same
prompt prefilled chunk by chunk from its first position; tiers evict least recently used chunks within their bytes,
copy a lower tier's hit up, treat a damaged chunk as a miss, keep tenants apart, and outlive the process (LMDB)."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import pytest
import torch
from tiny_models import Crash

import dejavu_sdk as dv
from dejavu_sdk.blocks import KVSpec
from dejavu_sdk.codec import encode_block
from dejavu_sdk.engine import DejaVuEngine
from dejavu_sdk.models import random_llama
from dejavu_sdk.prefix import PrefixCache, PrefixIdentity
from dejavu_sdk.prefix.tiers import tier_url

CHUNK = 16
NEW = 8


@pytest.fixture(scope="module")
def model():
    return random_llama(layers=3)


def _prompt(length: int, seed: int, head: torch.Tensor | None = None) -> torch.Tensor:
    ids = torch.randint(1, 96, (1, length), generator=torch.Generator().manual_seed(seed))
    if head is not None:
        ids[:, :head.shape[1]] = head
    return ids


def _reference(model, ids: torch.Tensor, **settings) -> torch.Tensor:
    """`model.generate` prefilling chunk by chunk at the cache's boundaries, without any cache."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, prefill_chunk_size=CHUNK,
                          **settings)


def _engine(model, tiers, **options) -> DejaVuEngine:
    return DejaVuEngine(model, prefix_cache=tiers, prefix_chunk=CHUNK, **options)


def test_a_prompt_read_from_the_cache_gives_the_tokens_it_gave_computed(model) -> None:
    first = _prompt(50, seed=1)
    sharing = _prompt(40, seed=2, head=first[:, :20])  # shares one whole chunk and 4 more tokens
    with _engine(model, "memory://") as engine:
        cold = engine.generate(first, max_new_tokens=NEW)
        assert engine.cached_positions == 0
        engine.prefix.cache.drain()
        warm = engine.generate(first, max_new_tokens=NEW)
        assert engine.cached_positions == 48  # 3 whole chunks; the 49th position onwards is computed
        engine.prefix.cache.drain()
        shared = engine.generate(sharing, max_new_tokens=NEW)
        assert engine.cached_positions == 16
    assert torch.equal(cold, _reference(model, first))
    assert torch.equal(warm, cold)
    assert torch.equal(shared, _reference(model, sharing))


def test_a_prompt_of_whole_chunks_leaves_its_last_chunk_to_compute(model) -> None:
    ids = _prompt(48, seed=3)
    with _engine(model, "memory://") as engine:
        engine.generate(ids, max_new_tokens=NEW)
        engine.prefix.cache.drain()
        again = engine.generate(ids, max_new_tokens=NEW)
        assert engine.cached_positions == 32  # the first token's logits need a prompt position computed
    assert torch.equal(again, _reference(model, ids))


def test_sampled_generation_with_a_hit_equals_the_seeded_reference(model) -> None:
    ids = _prompt(45, seed=4)
    settings = {"do_sample": True, "temperature": 0.9, "top_k": 20}
    with _engine(model, "memory://") as engine:
        engine.generate(ids, max_new_tokens=NEW, seed=7, **settings)
        engine.prefix.cache.drain()
        sampled = engine.generate(ids, max_new_tokens=NEW, seed=7, **settings)
        assert engine.cached_positions == 32
    torch.manual_seed(7)
    assert torch.equal(sampled, _reference(model, ids, **settings))


def test_a_batch_reads_what_every_row_finds_and_a_padded_batch_reads_nothing(model) -> None:
    long, short = _prompt(50, seed=5), _prompt(50, seed=6)
    batch = torch.cat([long, short])
    with _engine(model, "memory://") as engine:
        engine.generate(long, max_new_tokens=NEW)
        engine.generate(short[:, :20], max_new_tokens=NEW)  # keeps one chunk of the second row
        engine.prefix.cache.drain()
        both = engine.generate(batch, max_new_tokens=NEW)
        assert engine.cached_positions == 16
        mask = torch.ones_like(batch)
        mask[1, :3] = 0
        padded = engine.generate(batch, attention_mask=mask, max_new_tokens=NEW)
        assert engine.cached_positions == 0
    assert torch.equal(both, model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=NEW,
                                            prefill_chunk_size=CHUNK))
    assert torch.equal(padded, model.generate(batch, attention_mask=mask, max_new_tokens=NEW,
                                              prefill_chunk_size=CHUNK))


def test_tenants_with_other_salts_share_nothing(model) -> None:
    ids = _prompt(40, seed=8)
    with _engine(model, "memory://") as engine:
        engine.generate(ids, max_new_tokens=NEW, cache_salt="tenant-a")
        engine.prefix.cache.drain()
        engine.generate(ids, max_new_tokens=NEW, cache_salt="tenant-b")
        assert engine.cached_positions == 0
        engine.prefix.cache.drain()
        engine.generate(ids, max_new_tokens=NEW, cache_salt="tenant-a")
        assert engine.cached_positions == 32


def test_another_model_finds_none_of_the_chunks(model) -> None:
    ids = _prompt(40, seed=9)
    store = dv.open_store("memory://")
    with _engine(model, store) as engine:
        engine.generate(ids, max_new_tokens=NEW)
    with _engine(random_llama(layers=3, seed=1), store) as other:  # same shapes, other weights
        other.generate(ids, max_new_tokens=NEW)
        assert other.cached_positions == 0
    store.close()


def test_a_restarted_engine_reads_the_chunks_kept_in_lmdb(model, tmp_path) -> None:
    ids = _prompt(50, seed=10)
    url = f"lmdb://{tmp_path}/kv"
    with _engine(model, ["memory://", url]) as engine:
        cold = engine.generate(ids, max_new_tokens=NEW)
    with _engine(model, ["memory://", url]) as engine:  # a new process's view: only LMDB holds the chunks
        warm = engine.generate(ids, max_new_tokens=NEW)
        assert engine.cached_positions == 48
        memory, disk = engine.prefix.cache.stats()
        assert (memory["hits"], memory["misses"], disk["hits"]) == (0, 3, 3)
        engine.prefix.cache.drain()
        assert engine.prefix.cache.stats()[0]["chunks"] == 3  # copied up on the way
        engine.generate(ids, max_new_tokens=NEW)
        assert engine.prefix.cache.stats()[0]["hits"] == 3
    assert torch.equal(warm, cold)


def test_file_and_s3_tiers_keep_chunks_exact(model, tmp_path, s3_options) -> None:
    ids = _prompt(40, seed=11)
    bucket = dv.open_store(f"s3://dejavu-tests/{uuid.uuid4().hex}", storage_options=s3_options)
    for tier in (f"file://{tmp_path}/chunks", bucket):
        with _engine(model, tier) as engine:
            engine.generate(ids, max_new_tokens=NEW)
        with _engine(model, tier) as engine:
            warm = engine.generate(ids, max_new_tokens=NEW)
            assert engine.cached_positions == 32
        assert torch.equal(warm, _reference(model, ids))
    bucket.close()


def _spec(model) -> KVSpec:
    config = model.config
    return KVSpec(layers=config.num_hidden_layers, kv_heads=config.num_key_value_heads,
                  head_dim=config.hidden_size // config.num_attention_heads, dtype="float32")


def _chunk(spec: KVSpec, value: float) -> torch.Tensor:
    return torch.full(spec.shape(spec.layers, CHUNK), value, dtype=torch.float32)


def test_a_tier_drops_its_least_recently_used_chunks_beyond_its_bytes(model, tmp_path) -> None:
    spec = _spec(model)
    identity = PrefixIdentity.of(model, CHUNK)
    size = _chunk(spec, 0).numel() * 4
    keys = [identity.keys(_prompt(CHUNK, seed=20 + i)[0].tolist(), (0, spec.layers))[0] for i in range(4)]
    with PrefixCache([f"memory://?max_bytes={2 * size}", f"lmdb://{tmp_path}/kv"], spec) as cache:
        cache.write([(keys[0], _chunk(spec, 0)), (keys[1], _chunk(spec, 1))])
        cache.drain()
        assert len(cache.read([keys[0]])) == 1  # keys[0] is now the most recently used
        cache.write([(keys[2], _chunk(spec, 2))])
        cache.drain()
        memory, disk = cache.tiers
        assert list(memory.entries) == [keys[0], keys[2]]
        assert (memory.held, memory.evictions) == (2 * size, 1)
        assert (len(disk.entries), disk.evictions) == (3, 0)
        assert cache.read([keys[1]])[0].eq(1).all()  # from the disk, and copied up, pushing keys[0] out
        assert list(memory.entries) == [keys[2], keys[1]]
        assert cache.read([keys[3], keys[0]]) == []  # a prefix stops at its first chunk found nowhere


def test_a_damaged_or_misshapen_chunk_is_a_miss_and_the_tokens_stay_exact(model) -> None:
    ids = _prompt(40, seed=12)
    store = dv.open_store("memory://")
    with _engine(model, store) as engine:
        engine.generate(ids, max_new_tokens=NEW)
    first, second = PrefixIdentity.of(model, CHUNK).keys(ids[0].tolist(), (0, 3))[:2]
    record = encode_block(second, store.fetch(second)).copy()
    record[-10] ^= 0xFF  # one flipped byte: the checksum no longer holds
    store.records.put_records([(str(second), record)])
    with _engine(model, store) as engine:
        damaged = engine.generate(ids, max_new_tokens=NEW)
        assert engine.cached_positions == 16
        assert engine.prefix.cache.stats()[0]["corrupt"] == 1
    store.flush(first, torch.zeros(3, 2, 1, 2, CHUNK + 1, 16))  # a record of another shape under the key
    with _engine(model, store) as engine:
        misshapen = engine.generate(ids, max_new_tokens=NEW)
        assert engine.cached_positions == 0
    assert torch.equal(damaged, _reference(model, ids))
    assert torch.equal(misshapen, damaged)
    store.close()


def test_a_replicated_generation_with_a_hit_resumes_exactly_after_a_crash(model, tmp_path) -> None:
    ids = _prompt(50, seed=13)
    replicas = f"lmdb://{tmp_path}/replicas"
    with _engine(model, "memory://", store=replicas) as engine:
        engine.generate(ids, max_new_tokens=NEW, stream_id="warm-up")
        engine.prefix.cache.drain()
        with pytest.raises(KeyboardInterrupt):
            engine.generate(ids, max_new_tokens=NEW, stream_id="s", logits_processor=[Crash(after_steps=3)])
        assert engine.cached_positions == 48
    with DejaVuEngine(model, store=replicas) as engine:
        resumed = engine.resume("s")
    assert torch.equal(resumed, _reference(model, ids))


@pytest.mark.parametrize(("tiers", "match"), [
    ([], "at least one tier"),
    ("memory://?max=1", "one option"),
    ("memory://?max_bytes=lots", "not a size"),
    ([3], "store URL or a Store"),
])
def test_bad_tiers_are_refused(model, tiers, match) -> None:
    with pytest.raises(dv.ConfigError, match=match):
        _engine(model, tiers)


def test_bad_salts_chunks_and_chunk_sizes_are_refused(model) -> None:
    with pytest.raises(dv.ConfigError, match="positive number"):
        DejaVuEngine(model, prefix_cache="memory://", prefix_chunk=0)
    with _engine(model, "memory://") as engine:
        with pytest.raises(dv.ConfigError, match="salt is a str"):
            engine.generate(_prompt(20, seed=1), max_new_tokens=2, cache_salt=5)
        with pytest.raises(dv.ConfigError, match="prefill_chunk_size"):
            engine.generate(_prompt(20, seed=1), max_new_tokens=2, prefill_chunk_size=8)
    assert tier_url("lmdb:///kv?max_bytes=2GiB") == ("lmdb:///kv", 2 << 30)


def test_chunks_kept_by_another_process_are_read_here(model, tmp_path) -> None:
    ids = _prompt(40, seed=14)
    url = f"lmdb://{tmp_path}/kv"
    script = ("import torch\nfrom dejavu_sdk.engine import DejaVuEngine\nfrom dejavu_sdk.models import random_llama\n"
              f"with DejaVuEngine(random_llama(layers=3), prefix_cache={url!r}, prefix_chunk={CHUNK}) as engine:\n"
              f"    engine.generate(torch.tensor({ids.tolist()}), max_new_tokens=2)\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with _engine(model, url) as engine:
        warm = engine.generate(ids, max_new_tokens=NEW)
        assert engine.cached_positions == 32
    assert torch.equal(warm, _reference(model, ids))


def test_engines_share_chunks_through_a_store_server(model) -> None:
    ids = _prompt(40, seed=15)
    with dv.serve("tcp://127.0.0.1:0", "memory://") as server:
        with _engine(model, server.url) as engine:
            engine.generate(ids, max_new_tokens=NEW)
        with _engine(model, server.url) as engine:
            warm = engine.generate(ids, max_new_tokens=NEW)
            assert engine.cached_positions == 32
    assert torch.equal(warm, _reference(model, ids))


def test_a_chunk_asked_to_be_written_is_read_before_it_lands(model) -> None:
    spec = _spec(model)
    key = PrefixIdentity.of(model, CHUNK).keys(_prompt(CHUNK, seed=30)[0].tolist(), (0, spec.layers))[0]
    gate = threading.Event()
    store = dv.open_store("memory://")
    landing = store.flush
    store.flush = lambda key, block: (gate.wait(10), landing(key, block))  # a slow tier
    with PrefixCache(store, spec) as cache:
        cache.write([(key, _chunk(spec, 3))])
        assert cache.read([key])[0].eq(3).all()
        assert (cache.waiting_hits, cache.tiers[0].writes) == (1, 0)
        gate.set()
        assert cache.drain()
        assert cache.read([key])[0].eq(3).all()
        assert (cache.waiting_hits, cache.tiers[0].hits) == (1, 1)
    store.close()


def test_a_tier_that_cannot_be_reached_is_a_miss_and_the_request_goes_on(model) -> None:
    ids = _prompt(40, seed=16)
    server = dv.serve("tcp://127.0.0.1:0", "memory://")
    with _engine(model, server.url) as engine:
        engine.generate(ids, max_new_tokens=NEW)
        assert engine.prefix.cache.drain()
        server.close()
        alone = engine.generate(ids, max_new_tokens=NEW)
        assert engine.cached_positions == 0
        assert engine.prefix.cache.stats()[0]["errors"] == 1  # the first chunk's read; the prefix stops there
    assert torch.equal(alone, _reference(model, ids))
