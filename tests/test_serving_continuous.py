"""Continuous batching in mixed pipelines: rows join a slot while others decode, leave as they end, and join in
chunks of at most `max_prefill_tokens` positions a round; every row equals the replay of its slot's schedule
(`dejavu_sdk.generation.replay.replay`), a row alone equals `model.generate`, the KV budget holds, a cancelled
or failed row leaves alone, and the options and the CLI take and refuse what they should."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence

import expectations
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.cli import build_parser, main
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.replay import replay
from dejavu_sdk.generation.slots import Round
from dejavu_sdk.serving import Pipeline
from dejavu_sdk.swapping import kv_bytes_per_token, positions_needed

pytestmark = pytest.mark.usefixtures("module_workers_import_tiny_models")

#: A joining group's prompt positions per round beside decoding rows: small, so that prompts are chunked.
PREFILL = 4
#: Ten requests of different lengths and decodings: more than two slots' rows, so rows must join and leave. The
#: first `LEADS` are long and greedy, and each is decoding before the next request comes: the others join slots
#: where they decode.
LIMITS = [30, 28, 5, 12, 4, 7, 6, 2, 10, 1]
LEADS = 2
SETTINGS: list[dict] = [{}, {}, {"do_sample": True, "seed": 11, "top_k": 20},
                        {"do_sample": True, "seed": 5, "temperature": 0.7}, {}, {},
                        {"do_sample": True, "seed": 3}, {}, {"do_sample": True, "seed": 8, "top_p": 0.9}, {}]
#: Torch threads per stage process: one, as the CPUs are shared with the head and the other stages (more
#: threads than cores make every step wait on spinning threads).
THREADS = 1


# ---- helpers ----------------------------------------------------------------------------------------------
def _prompts(count: int, seed: int) -> list[torch.Tensor]:
    """Prompts of ids below the patched models' special ids (`tiny_models.POISON`, `FATAL`)."""
    return [prompt.clamp(max=90) for prompt in expectations.prompts(count, seed=seed)]


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.005)


def _idle(pipe: Pipeline) -> None:
    """Every slot of a shared pipeline ended: the next test's requests open slots of their own."""
    _wait(lambda: pipe.status()["microbatches"] == [] and pipe.status()["waiting"] == 0, 60, "an idle pipeline")


def _numbers(futures: Sequence, known: dict[int, int]) -> list[int]:
    """Every submitted request's number: requests are numbered in submission order, one after another (this
    test's thread is the only one that makes requests), which the answered ones (`known`: index -> number)
    confirm; cancelled and failed requests get theirs from it."""
    assert known, "no request was answered"
    index, number = next(iter(known.items()))
    numbers = [number - index + position for position in range(len(futures))]
    assert all(numbers[position] == value for position, value in known.items()), \
        f"requests were not numbered in submission order: {known}"
    return numbers


def _slots(results) -> dict[int, tuple[Round, ...]]:
    """Each slot's longest schedule (a result's schedule is its slot's rounds up to the result's end)."""
    slots: dict[int, tuple[Round, ...]] = {}
    for result in results:
        assert result.schedule, f"request {result.request} has no schedule"
        if len(result.schedule) > len(slots.get(result.microbatch, ())):
            slots[result.microbatch] = result.schedule
    for slot, schedule in slots.items():  # every shorter schedule of a slot is a prefix of its longest
        assert all(result.schedule == schedule[:len(result.schedule)] for result in results
                   if result.microbatch == slot)
    return slots


def _members(schedule: Sequence[Round]) -> set[int]:
    members: set[int] = set()
    for step in schedule:
        members.update(step.left, step.joined, step.decoded, step.prefill[0] if step.prefill else ())
    return members


def _check_replayed(model, results, requests: dict[int, Request]) -> dict[int, dict[int, torch.Tensor]]:
    """Every result equals the replay of its schedule through `model` in this process; the replays by slot."""
    replays: dict[int, dict[int, torch.Tensor]] = {}
    for slot, schedule in _slots(results).items():
        replays[slot] = replay(model, schedule, requests)
    for result in results:
        want = replay(model, result.schedule, requests)
        assert result.request in want, f"the replay has no row for request {result.request}"
        assert torch.equal(result.tokens, want[result.request]), \
            f"request {result.request}: {result.tokens.tolist()} != replay {want[result.request].tolist()}"
        assert torch.equal(replays[result.microbatch][result.request], want[result.request])
    return replays


def _submit_mix(pipe: Pipeline, prompts) -> tuple[list, list[dict], list[int]]:
    """The ten requests, each of the leading ones decoding before the next is submitted."""
    futures = []
    for index, (prompt, limit, settings) in enumerate(zip(prompts, LIMITS, SETTINGS, strict=True)):
        decoding = threading.Event()
        futures.append(pipe.submit(prompt, max_new_tokens=limit, on_token=lambda _, seen=decoding: seen.set(),
                                   **settings))
        if index < LEADS:
            assert decoding.wait(60), f"no token of request {index} within 60 s"
    return futures, SETTINGS, LIMITS


def _requests(prompts, limits, settings, numbers) -> dict[int, Request]:
    return {number: Request(prompt, limit, Decoding.of(**decoding))
            for number, prompt, limit, decoding in zip(numbers, prompts, limits, settings, strict=True)}


def _serve_mix_and_replay(pipe: Pipeline, family: str, seed: int) -> tuple[list, dict[int, tuple[Round, ...]]]:
    """Ten requests of mixed lengths and decodings, each equal to its replay; the results and the slots."""
    prompts = _prompts(len(LIMITS), seed=seed)
    futures, settings, limits = _submit_mix(pipe, prompts)
    results = [future.result(timeout=120) for future in futures]
    assert [len(result.tokens) for result in results[:LEADS]] == LIMITS[:LEADS], "a leading row ended early"
    numbers = [result.request for result in results]
    assert len(set(numbers)) == len(numbers)
    requests = _requests(prompts, limits, settings, numbers)
    _check_replayed(getattr(tiny_models, family)(), results, requests)
    slots = _slots(results)
    for slot, schedule in slots.items():
        assert _members(schedule) <= set(numbers), f"slot {slot} ran requests of no submission here"
    return results, slots


def _check_continuous_schedules(slots: dict[int, tuple[Round, ...]], microbatch: int, prefill: int) -> None:
    """The schedules show what continuous batching does: rows join while others decode, rows leave while
    others go on, prompts are prefilled in chunks within the budget beside decoding, and no slot holds more
    than `microbatch` rows."""
    joined_beside = left_beside = chunked = refilled = False
    for schedule in slots.values():
        served: set[int] = set()
        for step in schedule:
            assert len(step.decoded) <= microbatch
            assert len(set(step.decoded)) == len(step.decoded)
            joined_beside |= bool(step.joined) and bool(set(step.decoded) - set(step.joined))
            left_beside |= bool(step.left) and bool(step.decoded)
            if step.prefill is not None:
                members, start, stop = step.prefill
                assert 0 <= start < stop
                assert len(members) <= microbatch
                if step.decoded:  # beside decoding rows: within the budget
                    assert len(members) * (stop - start) <= prefill, f"{step} runs more than {prefill} positions"
                chunked |= start > 0
            served.update(step.decoded)
        refilled |= len(served) > microbatch
    assert joined_beside, "no row joined a slot while other rows decoded"
    assert left_beside, "no row left a slot while other rows went on"
    assert chunked, "no prompt was prefilled in chunks"
    assert refilled, "no slot served more requests than it has rows"


# ---- shared pipelines ---------------------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The references (replays, `generate`) run in this process beside the stage processes: with more torch
    threads than free cores, each of their small steps waits on spinning threads (seconds instead of ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama_pipe(module_workers_import_tiny_models):
    """Two tcp stages of the tiny llama, three rows a slot, batching left to its default."""
    with Pipeline("tiny_models:llama", stages=2, microbatch=3, timeout=60, max_prefill_tokens=PREFILL) as pipe:
        yield pipe


# ---- 1. mixed layouts: every row equals its replay -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("transport", "stages", "family"),
                         [("tcp", 1, "llama"), ("tcp", 2, "llama"), ("gloo", 2, "gpt2"), ("tcp", 2, "mistral")])
def test_rows_join_leave_and_prefill_in_chunks_and_each_equals_its_replay(request, transport, stages, family) -> None:
    if (transport, stages, family) == ("tcp", 2, "llama"):
        pipe = request.getfixturevalue("llama_pipe")
        _idle(pipe)
        results, slots = _serve_mix_and_replay(pipe, family, seed=42)
    else:
        with Pipeline(f"tiny_models:{family}", stages=stages, microbatch=3, timeout=60, transport=transport,
                      threads=THREADS, max_prefill_tokens=PREFILL) as pipe:
            assert pipe.batching == "continuous"
            results, slots = _serve_mix_and_replay(pipe, family, seed=42)
    assert len(slots) <= len(results)
    _check_continuous_schedules(slots, microbatch=3, prefill=PREFILL)


# ---- 2. a request alone is model.generate ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_request_alone_equals_generate_and_continuous_is_the_default(llama_pipe) -> None:
    pipe = llama_pipe
    assert pipe.batching == "continuous"
    _idle(pipe)
    prompts = _prompts(2, seed=32)
    greedy = pipe.submit(prompts[0], max_new_tokens=9).result(timeout=60)
    _idle(pipe)
    sampled = pipe.submit(prompts[1], max_new_tokens=7, do_sample=True, seed=4, top_k=10).result(timeout=60)
    for result in (greedy, sampled):
        assert _members(result.schedule) == {result.request}, "the request was not alone in its slot"
    model = tiny_models.llama()
    (want,) = expectations.expected(model, [[0]], prompts[:1], [9], pipe.pad, pipe.eos)
    assert torch.equal(greedy.tokens, want), f"{greedy.tokens.tolist()} != generate {want.tolist()}"
    (want,) = expectations.sampled(model, prompts, [1], 7, pipe.pad, pipe.eos, 4, top_k=10)
    assert torch.equal(sampled.tokens, want), f"{sampled.tokens.tolist()} != generate {want.tolist()}"


# ---- 3. the KV budget --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("swapping", [False, True])
def test_the_kv_budget_is_never_exceeded_and_rows_still_equal_their_replay(swapping) -> None:
    """Two stages (layers 0-1 and 2), two slots of up to three rows, twelve requests submitted at once: room on
    each stage for three rows at the longest final length. Unbounded, these requests hold about one and a half
    times that on the first stage (six rows in two slots), so the budget, not the rows, bounds the slots. A request
    that alone takes the whole budget (with swapping, its cache and its own while it joins) is served as
    `model.generate` serves it; one new token more, and it is refused as it is submitted."""
    prompts = _prompts(12, seed=33)
    limits = [16, 12, 14, 9, 16, 11, 13, 15, 10, 16, 12, 14]
    settings: list[dict] = [{}, {"do_sample": True, "seed": 1, "top_k": 12}, {}, {}, {"do_sample": True, "seed": 7},
                            {}, {}, {"do_sample": True, "seed": 2, "temperature": 0.8}, {}, {}, {}, {}]
    longest = max(positions_needed(prompt.numel(), limit) for prompt, limit in zip(prompts, limits, strict=True))
    per_position = kv_bytes_per_token(tiny_models.llama().config, torch.float32, layers=2)  # the widest stage's
    row = longest * per_position
    budget = 3 * row
    whole = _prompts(1, seed=35)[0][:PREFILL]  # within one round's prefill: alone, it equals generate
    most = 3 * longest // (2 if swapping else 1) - whole.numel() + 1  # new tokens that fill the budget beside it
    with Pipeline("tiny_models:llama", layers=[(0, 2), (2, 3)], microbatch=3, timeout=60, kv_budget_bytes=budget,
                  swapping=swapping, max_prefill_tokens=PREFILL) as pipe:
        assert pipe.batching == "continuous"
        assert pipe.swapping is swapping
        futures = [pipe.submit(prompt, max_new_tokens=limit, **decoding)
                   for prompt, limit, decoding in zip(prompts, limits, settings, strict=True)]
        results = [future.result(timeout=120) for future in futures]
        stats = pipe.stage_stats()
        with pytest.raises(dv.RequestTooLarge, match=f"at most {most} new tokens fit") as refused:
            pipe.submit(whole, max_new_tokens=most + 1)
        assert refused.value.budget == budget
        assert pipe.waiting() == 0
        alone = pipe.submit(whole, max_new_tokens=most).result(timeout=120)
    want = expectations.expected(tiny_models.llama(), [[0]], [whole], [most], pipe.pad, pipe.eos)
    assert alone.tokens.tolist() == want[0].tolist()
    assert sorted(stats) == ["stage 0", "stage 1"]
    for name, stage in stats.items():
        assert stage["swapping"] is swapping
        assert 0 < stage["peak_kv_bytes"] <= budget, f"{name}: peak {stage['peak_kv_bytes']} > budget {budget}"
    # more than one row's cache at once on the first stage: the budget was in play
    assert stats["stage 0"]["peak_kv_bytes"] > row
    assert len({result.microbatch for result in results}) > 1
    requests = _requests(prompts, limits, settings, [result.request for result in results])
    _check_replayed(tiny_models.llama(), results, requests)


# ---- 4. cancellation -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_cancelled_waiting_request_is_never_computed_and_a_cancelled_row_leaves(llama_pipe) -> None:
    """Six long rows fill both slots; a seventh waits and is cancelled (never computed); a running row is
    cancelled and leaves its slot, and a later request takes its room; every other row equals its replay."""
    pipe = llama_pipe
    _idle(pipe)
    prompts = _prompts(8, seed=34)
    limits = [60] * 6 + [5, 6]
    settings: list[dict] = [{}, {"do_sample": True, "seed": 2, "top_k": 30}, {}, {"do_sample": True, "seed": 9},
                            {}, {}, {}, {}]
    streamed: list[int] = []
    futures = [pipe.submit(prompts[index], max_new_tokens=limits[index],
                           on_token=streamed.append if index == 1 else None, **settings[index]) for index in range(6)]
    _wait(lambda: pipe.status()["waiting"] == 0, 60, "the six rows taken into slots")
    assert not any(future.done() for future in futures)
    waiting = pipe.submit(prompts[6], max_new_tokens=limits[6])
    futures.append(waiting)
    assert pipe.status()["waiting"] == 1, "a seventh row was taken into two full slots of three"
    assert pipe.cancel(waiting)
    assert waiting.cancelled()
    assert pipe.status()["waiting"] == 0
    _wait(lambda: len(streamed) >= 5, 60, "5 tokens of the row to cancel")
    assert pipe.cancel(futures[1])
    cancelled_at = len(streamed)
    later = pipe.submit(prompts[7], max_new_tokens=limits[7])
    futures.append(later)
    answered = {index: future.result(timeout=120) for index, future in enumerate(futures) if index not in (1, 6)}
    _idle(pipe)
    assert futures[1].cancelled()
    assert len(streamed) <= cancelled_at + 2
    numbers = _numbers(futures, {index: result.request for index, result in answered.items()})
    results = list(answered.values())
    slots = _slots(results)
    everyone = set().union(*map(_members, slots.values()))
    assert numbers[6] not in everyone, "the cancelled waiting request was computed"
    assert numbers[1] in everyone
    (slot,) = [slot for slot, schedule in slots.items() if numbers[1] in _members(schedule)]
    schedule = slots[slot]
    gone = [step for step, rounds in enumerate(schedule) if numbers[1] in rounds.left]
    assert gone, "the cancelled row never left its slot"
    assert sum(numbers[1] in step.decoded for step in schedule) < limits[1] - 1
    assert all(numbers[1] not in step.decoded for step in schedule[gone[0]:])
    assert answered[7].microbatch == slot, "the later request did not take the cancelled row's room"
    assert answered[7].finished < min(answered[index].finished for index in (0, 2, 3, 4, 5))
    requests = _requests(prompts, limits, settings, numbers)
    _check_replayed(tiny_models.llama(), results, {number: request for number, request in requests.items()
                                                  if number != numbers[6]})


# ---- 5. a failed row ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_row_whose_logits_are_not_finite_fails_alone_and_its_slot_goes_on() -> None:
    """NaN logits for the prompts holding `POISON`: one joins as its slot opens, one beside decoding rows."""
    prompts = _prompts(6, seed=35)
    poisoned = (1, 4)
    for index in poisoned:
        prompts[index][1] = tiny_models.POISON
    limits = [12, 10, 8, 14, 6, 9]
    settings: list[dict] = [{}, {}, {"do_sample": True, "seed": 6}, {}, {}, {}]
    with Pipeline("tiny_models:llama_poisoned", stages=1, microbatch=3, timeout=60, threads=THREADS) as pipe:
        assert pipe.batching == "continuous"
        decoding_rows = threading.Semaphore(0)  # released per token of the first request
        futures = [pipe.submit(prompt, max_new_tokens=limit, **decoding,
                               on_token=(lambda _token: decoding_rows.release()) if index == 0 else None)
                   for index, (prompt, limit, decoding) in enumerate(zip(prompts[:4], limits, settings, strict=False))]
        for _ in range(2):  # the later prompts come while rows decode, so the second poisoned one joins beside them
            assert decoding_rows.acquire(timeout=60), "the first request streamed no tokens"
        futures += [pipe.submit(prompt, max_new_tokens=limit, **decoding)
                    for prompt, limit, decoding in zip(prompts[4:], limits[4:], settings[4:], strict=True)]
        for index in poisoned:
            with pytest.raises(dv.RequestFailed, match="not finite") as failure:
                futures[index].result(timeout=60)
            assert not failure.value.input_error
        answered = {index: future.result(timeout=60) for index, future in enumerate(futures) if index not in poisoned}
        _idle(pipe)
        after = pipe.submit(prompts[0], max_new_tokens=5).result(timeout=60)
        pad, eos = pipe.pad, pipe.eos
    numbers = _numbers(futures, {index: result.request for index, result in answered.items()})
    results = list(answered.values())
    slots = _slots(results)
    requests = _requests(prompts, limits, settings, numbers)
    replays = _check_replayed(tiny_models.llama_poisoned(), results, requests)
    for index in poisoned:
        (slot,) = [slot for slot, schedule in slots.items() if numbers[index] in _members(schedule)]
        shared = [result for result in results if result.microbatch == slot]
        assert shared, f"the failed request {index} shared its slot with no other row"
        assert numbers[index] not in replays[slot], "the replay kept a failed row"
        assert any(step.prefill and numbers[index] in step.prefill[0] for step in slots[slot])
        # it failed with its first token: it never joined its slot's rows
        assert all(numbers[index] not in step.joined + step.decoded for step in slots[slot])
    assert any(step.prefill and numbers[4] in step.prefill[0] and step.decoded
               for schedule in slots.values() for step in schedule), "the second poisoned prompt ran beside no row"
    (want,) = expectations.expected(tiny_models.llama(), [[0]], prompts[:1], [5], pad, eos)
    assert torch.equal(after.tokens, want)


# ---- 6. options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    ({"stages": 2, "batching": "bogus"}, "batching must be one of"),
    ({"stages": 2, "max_prefill_tokens": 0}, "max_prefill_tokens must be a positive integer"),
    ({"stages": 2, "max_prefill_tokens": -3}, "max_prefill_tokens must be a positive integer"),
    ({"stages": 2, "max_prefill_tokens": True}, "max_prefill_tokens must be a positive integer"),
    ({"stages": 2, "max_prefill_tokens": 2.5}, "max_prefill_tokens must be a positive integer"),
])
def test_batching_options_are_refused_before_any_process_starts(options, message) -> None:
    with pytest.raises(dv.ConfigError, match=message):
        Pipeline("tiny_models:llama", timeout=60, **options)


@pytest.mark.parametrize(("model", "options", "batching"), [
    ("llama", {"stages": 2}, "continuous"),
    ("llama", {"stages": 1, "max_prefill_tokens": None}, "continuous"),
    ("llama", {"stages": 2, "batching": "static"}, "static"),
    ("llama", {"prompt_stages": 1, "token_stages": 1}, "continuous"),
    ("llama", {"prompt_stages": 1, "token_stages": 1, "batching": "static"}, "static"),
    ("llama", {"stages": 2, "recovery": "recompute"}, "continuous"),
    ("llama", {"stages": 1, "recovery": "auto"}, "continuous"),
    ("llama", {"stages": 2, "recovery": "replicas"}, "continuous"),
    ("llama", {"stages": 2, "recovery": "auto"}, "continuous"),
    ("mistral", {"stages": 2}, "continuous"),
])
def test_the_default_batching_is_continuous_where_the_layout_takes_it(model, options, batching) -> None:
    assert Pipeline(f"tiny_models:{model}", **options).batching == batching


@pytest.mark.slow
def test_static_batching_has_no_schedule_and_each_row_equals_generate_on_its_microbatch() -> None:
    prompts = _prompts(7, seed=36)
    limits = [4, 9, 6, 3, 8, 5, 7]
    with Pipeline("tiny_models:llama", stages=1, microbatch=3, timeout=60, batching="static",
                  threads=THREADS) as pipe:
        assert pipe.batching == "static"
        futures = [pipe.submit(prompt, max_new_tokens=limit) for prompt, limit in zip(prompts, limits, strict=True)]
        results = [future.result(timeout=60) for future in futures]
        pad, eos = pipe.pad, pipe.eos
    assert all(result.schedule == () for result in results)
    batches = expectations.microbatches(results)
    assert any(len(members) > 1 for members in batches), "every request had a microbatch of its own"
    want = expectations.expected(tiny_models.llama(), batches, prompts, limits, pad, eos)
    for index, (result, tokens) in enumerate(zip(results, want, strict=True)):
        assert torch.equal(result.tokens, tokens), f"request {index}: {result.tokens.tolist()} != {tokens.tolist()}"


# ---- 7. the CLI ------------------------------------------------------------------------------------------------
def test_serve_takes_batching_and_max_prefill_tokens(capsys) -> None:
    parser = build_parser()
    for batching in ("static", "continuous"):
        args = parser.parse_args(["serve", "--model", "tiny_models:llama", "--batching", batching,
                                  "--max-prefill-tokens", "8"])
        assert (args.batching, args.max_prefill_tokens) == (batching, 8)
    args = parser.parse_args(["serve", "--model", "tiny_models:llama"])
    assert (args.batching, args.max_prefill_tokens) == (None, 256)  # the pipeline chooses; vLLM's budget
    args = parser.parse_args(["controller", "--model", "tiny_models:llama", "--batching", "static"])
    assert args.batching == "static"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--model", "tiny_models:llama", "--batching", "bogus"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    helped = capsys.readouterr().out
    assert "--batching {continuous,static}" in helped
    assert "--max-prefill-tokens" in helped


def test_serve_hands_batching_and_max_prefill_tokens_to_the_controller(monkeypatch, capsys) -> None:
    import dejavu_sdk.controller

    given: dict = {}

    class Refusing:
        def __init__(self, model: str, **options) -> None:
            given.update(options, model=model)
            raise dv.ConfigError("no controller in this test")

    monkeypatch.setattr(dejavu_sdk.controller, "Controller", Refusing)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # `serve` would take this process's Ctrl-C
    assert main(["serve", "--model", "tiny_models:llama", "--stages", "2", "--batching", "static",
                 "--max-prefill-tokens", "16", "--listen", "127.0.0.1:0"]) == 2
    assert "no controller in this test" in capsys.readouterr().err
    assert (given["batching"], given["max_prefill_tokens"], given["stages"]) == ("static", 16, 2)
