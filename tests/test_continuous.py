"""Continuous batching in one process: rows leave their slot as they end and waiting requests join it beside
its decode steps; every request's tokens equal `replay` of its slot's recorded rounds, a request alone equals
`model.generate`, the KV caches stay within the budget, static microbatches are unchanged, bad settings are
ConfigErrors, and the slot operations (`leave`, `stack`) and `replay` do what their docstrings say."""

from __future__ import annotations

import expectations
import pytest
import tiny_models
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

import dejavu_sdk as dv
from dejavu_sdk.generation.batching import Request, check_batching, check_max_prefill_tokens
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.replay import replay
from dejavu_sdk.generation.roundrobin import RoundRobin
from dejavu_sdk.generation.slots import Round, SlotRows, leave, stack, take_back, windows
from dejavu_sdk.swapping import kv_bytes_per_token, positions_needed

FAMILIES = ["llama", "gpt2", "opt"]
#: Ten prompts of 4 to 10 tokens; rows end after 1 to 8 tokens (the sixth with its first token), or at an end of
#: sequence. The longest row reaches 12 positions.
PROMPTS = expectations.prompts(10, seed=3)
LIMITS = [1 + (3 * index + 1) % 8 for index in range(10)]
MICROBATCH = 3
MAX_PREFILL = 3
SAMPLED = {"do_sample": True, "seed": 5, "top_k": 20}


def _budget(model) -> int:
    """Three rows at the longest row's final length: slots of up to three rows cannot all be admitted, so waiting
    requests join slots whose other rows are decoding (greedy or sampled, swapped or not, in every family)."""
    longest = max(positions_needed(prompt.numel(), limit) for prompt, limit in zip(PROMPTS, LIMITS, strict=True))
    assert longest == 12
    return 3 * longest * kv_bytes_per_token(model.config, torch.float32)


def _decoding(sampled: bool) -> Decoding:
    return Decoding.of(**SAMPLED) if sampled else Decoding()


def _reference_requests(results, decoding: Decoding) -> dict[int, Request]:
    """The requests `replay` needs, by the request numbers the results carry."""
    return {result.request: Request(prompt, limit, decoding)
            for result, prompt, limit in zip(results, PROMPTS, LIMITS, strict=True)}


def _assert_replayed(model, results, decoding: Decoding) -> None:
    requests = _reference_requests(results, decoding)
    assert len(requests) == len(results)  # every request has a number of its own
    for result in results:
        assert result.schedule, "continuous results carry their slot's rounds"
        want = replay(model, result.schedule, requests)[result.request]
        assert result.tokens.tolist() == want.tolist(), result.request


def _assert_slots_were_refilled(results) -> None:
    """The schedules show rows joining a slot while others decode, rows leaving, and a group's prompt prefilled
    a few columns at a time (within `MAX_PREFILL` positions a round)."""
    width = {result.request: prompt.numel() for result, prompt in zip(results, PROMPTS, strict=True)}
    rounds = {step for result in results for step in result.schedule}
    assert any(step.joined and len(step.decoded) > len(step.joined) for step in rounds)
    assert any(step.left for step in rounds)
    chunked = [step for step in rounds if step.prefill is not None and step.decoded
               and step.prefill[2] - step.prefill[1] < max(width[member] for member in step.prefill[0])]
    assert chunked
    for step in rounds:
        if step.prefill is None:
            continue
        members, start, stop = step.prefill
        assert 0 <= start < stop <= max(width[member] for member in members)
        # beside decode steps or alone, the prefill budget, one column at least: no round holds a stage for long
        assert (stop - start) * len(members) <= max(MAX_PREFILL, len(members))
    assert len({result.microbatch for result in results}) < len(results)  # slots were reused


# ---- 1. every request equals the replay of its slot's rounds ---------------------------------------------
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("swapping", [False, True], ids=["unswapped", "swapped"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_joining_and_leaving_slots_get_the_tokens_of_replaying_their_schedule(family, swapping,
                                                                                   sampled) -> None:
    model = getattr(tiny_models, family)()
    settings = SAMPLED if sampled else {}
    results = dv.DejaVuEngine(model).generate_many(PROMPTS, LIMITS, microbatch=MICROBATCH, batching="continuous",
                                                   max_prefill_tokens=MAX_PREFILL, kv_budget_bytes=_budget(model),
                                                   swapping=swapping, **settings)
    assert len(results) == len(PROMPTS)
    assert [result.tokens.numel() for result in results][5] == 1  # ended with its first token
    assert all(0 < result.tokens.numel() <= limit for result, limit in zip(results, LIMITS, strict=True))
    _assert_slots_were_refilled(results)
    _assert_replayed(model, results, _decoding(sampled))
    if sampled:
        assert {result.seed for result in results} == {SAMPLED["seed"]}
        greedy = dv.DejaVuEngine(model).generate_many(PROMPTS, LIMITS, microbatch=MICROBATCH,
                                                      batching="continuous", max_prefill_tokens=MAX_PREFILL,
                                                      kv_budget_bytes=_budget(model), swapping=swapping)
        assert [r.tokens.tolist() for r in results] != [r.tokens.tolist() for r in greedy]  # really sampled


# ---- 2. a request alone is model.generate ------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_alone_equals_model_generate_greedy_and_sampled(family) -> None:
    model = getattr(tiny_models, family)()
    prompt = PROMPTS[8]  # 10 tokens, within max_prefill_tokens: prefilled at once
    rules = RoundRobin(model).rules
    engine = dv.DejaVuEngine(model)
    greedy = engine.generate_many([prompt], 10, batching="continuous", max_prefill_tokens=16, swapping=False)
    want = expectations.expected(model, [[0]], [prompt], [10], rules.pad, rules.eos)[0]
    assert greedy[0].tokens.tolist() == want.tolist()
    schedule = greedy[0].schedule
    assert schedule[0] == Round(prefill=((greedy[0].request,), 0, prompt.numel()))
    assert schedule[1] == Round(joined=(greedy[0].request,), decoded=(greedy[0].request,))
    assert all(step == Round(decoded=(greedy[0].request,)) for step in schedule[2:])
    assert len(schedule) == greedy[0].tokens.numel()  # the prefill picks the first token, each round one more
    for seed in (5, 6):
        sampled = engine.generate_many([prompt], 10, batching="continuous", max_prefill_tokens=16, swapping=False,
                                       do_sample=True, seed=seed, top_k=20)
        # the engine's row draws from torch.Generator().manual_seed(seed): on the CPU, what
        # torch.manual_seed(seed) then generate draws
        want = expectations.sampled(model, [prompt], [0], 10, rules.pad, rules.eos, seed, top_k=20)[0]
        assert sampled[0].tokens.tolist() == want.tolist(), seed
    assert sampled[0].tokens.tolist() != greedy[0].tokens.tolist()
    # past the budget, alone too, the prompt runs a chunk a round: the replay of those rounds is the reference
    chunked = engine.generate_many([prompt], 10, batching="continuous", max_prefill_tokens=4, swapping=False)
    assert [step.prefill for step in chunked[0].schedule[:3]] == [((chunked[0].request,), start, min(start + 4, 10))
                                                                   for start in (0, 4, 8)]
    reference = {chunked[0].request: Request(prompt, 10, Decoding())}
    assert chunked[0].tokens.tolist() == replay(model, chunked[0].schedule, reference)[chunked[0].request].tolist()


# ---- 3. the KV budget ----------------------------------------------------------------------------------
def _runner(model, swapping: bool, runner_class=RoundRobin, budget: int | None = None):
    budget = budget or _budget(model)
    runner = runner_class(model, microbatch=MICROBATCH, kv_budget_bytes=budget, swapping=swapping,
                          batching="continuous", max_prefill_tokens=MAX_PREFILL)
    return runner, runner.run(runner.requests(PROMPTS, LIMITS, Decoding()))


@pytest.mark.parametrize("swapping", [False, True], ids=["unswapped", "swapped"])
def test_the_slots_caches_stay_within_the_budget_and_still_equal_replay(swapping) -> None:
    model = tiny_models.llama()
    runner, results = _runner(model, swapping)
    assert runner.caches is not None
    assert 0 < runner.caches.peak_bytes <= runner.budget == _budget(model)
    assert runner.caches.stats()["peak_kv_bytes"] == runner.caches.peak_bytes
    assert len(runner.caches) == 0  # every slot's cache is gone at the end
    assert runner.most_in_flight >= 2
    if swapping:
        assert runner.caches.swap_ins > 0
    _assert_slots_were_refilled(results)
    _assert_replayed(model, results, Decoding())
    if not swapping:  # the budget holds three rows: fewer slots than the four that take every request at once
        assert runner.most_in_flight < 4
    # without a budget every request is admitted at once, in slots of three: other schedules, still replayed
    roomy = RoundRobin(model, microbatch=MICROBATCH, swapping=swapping, batching="continuous",
                       max_prefill_tokens=MAX_PREFILL)
    served = roomy.run(roomy.requests(PROMPTS, LIMITS, Decoding()))
    assert roomy.most_in_flight == 4
    assert [result.microbatch for result in served] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert not any(step.joined and len(step.decoded) > len(step.joined) for result in served
                   for step in result.schedule)  # nobody waited for room
    _assert_replayed(model, served, Decoding())


def _cache_bytes(cache) -> int:
    return sum(tensor.untyped_storage().nbytes() for layer in cache.layers
               for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(tensor, torch.Tensor) and tensor.numel())


class _Counted(RoundRobin):
    """Counts by itself, after every round, the device bytes of the slots' caches on the device and of the caches
    of the groups prefilling or prefilled for a slot (which stay on the device until they join)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slots: dict[int, object] = {}
        self.device_peak = 0

    def _round(self, slot, caches):
        self.slots[id(slot)] = slot
        done = super()._round(slot, caches)
        joining = sum(_cache_bytes(other.joining[0].cache) for other in self.slots.values()
                      if other.joining is not None and other.joining[0].cache is not None)  # (static: the slot's)
        ready = sum(_cache_bytes(other.ready[0]) for other in self.slots.values() if other.ready is not None)
        slots = sum(_cache_bytes(cache) for cache in caches._resident.values())
        self.device_peak = max(self.device_peak, slots + joining + ready)
        return done


@pytest.mark.parametrize("swapping", [False, True], ids=["unswapped", "swapped"])
def test_the_caches_of_joining_groups_count_against_the_budget_too(swapping) -> None:
    """Four and a half rows: with swapping, the groups prefilling for every slot stay on the device beside the
    two slots' caches swapped in, and admission counts them."""
    model = tiny_models.llama()
    runner, results = _runner(model, swapping, _Counted, budget=_budget(model) * 3 // 2)
    assert runner.caches is not None
    assert runner.caches.peak_bytes <= runner.budget
    _assert_replayed(model, results, Decoding())
    assert 0 < runner.device_peak <= runner.budget


# ---- 4. static batching: `model.generate` on each microbatch ------------------------------------------
def test_static_batching_is_unchanged() -> None:
    model = tiny_models.llama()
    engine = dv.DejaVuEngine(model)
    static = engine.generate_many(PROMPTS, LIMITS, microbatch=MICROBATCH, batching="static", swapping=False)
    default = engine.generate_many(PROMPTS, LIMITS, microbatch=MICROBATCH, swapping=False)
    assert [r.tokens.tolist() for r in static] == [r.tokens.tolist() for r in default]
    batches = expectations.microbatches(static)
    assert batches == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    rules = RoundRobin(model).rules
    want = expectations.expected(model, batches, PROMPTS, LIMITS, rules.pad, rules.eos)
    assert [r.tokens.tolist() for r in static] == [tokens.tolist() for tokens in want]
    assert all(result.schedule == () and result.request == -1 for result in static)
    assert [(r.microbatch, r.row, r.rows) for r in static] == [(r.microbatch, r.row, r.rows) for r in default]
    assert RoundRobin(model, microbatch=2).batching == "static"  # generate_many's default too
    assert RoundRobin(model, batching="continuous", max_prefill_tokens=4).max_prefill_tokens == 4
    assert RoundRobin(model, batching="static", max_prefill_tokens=4).max_prefill_tokens == 4  # chunks too
    # the same budget as the continuous tests: microbatches of whole requests, tokens as before
    budgeted = engine.generate_many(PROMPTS, LIMITS, microbatch=MICROBATCH, batching="static",
                                    kv_budget_bytes=_budget(model), swapping=False)
    want = expectations.expected(model, expectations.microbatches(budgeted), PROMPTS, LIMITS, rules.pad, rules.eos)
    assert [r.tokens.tolist() for r in budgeted] == [tokens.tolist() for tokens in want]


@pytest.mark.parametrize("swapping", [False, True], ids=["unswapped", "swapped"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2_sliding"])
def test_static_slots_prefill_in_chunks_as_generate_does_with_prefill_chunk_size(family: str, swapping: bool) -> None:
    """`max_prefill_tokens` bounds a static slot's prefill too: its prompts run a chunk of columns a round
    (the positions over its rows: 12 over two rows, 6 columns, longer than a sliding window), so each microbatch
    equals `model.generate(prefill_chunk_size=6)`. The group's cache is the slot's from its first chunk: with
    swapping it waits in host memory between its chunks, and the device never holds more than the budget."""
    model = getattr(tiny_models, family)()
    prompts = [torch.randint(1, tiny_models.VOCAB, (length,), generator=torch.Generator().manual_seed(length))
               for length in (23, 9, 17, 30, 12, 26)]
    limits = [6, 3, 6, 5, 6, 4]
    rules = RoundRobin(model).rules
    budget = 2 * kv_bytes_per_token(model.config, torch.float32) * 2 * positions_needed(30, 6)  # two microbatches
    runner = _Counted(model, microbatch=2, kv_budget_bytes=budget, swapping=swapping, batching="static",
                      max_prefill_tokens=12)
    results = runner.run(runner.requests(prompts, limits, Decoding()))
    batches = expectations.microbatches(results)
    assert all(len(members) == 2 for members in batches)
    want = expectations.expected(model, batches, prompts, limits, rules.pad, rules.eos, max_prefill_tokens=12)
    assert [result.tokens.tolist() for result in results] == [tokens.tolist() for tokens in want]
    assert runner.caches is not None
    assert 0 < runner.device_peak <= budget
    assert runner.caches.peak_bytes <= budget
    if swapping:
        assert runner.most_in_flight == 3  # all three microbatches: two on the device at a time
        assert runner.caches.swap_ins > 0


# ---- 5. bad settings --------------------------------------------------------------------------------------
def test_bad_batching_and_max_prefill_tokens_are_config_errors() -> None:
    engine = dv.DejaVuEngine(tiny_models.llama())
    prompts = expectations.prompts(2)
    for batching in ("dynamic", "Continuous", None, 1):
        with pytest.raises(dv.ConfigError, match="batching must be one of"):
            engine.generate_many(prompts, 3, batching=batching)
        with pytest.raises(dv.ConfigError):
            check_batching(batching)
    for bad in (0, -1, True, False, 1.5, "4"):
        for batching in ("continuous", "static"):
            with pytest.raises(dv.ConfigError, match="max_prefill_tokens"):
                engine.generate_many(prompts, 3, batching=batching, max_prefill_tokens=bad)
    assert check_max_prefill_tokens(None) is None
    assert check_max_prefill_tokens(1) == 1
    assert check_batching("static") == "static"


def _sliding_qwen2():
    torch.manual_seed(0)
    config = Qwen2Config(**tiny_models.SMALL, intermediate_size=128, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1, pad_token_id=0)
    assert "sliding_attention" in config.layer_types
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("swapping", [False, True], ids=["unswapped", "swapped"])
@pytest.mark.parametrize("family", ["mistral", "qwen2-sliding"])
def test_sliding_window_rows_joining_and_leaving_equal_generate_alone_and_their_replay(family, swapping) -> None:
    """Sliding-window layers hold each slot's last positions only (Mistral: every layer, window 5; Qwen2: some
    layers, window 4; the rows reach 12 positions): rows joining and leaving slots, their prompts chunked, each
    get the tokens of `model.generate` alone (greedy) and of their schedule's replay (greedy and sampled)."""
    model = tiny_models.mistral() if family == "mistral" else _sliding_qwen2()
    assert any(getattr(layer, "is_sliding", False) for layer in DynamicCache(config=model.config).layers)
    rules = RoundRobin(model).rules
    for settings in ({}, SAMPLED):
        results = dv.DejaVuEngine(model).generate_many(PROMPTS, LIMITS, microbatch=MICROBATCH, batching="continuous",
                                                       max_prefill_tokens=MAX_PREFILL,
                                                       kv_budget_bytes=_budget(model), swapping=swapping, **settings)
        _assert_slots_were_refilled(results)
        _assert_replayed(model, results, _decoding(bool(settings)))
        if not settings:
            for result, prompt, limit in zip(results, PROMPTS, LIMITS, strict=True):
                want = expectations.expected(model, [[0]], [prompt], [limit], rules.pad, rules.eos)[0]
                assert result.tokens.tolist() == want.tolist(), result.request


# ---- 6. leave and stack ---------------------------------------------------------------------------------
LAYERS, HEADS, DIM = 2, 2, 3


def _cache(rows: int, length: int, offset: float) -> DynamicCache:
    """A cache of `LAYERS` layers whose every entry is distinct: layer l's keys are offset + l*1000 + arange,
    its values the negated keys."""
    cache = DynamicCache()
    for layer in range(LAYERS):
        keys = offset + layer * 1000 + torch.arange(rows * HEADS * length * DIM, dtype=torch.float32).reshape(
            rows, HEADS, length, DIM)
        cache.update(keys, -keys, layer)
    return cache


def _snapshot(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def test_leave_drops_the_rows_and_the_leading_columns_padding_for_every_row_kept() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1],
                         [1, 1, 1, 1, 1],
                         [0, 0, 0, 1, 1]])
    rows = SlotRows([10, 11, 12], mask, torch.tensor([[2], [4], [1]]))
    cache = _cache(3, 5, 0.0)
    before = _snapshot(cache)
    kept = leave(cache, rows, [11])
    assert kept.members == [10, 12]
    assert kept.mask.tolist() == [[1, 1, 1], [0, 1, 1]]  # two leading columns were padding for both
    assert kept.positions.tolist() == [[2], [1]]
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys[[0, 2], :, 2:])
        assert torch.equal(layer.values, values[[0, 2], :, 2:])
        assert layer.keys.is_contiguous()
    # only leading columns go: a padding column after a real one for some row stays
    rows = SlotRows([1, 2, 3], torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]),
                    torch.tensor([[2], [1], [3]]))
    cache = _cache(3, 4, 0.0)
    before = _snapshot(cache)
    kept = leave(cache, rows, [3])
    assert kept.members == [1, 2]
    assert kept.mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert torch.equal(cache.layers[1].keys, before[1][0][[0, 1], :, 1:])
    # nobody leaving: nothing changes
    assert leave(cache, kept, []) is kept
    assert cache.layers[0].keys.shape == (2, HEADS, 3, DIM)
    # everybody leaving: an empty slot
    gone = leave(cache, kept, [1, 2])
    assert gone.members == []
    assert gone.mask.shape == (0, 0)
    assert gone.positions.shape == (0, 1)
    assert cache.layers[0].keys.shape == (0, HEADS, 0, DIM)


@pytest.mark.parametrize("slot_longer", [True, False])
def test_stack_puts_the_group_under_the_slot_rows_and_left_pads_the_shorter_with_masked_zeros(slot_longer) -> None:
    slot_length, group_length = (5, 3) if slot_longer else (3, 5)
    slot_mask = torch.ones(2, slot_length, dtype=torch.long)
    slot_mask[1, 0] = 0
    group_mask = torch.ones(3, group_length, dtype=torch.long)
    group_mask[0, :2] = 0
    rows = SlotRows([7, 4], slot_mask, torch.tensor([[slot_length - 1], [slot_length - 2]]))
    group_rows = SlotRows([9, 2, 8], group_mask, torch.tensor([[group_length - 3], [group_length - 1],
                                                                [group_length - 1]]))
    cache, group = _cache(2, slot_length, 0.0), _cache(3, group_length, 500.0)
    slot_before, group_before = _snapshot(cache), _snapshot(group)
    stacked = stack(cache, rows, group, group_rows)
    assert stacked.members == [7, 4, 9, 2, 8]  # the slot's rows, then the group's
    assert stacked.positions.tolist() == [*rows.positions.tolist(), *group_rows.positions.tolist()]
    length, pad_slot, pad_group = 5, 5 - slot_length, 5 - group_length
    assert stacked.mask.shape == (5, length)
    assert stacked.mask[:2, :pad_slot].eq(0).all()
    assert stacked.mask[2:, :pad_group].eq(0).all()
    assert torch.equal(stacked.mask[:2, pad_slot:], slot_mask)
    assert torch.equal(stacked.mask[2:, pad_group:], group_mask)
    for layer, (keys, values), (group_keys, group_values) in zip(cache.layers, slot_before, group_before,
                                                                  strict=True):
        assert layer.keys.shape == (5, HEADS, length, DIM)
        assert torch.equal(layer.keys[:2, :, pad_slot:], keys)
        assert torch.equal(layer.values[:2, :, pad_slot:], values)
        assert torch.equal(layer.keys[2:, :, pad_group:], group_keys)
        assert torch.equal(layer.values[2:, :, pad_group:], group_values)
        assert layer.keys[:2, :, :pad_slot].eq(0).all()
        assert layer.values[:2, :, :pad_slot].eq(0).all()
        assert layer.keys[2:, :, :pad_group].eq(0).all()
        assert layer.values[2:, :, :pad_group].eq(0).all()


def test_stack_into_an_empty_slot_takes_the_groups_cache_and_rows() -> None:
    config = tiny_models.llama().config
    group = DynamicCache(config=config)
    keys = torch.randn(2, 2, 4, 16, generator=torch.Generator().manual_seed(1))
    for layer in range(config.num_hidden_layers):
        group.update(keys + layer, -keys - layer, layer)
    group_rows = SlotRows([3, 1], torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), torch.tensor([[2], [3]]))
    cache = DynamicCache(config=config)
    stacked = stack(cache, SlotRows(), group, group_rows)
    assert stacked.members == [3, 1]
    assert torch.equal(stacked.mask, group_rows.mask)
    assert torch.equal(stacked.positions, group_rows.positions)
    for index, layer in enumerate(cache.layers):
        assert layer.is_initialized
        assert torch.equal(layer.keys, keys + index)
        assert torch.equal(layer.values, -keys - index)
    assert cache.get_seq_length() == 4


@pytest.mark.parametrize("columns", [1, 6])
def test_take_back_returns_every_layer_to_a_round_ago_a_sliding_window_layer_past_its_window_too(columns) -> None:
    """A decode step (one column) or a prompt chunk (six) past the window of 4 that Qwen2's later layers keep:
    `take_back` with the `windows` from before gives the same cache as before, every kind of layer; without
    them a sliding-window layer refuses."""
    model = tiny_models.qwen2_sliding()
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8]])
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        before = [(layer.keys.clone(), layer.values.clone(), layer.get_seq_length()) for layer in cache.layers]
        assert any(layer.get_seq_length() > layer.keys.shape[2] for layer in cache.layers)  # a window is full
        kept = windows(cache)
        more = torch.arange(10, 10 + columns)[None]
        model(input_ids=more, position_ids=torch.arange(7, 7 + columns)[None], cache=cache, use_cache=True)
    held = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    take_back(cache, 7, kept)
    for layer, (keys, values, length) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys)
        assert torch.equal(layer.values, values)
        assert layer.get_seq_length() == length
    for layer, (keys, values) in zip(cache.layers, held, strict=True):  # again, as a second failure would
        layer.keys, layer.values = keys, values
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = 7 + columns
    with pytest.raises(dv.ConfigError, match="sliding-window"):
        take_back(cache, 7, [])


# ---- 7. replay of an inconsistent schedule --------------------------------------------------------------
def test_replay_refuses_a_schedule_the_slot_cannot_have_run_and_replays_a_consistent_one() -> None:
    model = tiny_models.llama()
    prompts = PROMPTS[:2]
    requests = {0: Request(prompts[0], 4, Decoding()), 1: Request(prompts[1], 4, Decoding())}
    width = max(prompt.numel() for prompt in prompts)
    prefill = Round(prefill=((0, 1), 0, width))
    bad = [
        ("the slot holds", [prefill, Round(joined=(0, 1), decoded=(0, 2))]),  # request 2 is not in the slot
        ("the slot holds", [prefill, Round(joined=(0, 1), decoded=(1, 0))]),  # nor in that order
        ("the slot holds", [prefill, Round(joined=(0, 1), decoded=(0, 1)), Round(left=(0,), decoded=(0, 1))]),
        ("which no round prefilled", [Round(joined=(0,), decoded=(0,))]),
        ("which were not given", [Round(prefill=((0, 5), 0, width))]),
        ("which no round started", [Round(prefill=((0, 1), 2, width))]),
        ("columns from 3", [Round(prefill=((0, 1), 0, 2)), Round(prefill=((0, 1), 3, width))]),  # a gap
    ]
    for match, schedule in bad:
        with pytest.raises(dv.ConfigError, match=match):
            replay(model, schedule, requests)
    # the consistent schedule of those two as one microbatch, with the prompts prefilled in two chunks:
    # the same tokens as model.generate on the microbatch
    schedule = [Round(prefill=((0, 1), 0, 3)), Round(prefill=((0, 1), 3, width)),
                *[Round(joined=(0, 1) if step == 0 else (), decoded=(0, 1)) for step in range(3)]]
    got = replay(model, schedule, requests)
    rules = RoundRobin(model).rules
    want = expectations.expected(model, [[0, 1]], prompts, [4, 4], rules.pad, rules.eos)
    assert [got[0].tolist(), got[1].tolist()] == [tokens.tolist() for tokens in want]
