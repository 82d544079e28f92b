"""Log-probabilities of new and prompt tokens (`logprobs=`, `prompt_logprobs=`): a request alone gets the
log-softmax of the very logits `model.generate` computes at each step (its token's and the top n), and of a forward
pass over its prompt; in static and continuous batching, with its prompt run in chunks, and disaggregated; rows that
do not ask get none; `on_logprobs` streams each token's entry before `on_token` gets the token."""

from __future__ import annotations

import threading

import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation import logprobs
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.logprobs import MAX_LOGPROBS, PromptLogprobs, Scores, prompt_scores
from dejavu_sdk.generation.slot_batch import SlotBatch
from dejavu_sdk.generation.slot_policy import STATIC
from dejavu_sdk.serving import Pipeline

pytestmark = pytest.mark.usefixtures("module_workers_import_tiny_models")

NEW = 6
TOP = 3
PROMPT_TOP = 2
PROMPTS = [torch.tensor([5, 17, 33, 8, 61, 12, 40, 9, 27, 3, 71]), torch.tensor([14, 2, 50, 6]),
           torch.tensor([30, 31, 7, 44, 19, 58, 11])]


def _expected(model, prompt: torch.Tensor) -> tuple[list[int], list[tuple[float, list[int]]], list[float]]:
    """`model.generate`'s tokens for `prompt` alone, the log-softmax of each step's logits at its token with the
    top ids, and each prompt token's (from the second) under one forward over the prompt."""
    out = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, prompt.numel():].tolist()
    steps = []
    for token, logits in zip(tokens, out.logits, strict=True):
        values = torch.log_softmax(logits[0].float(), -1)
        steps.append((float(values[token]), values.topk(TOP).indices.tolist()))
    with torch.no_grad():
        values = torch.log_softmax(model(prompt[None]).logits[0].float(), -1)
    prompt_values = [float(values[position, prompt[position + 1]]) for position in range(prompt.numel() - 1)]
    return tokens, steps, prompt_values


LAYOUTS = {
    "static-2-stages": {"stages": 2, "batching": "static"},
    "static-disaggregated": {"prompt_stages": 1, "token_stages": 1, "batching": "static"},
    "continuous-chunked": {"stages": 2, "batching": "continuous", "max_prefill_tokens": 4},
    "continuous-disaggregated": {"prompt_stages": 1, "token_stages": 1, "batching": "continuous"},
    "continuous-disaggregated-chunked": {"prompt_stages": 2, "token_stages": 1, "batching": "continuous",
                                         "max_prefill_tokens": 4},
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_equal_generate_and_a_forward_pass_and_only_rows_that_ask_get_them(layout) -> None:
    model = tiny_models.llama()
    model.generation_config.eos_token_id = None  # every row runs its NEW tokens
    expected = [_expected(model, prompt) for prompt in PROMPTS]
    streamed: dict[int, list] = {0: [], 1: [], 2: []}
    lock = threading.Lock()

    def on_logprobs(index: int, entry) -> None:
        with lock:
            streamed[index].append(("logprobs", entry))

    def on_token(index: int, token: int) -> None:
        with lock:
            streamed[index].append(("token", token))

    with Pipeline("tiny_models:llama", microbatch=3, timeout=60, **LAYOUTS[layout]) as pipe:
        leads = []
        for _ in range(2):  # a slot per stage, each decoding before the next request comes
            decoding = threading.Event()
            # long enough to outlast the next lead's start and the others' joining under load (a lead that ended
            # would leave its slot empty, and the others would join it with nothing decoding beside them)
            leads.append(pipe.submit(PROMPTS[2], 20 * NEW, ignore_eos=True,
                                     on_token=lambda _, event=decoding: event.set()))
            assert decoding.wait(60)
        # the others join a slot while it decodes: under continuous batching their prompts run in chunks there
        # the third prompt repeats the first: where they share a microbatch, the first alone is scored
        asking = pipe.submit_all([*PROMPTS[:2], PROMPTS[0]], NEW, logprobs=TOP, prompt_logprobs=PROMPT_TOP,
                                 on_token=on_token, on_logprobs=on_logprobs, ignore_eos=True)
        results = [future.result(timeout=120) for future in [*asking, *leads]]
    if layout == "continuous-chunked":
        assert any(step.prefill is not None and step.decoded and step.prefill[2] - step.prefill[1] <= 4
                   for step in results[0].schedule), "the prompts were not run in chunks beside decoding"
    if layout == "continuous-disaggregated-chunked":
        assert any(step.chunk for step in results[0].schedule), "the prompt stages ran no chunks"
    for index, result in enumerate(results[:3]):
        tokens, steps, prompt_values = expected[index % 2]
        assert result.tokens.tolist() == tokens
        assert result.logprobs is not None
        assert len(result.logprobs) == NEW
        for entry, (value, top) in zip(result.logprobs, steps, strict=True):
            assert entry.logprob == pytest.approx(value, abs=1e-5)
            assert [token for token, _ in entry.top] == top
            assert [value for _, value in entry.top] == sorted((value for _, value in entry.top), reverse=True)
        assert result.prompt_logprobs is not None
        assert result.prompt_logprobs[0] is None
        assert [entry.logprob for entry in result.prompt_logprobs[1:]] == pytest.approx(prompt_values, abs=1e-4)
        assert all(len(entry.top) == PROMPT_TOP for entry in result.prompt_logprobs[1:])
        # the prompt's entries first, then each token after its own entry
        events = streamed[index]
        assert [kind for kind, _ in events] == ["logprobs"] + ["logprobs", "token"] * NEW
        assert events[0][1] == PromptLogprobs(result.prompt_logprobs)
        assert [value for kind, value in events if kind == "token"] == tokens
        assert [value for kind, value in events[1:] if kind == "logprobs"] == list(result.logprobs)
    for lead in results[3:]:
        assert (lead.logprobs, lead.prompt_logprobs) == (None, None)
        assert lead.tokens.tolist()[:NEW] == expected[2][0]


def test_logprob_counts_are_checked() -> None:
    for bad in (-1, MAX_LOGPROBS + 1, True, 1.5, "2"):
        with pytest.raises(dv.ConfigError, match="logprobs"):
            Decoding.of(logprobs=bad)
        with pytest.raises(dv.ConfigError, match="prompt_logprobs"):
            Decoding.of(prompt_logprobs=bad)
    decoding = Decoding.of(do_sample=True, seed=3, logprobs=0, prompt_logprobs=MAX_LOGPROBS)
    assert (decoding.logprobs, decoding.prompt_logprobs) == (0, MAX_LOGPROBS)


def test_the_engine_refuses_logprobs_it_does_not_compute() -> None:
    engine = dv.DejaVuEngine(tiny_models.llama())
    with pytest.raises(dv.ConfigError, match="logprobs"):
        engine.generate_many([PROMPTS[1]], 2, logprobs=1)


def test_prompt_scores_of_chunks_concatenate_to_those_of_the_whole(monkeypatch) -> None:
    torch.manual_seed(0)
    weight = torch.randn(16, 8)
    hidden = torch.randn(2, 9, 8)
    prompts = {0: ([3, 1, 4, 1, 5, 9, 2], 2), 1: ([6, 5, 3, 5, 8, 9, 7, 9, 3], 0)}  # row 0 left-padded by 2

    def head(states: torch.Tensor) -> torch.Tensor:
        return states @ weight.T

    whole = {row: entries for row, (first, entries) in prompt_scores(head, hidden, 0, 9, prompts).items()
             if first == 1}
    chunked: dict[int, dict] = {0: {}, 1: {}}
    for start in range(0, 9, 4):
        for row, (first, entries) in prompt_scores(head, hidden[:, start:start + 4], start, 9, prompts).items():
            chunked[row].update(enumerate(entries, start=first))  # by the index of the prompt token
    for row in whole:  # equal up to the rounding of products of another shape
        pieces = [chunked[row][index] for index in sorted(chunked[row])]
        assert sorted(chunked[row]) == list(range(1, len(prompts[row][0])))
        assert [entry[1] for entry in pieces] == [entry[1] for entry in whole[row]]
        assert [entry[0] for entry in pieces] == pytest.approx([entry[0] for entry in whole[row]], abs=1e-5)
    assert [len(whole[0]), len(whole[1])] == [6, 8]
    values = torch.log_softmax(head(hidden[0, 2:8]), -1)
    assert [entry[0] for entry in whole[0]] == pytest.approx([float(values[index, token])
                                                              for index, token in enumerate(prompts[0][0][1:])])
    monkeypatch.setattr(logprobs, "SCORED_COLUMNS", 3)  # a long prompt's logits made a few positions at a time
    blocked = prompt_scores(head, hidden, 0, 9, prompts)[1][1]
    assert [entry[1] for entry in blocked] == [entry[1] for entry in whole[1]]
    assert [entry[0] for entry in blocked] == pytest.approx([entry[0] for entry in whole[1]], abs=1e-5)


def test_rows_of_one_prompt_in_a_microbatch_have_it_scored_once_and_share_its_entries() -> None:
    """A request's n choices with echo: the first row of each prompt (and top count) asks the last stage for the
    prompt's log-probabilities; the others get its entries."""
    echo, fewer = Decoding.of(prompt_logprobs=2), Decoding.of(prompt_logprobs=1)
    choices = [Request(PROMPTS[1], 3, decoding) for decoding in (echo, echo, Decoding.of(), fewer, echo)]
    other = Request(PROMPTS[2], 3, echo)
    batch = SlotBatch.open(0, pad=0, policy=STATIC)
    everyone, _, _ = batch.enter([*choices, other])
    asking = ["prompt" in fields for fields in everyone.specs.decoding]
    assert asking == [True, False, False, True, False, True]  # the third asks for none, the fourth fewer
    entries = [[-1.5, [9, 4], [-0.5, -1.0]], [-2.0, [7, 3], [-0.25, -2.0]], [-0.75, [4, 1], [-0.5, -0.75]]]
    top_one = [[value, ids[:1], values[:1]] for value, ids, values in entries]
    members = everyone.members
    batch.add_tokens(members, [1] * 6, Scores(prompt_logprobs={str(members[0]): [1, entries],
                                                               str(members[3]): [1, top_one]}))
    assert batch.prompt_entries(4) == batch.prompt_entries(1) == batch.prompt_entries(0)
    assert batch.prompt_entries(0) is not None
    assert len(batch.prompt_entries(0)[1].top) == 2
    assert batch.prompt_entries(5) is None  # its own prompt's are not in yet
    slot = SlotBatch.open(1, pad=0)
    slot.enter(choices[:1])
    group, _, _ = slot.enter([choices[1], choices[4]])  # a later group scores its prompt itself
    assert ["prompt" in decoding for decoding in group.specs.decoding] == [True, False]
    assert slot.prompt_sources == {2: 1}
