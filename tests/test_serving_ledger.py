"""The head's ledger decides without processes: what starts, what each report means, what to send."""

from __future__ import annotations

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.admission import Admission
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding, RowFailure
from dejavu_sdk.generation.slots import Round
from dejavu_sdk.serving.head.ledger import Ledger, Phase
from dejavu_sdk.serving.layout import Layout
from dejavu_sdk.serving.wire.messages import (
    Cancel,
    Decode,
    Drop,
    End,
    Enter,
    OpenSlot,
    Prefill,
    Prefilled,
    RoundDone,
    Start,
)

EOS = [2]
MIXED = Layout([[(0, 1), (1, 3)]])
DISAGGREGATED = Layout([[(0, 3)], [(0, 2), (2, 3)]])


def _ledger(layout: Layout = MIXED, budget: int | None = None, microbatch: int = 2, slots: int = 2) -> Ledger:
    return Ledger(layout, microbatch, slots, EOS, 0, Admission(budget, False, bytes_per_token=1))


def _requests(*limits: int) -> list[Request]:
    return [Request(torch.tensor([5, 6, 7]), limit, Decoding()) for limit in limits]


def test_a_mixed_pipeline_admits_one_microbatch_per_stage_and_the_next_when_one_is_freed() -> None:
    ledger = _ledger()
    ledger.queue(_requests(3, 3, 3, 3, 3))
    sends = ledger.admit()
    assert [(stage, type(message)) for stage, message in sends] == [(0, Prefill), (0, Prefill)]
    assert ledger.admit() == []  # both stages hold a microbatch
    ledger.on_ended(0, freed=False)
    assert ledger.admit() == []  # ended, but a stage still holds its cache
    ledger.on_freed(0)
    assert [message.microbatch for _, message in ledger.admit()] == [2]


def test_a_budget_admits_only_what_fits() -> None:
    ledger = _ledger(budget=2 * 5)  # one row of 3 prompt + 3 new positions - 1, twice
    ledger.queue(_requests(3, 3, 3))
    (first,) = ledger.admit()
    assert first[1].inputs.shape[0] == 2  # two rows fit together, the third waits
    assert ledger.admit() == []


def test_a_row_is_answered_at_its_own_end_and_a_failed_row_alone_fails() -> None:
    ledger = _ledger(microbatch=3)
    requests = _requests(2, 5, 5)
    streamed: list[int] = []
    requests[2].on_token = streamed.append
    ledger.queue(requests)
    ledger.admit()
    ledger.on_tokens(0, [7, 8, 9], None, {})
    outcome = ledger.on_tokens(0, [4, 8, 0], None, {2: RowFailure("its logits are not finite")})
    assert [token for _, token in outcome.calls] == []  # the failed row's padding is no token of its own
    answered = {requests.index(next(r for r in requests if r.future is future)): result
                for future, result in outcome.answers}
    assert answered[0].tokens.tolist() == [7, 4]  # its own max_new_tokens
    assert isinstance(answered[2], dv.RequestFailed)
    assert not answered[2].input_error
    assert 1 not in answered  # the long row goes on
    ending = ledger.on_ended(0, freed=True)
    assert [future for future, _ in ending.answers] == [requests[1].future]  # only the one not answered yet


def test_a_cancelled_waiting_request_leaves_the_queue_and_a_running_row_is_ended_by_the_last_stage() -> None:
    ledger = _ledger(microbatch=1)
    requests = _requests(5, 5, 5)
    ledger.queue(requests)
    ledger.admit()
    assert ledger.cancel(requests[2]) == []
    assert len(ledger.waiting) == 0
    ((stage, message),) = ledger.cancel(requests[0])
    assert (stage, message) == (0, Cancel(microbatch=0, rows=[0], epoch=0))


def test_a_cancel_during_a_recovery_sends_nothing_and_the_resumed_microbatch_carries_it() -> None:
    ledger = _ledger(microbatch=2)
    requests = _requests(5, 5)
    ledger.queue(requests)
    ledger.admit()
    ledger.on_tokens(0, [4, 4], None, {})
    ledger.held = True  # a recovery is under way: its stages may be replacements not yet assigned
    assert ledger.cancel(requests[1]) == []
    sends = ledger.resume({0: 1}, [], [], []).sends
    assert [type(message) for _, message in sends] == [Decode, Cancel]
    assert sends[1][1].rows == [1]
    ledger.seen_by_recovery(0)
    assert ledger.flights[0].batch.seen_by_recovery == 1


def test_a_staged_microbatch_starts_on_a_free_token_stage_carrying_rows_cancelled_meanwhile() -> None:
    ledger = _ledger(DISAGGREGATED, microbatch=2, slots=3)
    requests = _requests(4, 4)
    ledger.queue(requests)
    assert [stage for stage, _ in ledger.admit()] == [0]
    ledger.on_prefilled(_prefilled(0, torch.tensor([[7], [8]]), torch.ones(2, 3, dtype=torch.long)),
                        keep_states=False)
    assert ledger.flights[0].phase is Phase.STAGED
    assert ledger.cancel(requests[1]) == []  # not decoding yet: its start will carry it
    ((stage, start),) = ledger.admit()
    assert (stage, type(start)) == (1, Start)  # the first token stage
    assert start.ended.tolist() == [0, 1]


def test_a_failed_microbatch_is_dropped_everywhere_and_its_room_comes_back() -> None:
    ledger = _ledger(microbatch=1)
    requests = _requests(5, 5, 5)
    ledger.queue(requests)
    ledger.admit()
    outcome = ledger.on_microbatch_failed(0, "stage 1 failed on it: RuntimeError: boom")
    assert outcome.sends == [(0, Drop(microbatches=[0], failed=True)), (1, Drop(microbatches=[0], failed=True))]
    ((future, error),) = outcome.answers
    assert future is requests[0].future
    assert isinstance(error, dv.RequestFailed)
    assert [message.microbatch for _, message in ledger.admit()] == [2]  # its room went to the next


def test_a_failed_pipeline_fails_everything_and_refuses_more() -> None:
    ledger = _ledger(microbatch=1)
    requests = _requests(5, 5, 5)
    ledger.queue(requests)
    ledger.admit()
    error = dv.TransportError("gone")
    assert [future for future, _ in ledger.fail_all(error)] == [request.future for request in requests]
    with pytest.raises(dv.TransportError):
        ledger.queue(_requests(1))


def test_resuming_feeds_resumed_microbatches_their_step_restarts_the_others_and_fails_poison() -> None:
    ledger = _ledger(microbatch=1)
    requests = _requests(9, 9, 9)
    ledger.queue(requests)
    ledger.admit()
    for tokens in ([4], [5], [6]):
        ledger.on_tokens(0, tokens, None, {})
    ledger.held = True
    outcome = ledger.resume({0: 2}, [1], [], [])
    decode, prefill = (message for _, message in outcome.sends)
    assert [(stage, type(message)) for stage, message in outcome.sends] == [(0, Decode), (0, Prefill)]
    assert decode.inputs.tolist() == [[5]]  # the token of step 2, fed again
    assert prefill.ended == []
    assert not ledger.held
    ledger.cancel(requests[1])  # a row cancelled before its microbatch starts over is not computed again
    ledger.held = True
    assert ledger.resume({}, [1], [], []).sends[0][1].ended == [0]
    ledger.held = True
    failed = ledger.resume({}, [], [], [0])
    assert isinstance(failed.answers[0][1], dv.RequestFailed)
    assert "two recoveries in a row" in str(failed.answers[0][1])


# ---- continuous batching: slots ------------------------------------------------------------------------
def _slots(layout: Layout = MIXED, budget: int | None = None, microbatch: int = 3) -> Ledger:
    return Ledger(layout, microbatch, 2, EOS, 0, Admission(budget, False, bytes_per_token=1), continuous=True)


def _round(members, left=(), joined=(), decoded=(), prefill=None, complete=(), idle=False) -> RoundDone:
    columns = None if prefill is None else (tuple(prefill[0]), prefill[1], prefill[2])
    return RoundDone(Round(tuple(left), tuple(joined), tuple(decoded), columns), list(members), list(complete), idle,
                     ([], None), {})


def _prefilled(number: int, tokens: torch.Tensor, mask: torch.Tensor, ended: torch.Tensor | None = None) -> Prefilled:
    """The prompt pipeline's report of microbatch (or group) `number`'s first tokens."""
    ended = torch.zeros(len(tokens), dtype=torch.uint8) if ended is None else ended
    return Prefilled(microbatch=number, tokens=tokens, mask=mask, ended=ended, rng=torch.empty(0, dtype=torch.uint8))


def test_a_slot_opens_with_a_group_and_takes_another_when_rows_leave() -> None:
    ledger = _slots(microbatch=2)
    requests = _requests(1, 4, 3, 3)
    ledger.queue(requests)
    sends = ledger.admit()  # two slots (one per stage), two rows each
    assert [(stage, type(message), message.group.members) for stage, message in sends] == [
        (0, OpenSlot, [requests[0].number, requests[1].number]),
        (0, OpenSlot, [requests[2].number, requests[3].number])]
    slot = sends[0][1].microbatch
    first, second = requests[0].number, requests[1].number
    more = _requests(3)
    ledger.queue(more)
    outcome = ledger.on_round(slot, _round([first, second], prefill=[[first, second], 0, 3],
                                           complete=[first, second]), [7, 8])
    assert [result.tokens.tolist() for _, result in outcome.answers] == [[7]]  # max_new_tokens 1: answered
    assert ledger.admit() == []  # its row leaves only at the next round
    ledger.on_round(slot, _round([second], joined=[second], decoded=[second]), [9])
    (enter,) = ledger.admit()  # the round told that the first row never joined: room for one
    assert (type(enter[1]), enter[1].group.members) == (Enter, [more[0].number])
    assert ledger.status()["microbatches"][0] == {"microbatch": slot, "rows": 2, "steps": 2}


def test_an_idle_slot_takes_waiting_requests_waits_for_a_group_bound_for_it_and_else_ends() -> None:
    ledger = _slots(layout=Layout([[(0, 3)]]), microbatch=2)
    requests = _requests(2, 2, 2, 2)
    first, second, third = (request.number for request in requests[:3])
    ledger.queue(requests[:1])
    (opened,) = ledger.admit()
    slot = opened[1].microbatch
    ledger.on_round(slot, _round([first], prefill=[[first], 0, 3], complete=[first]), [7])
    ledger.queue(requests[1:2])
    assert ledger.admit() == []  # one group on its way in at a time
    answers = ledger.on_round(slot, _round([first], joined=[first], decoded=[first]), [8]).answers  # its last
    (enter,) = ledger.admit()
    assert (type(enter[1]), enter[1].group.members) == (Enter, [second])
    ledger.on_round(slot, _round([], left=[first], idle=True), [])  # parked before the enter came
    assert ledger.admit() == []  # not ended: a group is bound for it, and wakes it
    ledger.on_round(slot, _round([second], prefill=[[second], 0, 3], complete=[second]), [7])
    answers += ledger.on_round(slot, _round([second], joined=[second], decoded=[second]), [8]).answers
    ledger.queue(requests[2:3])
    ledger.on_round(slot, _round([], left=[second], idle=True), [])
    (enter,) = ledger.admit()  # an idle slot takes a waiting request rather than end
    assert (type(enter[1]), enter[1].group.members) == (Enter, [third])
    ledger.on_round(slot, _round([third], prefill=[[third], 0, 3], complete=[third]), [7])
    answers += ledger.on_round(slot, _round([third], joined=[third], decoded=[third]), [8]).answers
    ledger.on_round(slot, _round([], left=[third], idle=True), [])
    ((stage, end),) = ledger.admit()  # idle, nothing bound for it: it ends
    assert (stage, end) == (0, End(microbatch=slot))
    assert ledger.status()["microbatches"] == []
    ledger.queue(requests[3:])
    assert ledger.admit() == []  # its room is free once every stage let its cache go
    ledger.on_freed(slot)
    (opened,) = ledger.admit()
    assert (type(opened[1]), opened[1].group.members) == (OpenSlot, [requests[3].number])
    assert [(future, result.tokens.tolist()) for future, result in answers] == [
        (request.future, [7, 8]) for request in requests[:3]]


def test_a_member_taken_out_of_its_queued_group_is_no_longer_on_its_way_in() -> None:
    ledger = _slots(layout=Layout([[(0, 3)]]), microbatch=2)
    requests = _requests(4, 4, 4)
    first, second, third = (request.number for request in requests)
    ledger.queue(requests[:1])
    (opened,) = ledger.admit()
    slot = opened[1].microbatch
    ledger.on_round(slot, _round([first], prefill=[[first], 0, 3], complete=[first]), [7])
    ledger.on_round(slot, _round([first], joined=[first], decoded=[first]), [8])
    ledger.queue(requests[1:2])
    (enter,) = ledger.admit()
    requests[1].future.cancel()
    ((stage, cancel),) = ledger.cancel(requests[1])
    assert (stage, cancel) == (0, Cancel(microbatch=slot, rows=[second]))
    ledger.queue(requests[2:])
    assert ledger.admit() == []  # the cancelled row may still be joining
    ledger.on_not_entered(slot, [second])  # the first stage took it out of the queued group
    (enter,) = ledger.admit()
    assert (type(enter[1]), enter[1].group.members) == (Enter, [third])
    assert ledger.cancel(requests[1]) == []  # settled: nothing more to send


def test_slot_admission_counts_rows_within_the_budget() -> None:
    # a row of 3 prompt + 3 new positions - 1 = 5 bytes; a slot reserves each row at its longest row's end
    ledger = _slots(layout=Layout([[(0, 3)]]), budget=2 * 5, microbatch=4)
    requests = _requests(3, 3, 3)
    ledger.queue(requests)
    (opened,) = ledger.admit()
    assert opened[1].group.members == [requests[0].number, requests[1].number]  # two rows fit, not three
    assert ledger.admit() == []


def test_a_cancelled_member_of_a_slot_is_ended_by_the_first_stage() -> None:
    ledger = _slots()
    requests = _requests(5, 5)
    ledger.queue(requests)
    (opened,) = ledger.admit()
    requests[1].future.cancel()
    ((stage, cancel),) = ledger.cancel(requests[1])
    assert (stage, cancel) == (0, Cancel(microbatch=opened[1].microbatch, rows=[requests[1].number]))
    outcome = ledger.on_round(opened[1].microbatch,
                              _round([r.number for r in requests], prefill=[[r.number for r in requests], 0, 3]),
                              [7, 8])
    assert [token for _, token in outcome.calls] == []  # no callbacks; the cancelled row is answered by nobody
    assert all(future is not requests[1].future for future, _ in outcome.answers)


def test_disaggregated_a_group_goes_to_the_prompt_pipeline_then_to_its_slot_with_its_first_tokens() -> None:
    ledger = _slots(layout=DISAGGREGATED, microbatch=2)
    requests = _requests(1, 4)
    ledger.queue(requests)
    ((stage, prefill),) = ledger.admit()  # one group: the prompt pipeline has one stage
    assert (stage, type(prefill)) == (0, Prefill)
    group = prefill.microbatch
    tokens, ended = torch.tensor([[2], [9]]), torch.tensor([1, 0], dtype=torch.uint8)  # the first ends at an eos
    outcome = ledger.on_group_prefilled(_prefilled(group, tokens, prefill.mask, ended))
    ((index, start),) = outcome.sends
    assert (index, type(start)) == (DISAGGREGATED.prompt_depth, OpenSlot)  # it opens its slot
    assert start.staged is not None
    assert (start.staged.number, start.staged.first, start.staged.ended) == (group, [2, 9], [requests[0].number])
    (answered,) = outcome.answers
    assert answered[0] is requests[0].future
    requests[1].future.cancel()
    ((stage, cancel),) = ledger.cancel(requests[1])  # to the first token stage, which holds the slot
    assert (stage, type(cancel)) == (DISAGGREGATED.prompt_depth, Cancel)
    assert [r.prefill for r in answered[1].schedule] == [((requests[0].number, requests[1].number), 0, 3)]


@pytest.mark.parametrize("where", ["prompting", "staged"])
def test_disaggregated_a_failed_slot_has_the_token_stages_drop_the_group_bound_for_it(where) -> None:
    ledger = _slots(layout=DISAGGREGATED, microbatch=2)
    requests = _requests(4, 4)
    first, second = (request.number for request in requests)

    def prefilled(prefill: Prefill) -> Enter:
        ((_, start),) = ledger.on_group_prefilled(_prefilled(prefill.microbatch, torch.full((len(prefill.mask), 1), 9),
                                                             prefill.mask)).sends
        assert isinstance(start, Enter)
        return start

    ledger.queue(requests[:1])
    ((_, prefill),) = ledger.admit()
    slot = prefilled(prefill).microbatch
    ledger.on_round(slot, _round([], prefill=[[first], 0, 3], complete=[first]), [])  # the token stage took it
    ledger.on_round(slot, _round([first], joined=[first], decoded=[first]), [10])
    ledger.queue(requests[1:])
    ((_, prefill),) = ledger.admit()  # bound for the same slot
    group = prefill.microbatch
    if where == "staged":  # its KV is staged on the token stages, and its enter on its way
        staged = prefilled(prefill)
        assert (type(staged), staged.microbatch, staged.group.members) == (Enter, slot, [second])
    failed = ledger.on_microbatch_failed(slot, "a token stage failed on it")
    assert [stage for stage, _ in failed.sends] == list(range(len(DISAGGREGATED.stages)))  # prompt stages too
    assert {tuple(sorted(message.microbatches)) for _, message in failed.sends} == {(slot, group)}
    assert [future for future, _ in failed.answers] == [request.future for request in requests]
    assert all(isinstance(error, dv.RequestFailed) for _, error in failed.answers)
    assert ledger.on_group_prefilled(_prefilled(group, torch.full((1, 1), 9), prefill.mask)).sends == []  # let go
