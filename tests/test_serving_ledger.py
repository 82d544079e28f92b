"""The head's ledger decides without processes: what starts, what each report means, what to send."""

from __future__ import annotations

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.admission import Admission
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.slot_policy import STATIC
from dejavu_sdk.generation.slots import Round
from dejavu_sdk.serving.head.ledger import Ledger, stream
from dejavu_sdk.serving.head.ledger_slots import QUEUED_ROUNDS, _prefill_left
from dejavu_sdk.serving.layout import Layout
from dejavu_sdk.serving.wire.messages import (
    Cancel,
    Drop,
    End,
    Enter,
    OpenSlot,
    Prefill,
    Prefilled,
    RoundDone,
)

EOS = [2]
MIXED = Layout([[(0, 1), (1, 3)]])
DISAGGREGATED = Layout([[(0, 3)], [(0, 2), (2, 3)]])


def _ledger(layout: Layout = MIXED, budget: int | None = None, microbatch: int = 2, slots: int = 2) -> Ledger:
    """A ledger of static slots (`batching="static"`)."""
    return Ledger(layout, microbatch, slots, EOS, 0, Admission(budget, False, bytes_per_token=1), policy=STATIC)


def _requests(*limits: int) -> list[Request]:
    return [Request(torch.tensor([5, 6, 7]), limit, Decoding()) for limit in limits]


def test_a_static_slot_takes_one_microbatch_keeps_its_ended_rows_and_ends_when_they_all_left() -> None:
    ledger = _ledger()
    requests = _requests(1, 3, 3, 3, 3)
    ledger.queue(requests)
    sends = ledger.admit()  # a slot per stage, a microbatch each
    assert [(stage, type(message), message.group.members) for stage, message in sends] == [
        (0, OpenSlot, [requests[0].number, requests[1].number]),
        (0, OpenSlot, [requests[2].number, requests[3].number])]
    slot, (first, second) = sends[0][1].microbatch, sends[0][1].group.members
    outcome = ledger.slots.on_round(slot, _round([first, second], prefill=[[first, second], 0, 3],
                                           complete=[first, second]), [7, 8])
    assert [result.tokens.tolist() for _, result in outcome.answers] == [[7]]  # its one token: answered
    ledger.slots.on_round(slot, _round([second], joined=[first, second], decoded=[first, second]), [9])
    assert ledger.admit() == []  # a static slot takes no row beside the ended one, which stays as padding
    outcome = ledger.slots.on_round(slot, _round([second], decoded=[first, second]), [10])
    (result,) = [result for _, result in outcome.answers]
    assert (result.tokens.tolist(), result.microbatch, result.row, result.rows, result.padding) == (
        [8, 9, 10], slot, 1, 2, 0)
    assert result.schedule == ()  # `model.generate` on its microbatch: no schedule
    assert result.request == -1
    ledger.slots.on_round(slot, _round([], left=[first, second], idle=True), [])
    ((stage, enter),) = ledger.admit()  # its rows left together: the slot takes the next microbatch at once
    assert (stage, type(enter), enter.microbatch, enter.group.members) == (0, Enter, slot, [requests[4].number])
    (last,) = [member for member in enter.group.members]
    ledger.slots.on_round(slot, _round([last], prefill=[[last], 0, 3], complete=[last]), [7])
    outcome = ledger.slots.on_round(slot, _round([last], joined=[last], decoded=[last]), [8])
    outcome = ledger.slots.on_round(slot, _round([last], decoded=[last]), [9])
    ((_, result),) = outcome.answers
    assert result.microbatch not in (slot, sends[1][1].microbatch)  # a microbatch of its own in the results
    assert (result.row, result.rows, result.tokens.tolist()) == (0, 1, [7, 8, 9])


def test_a_static_slot_reserves_its_padded_microbatch_within_the_budget() -> None:
    ledger = _ledger(budget=2 * 5)  # one row of 3 prompt + 3 new positions - 1, twice
    ledger.queue(_requests(3, 3, 3))
    (first,) = ledger.admit()
    assert len(first[1].group.members) == 2  # two rows fit together, the third waits
    assert ledger.admit() == []


def test_a_lost_static_slot_starts_its_microbatch_over_where_each_row_sat_and_streams_nothing_twice() -> None:
    ledger = _ledger(microbatch=3, slots=1, layout=Layout([[(0, 3)]]))
    streamed: list[list[int]] = [[], [], []]
    requests = [Request(torch.tensor([5, 6, 7][:length]), limit, Decoding(),
                        on_token=lambda token, row=row: streamed[row].append(token))
                for row, (length, limit) in enumerate([(3, 1), (2, 4), (3, 4)])]
    ledger.queue(requests)
    ((_, opened),) = ledger.admit()
    members = opened.group.members
    outcome = ledger.slots.on_round(opened.microbatch, _round(members, prefill=[members, 0, 3], complete=members),
                                    [7, 8, 9])
    stream(outcome.calls)
    ledger.resumes.slots_to_recover(1)
    restarted = ledger.resumes.resume_slots({}, {opened.microbatch: "recovery='recompute' keeps no replica"})
    (_, again), (_, cancel) = restarted.sends
    assert (type(again), again.group.members) == (OpenSlot, members)  # the same rows, in the same order
    assert torch.equal(again.mask, opened.mask)  # each row's padding as it was
    assert cancel == Cancel(microbatch=again.microbatch, rows=[members[0]])  # answered: padding now
    assert [result.tokens.tolist() for _, result in outcome.answers] == [[7]]
    stream(ledger.slots.on_round(again.microbatch, _round(members[1:], prefill=[members, 0, 3], complete=members),
                                 [8, 9]).calls)
    stream(ledger.slots.on_round(again.microbatch, _round(members[1:], joined=members, decoded=members),
                                 [10, 11]).calls)
    assert streamed == [[7], [8, 10], [9, 11]]  # the first tokens came once


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


# ---- continuous batching: slots that refill -------------------------------------------------------------
def _slots(layout: Layout = MIXED, budget: int | None = None, microbatch: int = 3) -> Ledger:
    return Ledger(layout, microbatch, 2, EOS, 0, Admission(budget, False, bytes_per_token=1))


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
    outcome = ledger.slots.on_round(slot, _round([first, second], prefill=[[first, second], 0, 3],
                                           complete=[first, second]), [7, 8])
    assert [result.tokens.tolist() for _, result in outcome.answers] == [[7]]  # max_new_tokens 1: answered
    assert ledger.admit() == []  # its row leaves only at the next round
    ledger.slots.on_round(slot, _round([second], joined=[second], decoded=[second]), [9])
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
    ledger.slots.on_round(slot, _round([first], prefill=[[first], 0, 3], complete=[first]), [7])
    ledger.queue(requests[1:2])
    assert ledger.admit() == []  # one group on its way in at a time
    answers = ledger.slots.on_round(slot, _round([first], joined=[first], decoded=[first]), [8]).answers  # its last
    (enter,) = ledger.admit()
    assert (type(enter[1]), enter[1].group.members) == (Enter, [second])
    ledger.slots.on_round(slot, _round([], left=[first], idle=True), [])  # parked before the enter came
    assert ledger.admit() == []  # not ended: a group is bound for it, and wakes it
    ledger.slots.on_round(slot, _round([second], prefill=[[second], 0, 3], complete=[second]), [7])
    answers += ledger.slots.on_round(slot, _round([second], joined=[second], decoded=[second]), [8]).answers
    ledger.queue(requests[2:3])
    ledger.slots.on_round(slot, _round([], left=[second], idle=True), [])
    (enter,) = ledger.admit()  # an idle slot takes a waiting request rather than end
    assert (type(enter[1]), enter[1].group.members) == (Enter, [third])
    ledger.slots.on_round(slot, _round([third], prefill=[[third], 0, 3], complete=[third]), [7])
    answers += ledger.slots.on_round(slot, _round([third], joined=[third], decoded=[third]), [8]).answers
    ledger.slots.on_round(slot, _round([], left=[third], idle=True), [])
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
    ledger.slots.on_round(slot, _round([first], prefill=[[first], 0, 3], complete=[first]), [7])
    ledger.slots.on_round(slot, _round([first], joined=[first], decoded=[first]), [8])
    ledger.queue(requests[1:2])
    (enter,) = ledger.admit()
    requests[1].future.cancel()
    ((stage, cancel),) = ledger.cancel(requests[1])
    assert (stage, cancel) == (0, Cancel(microbatch=slot, rows=[second]))
    ledger.queue(requests[2:])
    assert ledger.admit() == []  # the cancelled row may still be joining
    ledger.slots.on_not_entered(slot, [second])  # the first stage took it out of the queued group
    (enter,) = ledger.admit()
    assert (type(enter[1]), enter[1].group.members) == (Enter, [third])
    assert ledger.cancel(requests[1]) == []  # settled: nothing more to send


def test_with_a_prefill_budget_requests_arriving_together_enter_in_groups_of_a_round_each_queued_ahead() -> None:
    # prompts of 3 positions, 6 a round: groups of two rows, each in a round of its own; groups are sent while
    # those on their way have fewer than QUEUED_ROUNDS rounds of prompt left
    assert QUEUED_ROUNDS == 4
    ledger = Ledger(Layout([[(0, 3)]]), 10, 2, EOS, 0, Admission(None, False, bytes_per_token=1), prefill_tokens=6)
    requests = _requests(*[5] * 10)
    ledger.queue(requests)
    numbers = [request.number for request in requests]
    sends = ledger.admit()
    assert [(type(message), message.group.members) for _, message in sends] == [
        (OpenSlot, numbers[0:2]), (Enter, numbers[2:4]), (Enter, numbers[4:6]), (Enter, numbers[6:8])]
    slot = sends[0][1].microbatch
    assert ledger.admit() == []  # 4 rounds of prompt on their way: the rest wait
    ledger.slots.on_round(slot, _round(numbers[0:2], prefill=[numbers[0:2], 0, 3], complete=numbers[0:2]), [7, 7])
    (enter,) = ledger.admit()  # 3 rounds left: the last group goes
    assert (type(enter[1]), enter[1].group.members) == (Enter, numbers[8:10])
    ledger.slots.on_round(slot, _round(numbers[0:2], joined=numbers[0:2], decoded=numbers[0:2],
                                       prefill=[numbers[2:4], 0, 2]), [8, 8])
    assert _prefill_left(ledger.flights[slot].batch) == 2 * 1 + 3 * 2 * 3  # one column of the second group left


def test_a_group_takes_one_prompt_longer_than_a_round_alone() -> None:
    ledger = Ledger(Layout([[(0, 3)]]), 4, 2, EOS, 0, Admission(None, False, bytes_per_token=1), prefill_tokens=2)
    requests = _requests(5, 5)
    ledger.queue(requests)
    sends = ledger.admit()
    assert [message.group.members for _, message in sends] == [[requests[0].number], [requests[1].number]]


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
    outcome = ledger.slots.on_round(opened[1].microbatch,
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
    outcome = ledger.slots.on_group_prefilled(_prefilled(group, tokens, prefill.mask, ended))
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
        first = torch.full((len(prefill.mask), 1), 9)
        ((_, start),) = ledger.slots.on_group_prefilled(_prefilled(prefill.microbatch, first, prefill.mask)).sends
        assert isinstance(start, Enter)
        return start

    ledger.queue(requests[:1])
    ((_, prefill),) = ledger.admit()
    slot = prefilled(prefill).microbatch
    ledger.slots.on_round(slot, _round([], prefill=[[first], 0, 3], complete=[first]), [])  # the token stage took it
    ledger.slots.on_round(slot, _round([first], joined=[first], decoded=[first]), [10])
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
    assert ledger.slots.on_group_prefilled(_prefilled(group, torch.full((1, 1), 9), prefill.mask)).sends == []  # let go
