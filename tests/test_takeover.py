"""A successor head rebuilds a slot from the groups its journal names and the rounds the last stage reports, as
its predecessor's ledger had it; rounds that name a request the journal does not hold keep the slot from being
taken over (its requests are computed again) rather than break the successor's start."""

from __future__ import annotations

import types

import torch

from dejavu_sdk.generation.admission import Admission
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.logprobs import Scores
from dejavu_sdk.generation.slots import Round
from dejavu_sdk.serving.head.ledger import Ledger
from dejavu_sdk.serving.head.takeover import Takeover
from dejavu_sdk.serving.layout import Layout
from dejavu_sdk.serving.wire.messages import RoundDone

GROUPS = {7: [([11, 12], [["cmpl-a", 0], ["cmpl-b", 0]])]}


def _report(members: list[int], step: Round, tokens: list[int], complete: list[int] = (),
            joined: list[int] | None = None) -> tuple[RoundDone, list[int], Scores]:
    return RoundDone(step, members, list(complete), False, ([], joined), {}), tokens, Scores()


REPORTS = [_report([11, 12], Round((), (), (), ((11, 12), 0, 2)), [20, 21], complete=[11, 12], joined=[11, 12]),
           _report([11, 12], Round((), (11, 12), (11, 12), None), [22, 23])]


def _takeover() -> tuple[Ledger, Takeover, list[Request]]:
    ledger = Ledger(Layout([[(0, 1), (1, 3)]]), 2, 2, [99], 0, Admission(None, False, bytes_per_token=1))
    requests = [Request(torch.tensor([3, 4]), 5, tag=["cmpl-a", 0]), Request(torch.tensor([5]), 5, tag=["cmpl-b", 0])]
    ledger.queue(requests)
    steps = types.SimpleNamespace(layout=ledger.layout)
    return ledger, Takeover(ledger, steps, GROUPS, lambda tag: None), requests  # type: ignore[arg-type]


def test_a_slot_is_rebuilt_from_the_journals_groups_and_the_last_stages_rounds() -> None:
    ledger, takeover, requests = _takeover()
    assert takeover._rebuild_slot(7, REPORTS) is None
    batch = ledger.flights[7].batch
    assert [request.number for request in requests] == [11, 12]  # the numbers the stages know them by
    assert batch.generated == [[20, 22], [21, 23]]
    assert len(batch.rounds) == 2
    assert not ledger.waiting  # taken into the slot


def test_rounds_naming_a_request_the_journal_does_not_hold_leave_the_slot_to_be_computed_again() -> None:
    ledger, takeover, _ = _takeover()
    later = _report([11, 12, 13], Round((), (13,), (11, 12), None), [24, 25, 26])
    why = takeover._rebuild_slot(7, [*REPORTS, later])
    assert why is not None
    assert "[13]" in why
    assert 7 not in ledger.flights
    assert len(ledger.waiting) == 2  # still waiting: computed again from their prompts
