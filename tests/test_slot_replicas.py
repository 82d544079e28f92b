"""A slot's replica: the pieces a stage writes as rows join and leave rebuild, at every round boundary, exactly the
cache the slot holds then (`trace` + `gather`), from the slot's start or from a base a recovery wrote; for models
with sliding-window layers too, whose layers hold only their window's last positions."""

from __future__ import annotations

import expectations
import pytest
import tiny_models
import torch
from transformers import DynamicCache

import dejavu_sdk as dv
from dejavu_sdk.generation.batching import left_pad
from dejavu_sdk.generation.slots import Joining, SlotRows, leave, stack
from dejavu_sdk.serving.kv.replication import Replicator, assemble, cache_from
from dejavu_sdk.serving.kv.slot_replicas import (
    JoiningAt,
    SlotBase,
    SlotPieces,
    SlotReplicas,
    gather,
    kv_block,
    piece_stream,
    trace,
)
from dejavu_sdk.swapping import kv_bytes_per_token

PROMPTS = expectations.prompts(10, seed=3)
LIMITS = [1 + (3 * index + 1) % 8 for index in range(10)]


def _schedule(model):
    """A slot's rounds with rows joining (prefilled a few columns at a time) and leaving, and its prompts."""
    budget = 3 * 12 * kv_bytes_per_token(model.config, torch.float32)  # one slot of three rows at a time
    results = dv.DejaVuEngine(model).generate_many(PROMPTS, LIMITS, microbatch=3, batching="continuous",
                                                   max_prefill_tokens=3, kv_budget_bytes=budget)
    rounds = max((result.schedule for result in results), key=len)  # a result's: up to its row's end
    prompts = {result.request: prompt for result, prompt in zip(results, PROMPTS, strict=True)}
    return list(rounds), prompts


def _blocks(store, pieces, layers):
    return {piece.name: assemble(store, piece_stream(0, 0, piece.name), layers, piece.columns)
            for piece in pieces if piece.columns}


def _same(block: torch.Tensor, cache: DynamicCache, config) -> bool:
    """Whether the cache built from `block` (as a replacement builds it) holds exactly what `cache` holds, layer by
    layer: the same positions, keys and values (a sliding-window layer: its window's)."""
    rebuilt = cache_from(block, config)
    return all(torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
               and mine.get_seq_length() == theirs.get_seq_length()
               for mine, theirs in zip(rebuilt.layers, cache.layers, strict=True))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2_sliding"])
def test_the_pieces_rebuild_the_slot_cache_at_every_round_from_its_start_and_from_a_base(family: str) -> None:
    model = getattr(tiny_models, family)()
    rounds, prompts = _schedule(model)
    assert any(step.left for step in rounds)
    assert any(step.joined for step in rounds)
    pad = model.config.pad_token_id or 0

    def mask_of(members):
        return left_pad([prompts[member] for member in members], pad)[1]

    store, layers = dv.open_store("memory://"), model.config.num_hidden_layers
    writer = SlotReplicas(Replicator(store, 0, layers))
    pieces = SlotPieces()
    cache, rows = DynamicCache(config=model.config), SlotRows()
    group: Joining | None = None
    started = None
    ready = None
    tokens: dict[int, int] = {}
    base: SlotBase | None = None
    checked, windowed = 0, False

    def forward(inputs, mask, positions, into):
        return model(input_ids=inputs, attention_mask=mask, position_ids=positions, cache=into,
                     use_cache=True).logits[:, -1, :]

    with torch.no_grad():
        for number, step in enumerate(rounds):
            rows = leave(cache, rows, step.left)
            if step.joined:
                group_cache, group_rows = ready
                gone = [member for member in group_rows.members if member not in step.joined]
                rows = stack(cache, rows, group_cache, leave(group_cache, group_rows, gone))
                ready = None
            if step.left or step.joined or number == 0:
                writer.new_segment(pieces, number, rows.members)
            if number == len(rounds) // 2:  # a recovery rewinds the slot here: the replica starts over
                writer.rebase(0, pieces, number, cache, rows, group, started)
                at = None if group is None else JoiningAt(tuple(group.members), group.mask, group.done, started)
                base = SlotBase(number, SlotRows(list(rows.members), rows.mask.clone(), rows.positions.clone()), at)
            # the slot as a recovery finds it before this round's steps: the rounds before and its row change
            found = trace(rounds[:number], (step.left, step.joined or None), mask_of, base)
            assert found.rows.members == rows.members
            assert torch.equal(found.rows.mask, rows.mask)
            assert torch.equal(found.rows.positions, rows.positions)
            rebuilt = gather(found.index, found.pieces, _blocks(store, found.pieces, layers))
            if rows.members:
                assert _same(rebuilt, cache, model.config), number
                checked += 1
                windowed |= any(layer.get_seq_length() > layer.keys.shape[2] for layer in cache.layers)
            if group is not None:
                assert found.joining is not None
                assert found.joining.done == group.done
                kept = assemble(store, piece_stream(0, 0, found.joining.piece), layers, group.done)
                assert _same(kept, group.cache, model.config)
            if step.decoded:
                mask, positions = rows.next_step()
                last = torch.tensor([[tokens[member]] for member in rows.members])
                logits = forward(last, mask, positions, cache)
                tokens.update(zip(rows.members, logits.argmax(-1).tolist(), strict=True))
                writer.decoded(0, pieces, rows.members, cache)
            if step.prefill is not None:
                members, start, stop = step.prefill
                if start == 0:
                    ids, mask = left_pad([prompts[member] for member in members], pad)
                    group, started = Joining(list(members), mask, DynamicCache(config=model.config), ids), number
                logits = group.run(forward, group.ids[:, start:stop], start, stop)
                writer.write(0, pieces, f"group{started}", members, kv_block(group.cache, start, stop), start)
                if group.complete:
                    tokens.update(zip(group.members, logits.argmax(-1).tolist(), strict=True))
                    ready, group = (group.cache, group.rows()), None
            writer.collect(0, pieces, set(rows.members) | set(group.members if group else ())
                           | set(ready[1].members if ready else ()))
    assert base is not None
    assert checked > 4
    assert windowed == (family != "llama")  # past its window: the layer had let positions go
    writer.end(0, pieces)
    assert store.keys() == []
