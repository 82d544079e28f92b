"""Fair shares at the head, decided without processes: turns between submissions go to the one with the fewest rows
in flight, a request held back by a large one gets a microbatch (or slot) beside it that the large one does not
take, and a request that could never be admitted is refused when it is submitted, exactly then."""

from __future__ import annotations

from collections import deque

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.admission import Admission
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.slot_policy import CONTINUOUS, STATIC
from dejavu_sdk.generation.slots import Round
from dejavu_sdk.generation.turns import take_microbatch
from dejavu_sdk.serving.head.ledger import Ledger
from dejavu_sdk.serving.layout import Layout
from dejavu_sdk.serving.wire.messages import Enter, Message, OpenSlot, Prefill, Prefilled, RoundDone
from dejavu_sdk.swapping import positions_needed

ONE_STAGE = Layout([[(0, 3)]])
EOS = [2]


def _large(count: int, new_tokens: int = 16) -> list[Request]:
    """One request's `count` choices: one submission."""
    first = Request(torch.tensor([5, 6, 7]), new_tokens, Decoding())
    return [first, *(Request(torch.tensor([5, 6, 7]), new_tokens, Decoding(), group=first.group)
                     for _ in range(count - 1))]


def _one() -> Request:
    return Request(torch.tensor([9]), 4, Decoding())


def _opened(sends) -> list[tuple[type, list[int]]]:
    return [(type(message), message.group.members) for _, message in sends]


def _limits(message: Message) -> list[int]:
    """The rows' `max_new_tokens` of a static microbatch's `Prefill`, or of a group entering a slot."""
    assert isinstance(message, (Prefill, Enter))
    return message.specs.max_new_tokens if isinstance(message, Prefill) else message.group.specs.max_new_tokens


def _round(members, left=(), joined=(), decoded=(), prefill=None, complete=()) -> RoundDone:
    columns = None if prefill is None else (tuple(prefill[0]), prefill[1], prefill[2])
    return RoundDone(Round(tuple(left), tuple(joined), tuple(decoded), columns), list(members), list(complete), False,
                     ([], None), {})


def test_turns_go_first_to_the_submission_with_the_fewest_rows_in_flight() -> None:
    large, late = _large(6), _one()
    waiting = deque([*large, late])
    # one row free: the large request, older but holding four rows, waits its turn
    assert take_microbatch(waiting, 1, shares={large[0].group: 4}) == [late]
    waiting.appendleft(late)
    assert take_microbatch(waiting, 3, shares={late.group: 1}) == [large[0], late, large[1]]  # none held first
    assert take_microbatch(waiting, 3, shares={large[0].group: 2}, barred={large[0].group}) == []
    assert list(waiting) == large[2:]


@pytest.mark.parametrize("policy", [CONTINUOUS, STATIC], ids=["slots", "static"])
def test_a_request_held_back_by_a_large_one_gets_a_microbatch_beside_it_that_the_large_one_does_not_take(
        policy) -> None:
    ledger = Ledger(ONE_STAGE, 4, 1, EOS, 0, Admission(None, False, bytes_per_token=1), policy=policy)
    large, late = _large(12), _one()
    ledger.queue(large)
    (opened,) = ledger.admit()
    assert _limits(opened[1]) == [16] * 4  # the stage's one microbatch, full of the large one's
    assert ledger.admit() == []
    ledger.queue([late])
    (beside,) = ledger.admit()  # not after the large one's sixteen steps: at once, beside it, alone
    assert (type(beside[1]), _limits(beside[1])) == (OpenSlot, [4])
    assert ledger.admit() == []  # the large one takes no row of it, nor a third microbatch
    assert [flight.beside for flight in ledger.flights.values()] == [False, True]


def test_disaggregated_a_microbatch_beside_a_large_one_is_prompted_and_decodes_beside_it() -> None:
    ledger = Ledger(Layout([[(0, 3)], [(0, 3)]]), 4, 1, EOS, 0, Admission(None, False, bytes_per_token=1))
    large, late = _large(12), _one()
    ledger.queue(large)
    (prefill,) = ledger.admit()  # to the prompt stage
    assert (prefill[0], type(prefill[1]), len(_limits(prefill[1]))) == (0, Prefill, 4)
    ledger.queue([late])
    assert ledger.admit() == []  # the prompt stage runs the large one's group
    prefilled = ledger.slots.on_group_prefilled(Prefilled(
        microbatch=prefill[1].microbatch, tokens=torch.full((4, 1), 7), mask=torch.ones(4, 3, dtype=torch.long),
        ended=torch.zeros(4, dtype=torch.uint8), rng=torch.empty(0, dtype=torch.uint8)))
    assert [(stage, type(message)) for stage, message in prefilled.sends] == [(1, OpenSlot)]  # to its slot
    (beside,) = ledger.admit()  # the late one's group, prompted for a slot beside the large one's
    assert (beside[0], type(beside[1]), _limits(beside[1])) == (0, Prefill, [4])
    assert [flight.beside for flight in ledger.flights.values()] == [False, True]
    assert ledger.admit() == []


@pytest.mark.parametrize("policy", [CONTINUOUS, STATIC], ids=["slots", "static"])
def test_requests_of_their_own_share_the_layouts_microbatches_as_before(policy) -> None:
    """One row each is every submission's share: none is held back, and nothing opens beside."""
    ledger = Ledger(ONE_STAGE, 4, 1, EOS, 0, Admission(None, False, bytes_per_token=1), policy=policy)
    ledger.queue([_one() for _ in range(7)])
    (opened,) = ledger.admit()
    assert len(_limits(opened[1])) == 4
    assert ledger.admit() == []


def test_a_row_that_leaves_a_slot_goes_to_the_submission_holding_fewest_rows() -> None:
    ledger = Ledger(ONE_STAGE, 2, 1, EOS, 0, Admission(None, False, bytes_per_token=1))
    large = _large(6)
    large[0].max_new_tokens = 1  # its first choice ends at its first token
    first, second = large[0].number, large[1].number
    ledger.queue(large)
    (opened,) = ledger.admit()
    slot = opened[1].microbatch
    held_back, later = _one(), _one()
    ledger.queue([held_back])
    assert _opened(ledger.admit()) == [(OpenSlot, [held_back.number])]  # beside it
    ledger.queue([later])  # the slot beside is taking its first group in, and no third slot opens
    assert ledger.admit() == []
    ledger.slots.on_round(slot, _round([first, second], prefill=[[first, second], 0, 3], complete=[first, second]),
                          [7, 8])
    ledger.slots.on_round(slot, _round([second], joined=[second], decoded=[second]), [9])  # the first row has left
    assert _opened(ledger.admit()) == [(Enter, [later.number])]  # not the large one's third, older choice


@pytest.mark.parametrize(("policy", "swapping", "alone"), [
    (STATIC, False, 1), (STATIC, True, 1),  # a static microbatch of its own: with swapping, any two on the device
    (CONTINUOUS, False, 1), (CONTINUOUS, True, 2),  # a slot: with swapping, its group's own cache counts until it
])  # joins
def test_a_request_is_refused_exactly_when_admission_could_never_take_it(policy, swapping, alone) -> None:
    per_position, prompt = 3, 5
    budget = alone * positions_needed(prompt, 7) * per_position  # seven new tokens fit, not eight
    admission = Admission(budget, swapping, per_position)
    for new_tokens, fits in ((7, True), (8, False)):
        request = Request(torch.arange(1, prompt + 1), new_tokens, Decoding())
        taken = policy.take(admission, deque([request]), 4, [], [])
        assert bool(taken) is fits  # alone, with nothing in flight
        if fits:
            policy.check_alone(admission, request)
            continue
        with pytest.raises(dv.RequestTooLarge) as refused:
            policy.check_alone(admission, request)
        needed = alone * positions_needed(prompt, 8) * per_position
        assert (refused.value.needed, refused.value.budget, refused.value.most_new_tokens) == (needed, budget, 7)
        assert f"needs {needed} bytes" in str(refused.value)
        assert f"the {budget} bytes each stage gives" in str(refused.value)
    assert isinstance(refused.value, dv.ConfigError)
    with pytest.raises(dv.RequestTooLarge, match="even its prompt alone does not fit") as refused:
        policy.check_alone(admission, Request(torch.arange(1, budget + 2), 1, Decoding()))
    assert refused.value.most_new_tokens is None


def test_n_choices_are_rows_of_their_own_each_checked_alone() -> None:
    admission = Admission(positions_needed(3, 4), False, 1)
    choices = _large(8, new_tokens=4)
    for choice in choices:
        CONTINUOUS.check_alone(admission, choice)  # each fits alone; eight together do not
    waiting = deque(choices)
    assert admission.take_rows(waiting, 8, [], []) == choices[:1]
