"""Pipeline messages and microbatches: every message class round-trips exactly, a peer's malformed message (its
bytes, its kind, or a field missing, unknown or of another type) is a TransportError, and every class the head or a
stage worker receives has its handler there."""

from __future__ import annotations

import json
import struct
from collections import deque

import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.batching import Request, check_prompt
from dejavu_sdk.generation.decoding import Decoding, RowFailure
from dejavu_sdk.generation.logprobs import Scores
from dejavu_sdk.generation.row_specs import Group, RowSpecs
from dejavu_sdk.generation.slot_batch import SlotBatch
from dejavu_sdk.generation.slot_policy import STATIC
from dejavu_sdk.generation.slots import Round
from dejavu_sdk.generation.stage import Stage
from dejavu_sdk.generation.turns import take_microbatch
from dejavu_sdk.serving import Pipeline
from dejavu_sdk.serving.kv.slot_replicas import Piece
from dejavu_sdk.serving.wire.messages import (
    KINDS,
    TO_HEAD,
    TO_STAGE,
    TO_WORKER,
    AskRejoin,
    AskStats,
    Assign,
    Cancel,
    Drop,
    End,
    Enter,
    Failed,
    Fenced,
    Freed,
    GroupAt,
    GroupStart,
    Heartbeat,
    Join,
    Kv,
    LinkLost,
    Links,
    Message,
    MicrobatchFailed,
    NotEntered,
    OpenSlot,
    Pause,
    Paused,
    Prefill,
    Prefilled,
    Ready,
    Rejoin,
    Relink,
    Relinked,
    Restore,
    RewindSlot,
    Rewound,
    RoundDone,
    RoundReport,
    SendReplica,
    Sent,
    Shutdown,
    SlotRound,
    Staged,
    Standby,
    Stats,
    Warm,
    pack,
    unpack,
)
from dejavu_sdk.serving.worker.stage import Role, StageWorker

SPECS = RowSpecs([4, 8], [{"do_sample": False}, {"do_sample": True, "seed": 7, "prompt": [5, 6]}])
GROUP = Group([11, 12], SPECS)
LINKS = Links((0, 3), "tcp://127.0.0.1:1", None, ["tcp://127.0.0.1:2"], [0, 3], None, "memory://", "p1-", 1.5)
DONE = RoundDone(Round(left=(1,), joined=(4, 5), decoded=(2, 4, 5), prefill=((6, 7), 2, 5), chunk=3,
                       resumed=((6, (9, 10)),)), [2, 4, 5], [6, 7], False, ([4], None), {5: RowFailure("nan", False)})
SCORES = Scores({"2": [-0.5, [7], [-0.5]]}, {"6": [1, [[-1.0, [3], [-1.0]]]]})


def _tensors(count: int) -> list[torch.Tensor]:
    """`count` tensors of several dtypes and shapes, an empty one among them."""
    kinds = [torch.randn(2, 3, 5), torch.arange(7), torch.zeros(0, 4), torch.randn(3).to(torch.bfloat16),
             torch.tensor([1, 0], dtype=torch.uint8), torch.tensor([[True, False]])]
    return [kinds[index % len(kinds)] for index in range(count)]


def _samples() -> list[Message]:
    """A message of every class, each attribute set (not only to its default)."""
    one, two, three, four, five, six = _tensors(6)
    return [
        Join(url="tcp://a:1", pid=7, worker="w-1"), Join(url="tcp://a:1", pid=7, worker=None),
        Rejoin(url="tcp://a:1", pid=7, worker=None, stage="stage 0", layers=[0, 3], model="smollm2", epoch=4),
        AskRejoin(stage="stage 1"), Standby(model="smollm2", threads=2), Warm(url="tcp://a:2"),
        Assign(model="smollm2", stage="stage 0", role="mixed", number=0, stages=2, links=LINKS, epoch=3, threads=2,
               most_threads=2, eos=[2, 3], pad=0, swapping=True, heartbeat=0.5, missed_beats=3, orphan_timeout=60.0,
               recovery=True, take_over=False, batching="continuous", max_prefill_tokens=None),
        Ready(stage="stage 0", epoch=3), Heartbeat(stage="stage 0", epoch=3, url="tcp://a:1", work=12),
        Heartbeat(stage="standby"), Failed(stage="stage 1", epoch=2, error="RuntimeError: boom"),
        Fenced(stage="stage 1", epoch=5, was=2), Shutdown(), AskStats(),
        Stats(stage="stage 0", figures={"stage": "stage 0", "row_steps": 4, "swap_wait_seconds": 0.5}),
        Prefill(microbatch=3, epoch=1, specs=SPECS, ended=[1], columns=(0, 256), inputs=one, mask=two),
        OpenSlot(microbatch=4, epoch=1, group=GROUP, ids=one, mask=two),
        Enter(microbatch=4, epoch=1, group=GROUP, staged=Staged(9, [5, 6], [12], 64, SCORES), mask=one, rng=two),
        SlotRound(microbatch=4, epoch=2, left=[1], joined=[11, 12], applied=True, prefill=((11, 12), 0, 4),
                  starting=GroupStart(SPECS, Staged(9, [5, 6], [], 0)), inputs=one, prefill_inputs=two,
                  group_mask=three, rng=four),
        SlotRound(microbatch=4, left=[], joined=None, inputs=one),
        Kv(microbatch=3, epoch=1, layers=(2, 4), last=False, piece=one),
        Cancel(microbatch=3, epoch=1, rows=[0, 1]), NotEntered(microbatch=4, epoch=1, members=[12]),
        End(microbatch=3, epoch=1),
        RoundReport(microbatch=4, epoch=2, done=DONE, scores=SCORES, tokens=one, states=two),
        Prefilled(microbatch=3, epoch=1, failed={0: RowFailure("nan")}, chunk=256, scores=SCORES, tokens=one,
                  mask=two, ended=three, rng=four),
        Freed(microbatch=3, epoch=1),
        MicrobatchFailed(microbatch=3, epoch=1, stage="stage 1", error="IndexError"),
        LinkLost(stage="stage 0", epoch=1, error="refused"),
        Pause(epoch=2, takeover=True),
        Paused(stage="stage 0", epoch=2, slots={4: 17},
               reports={4: [(DONE, [7, 8, 9], SCORES)]}),
        Relink(epoch=2, links=LINKS), Relinked(stage="stage 0", epoch=2),
        SendReplica(microbatch=3, epoch=2, owner=1, layers=3, positions=9, to="tcp://a:3", part="group2",
                    item="3/group2"),
        Sent(microbatch=3, epoch=2, stage="stage 0", item="3/group2", error="short", unreachable=True),
        Restore(microbatch=3, epoch=2, part="segment3", block=one),
        Drop(epoch=2, microbatches=[3], failed=True, all_but=[4]),
        RewindSlot(microbatch=4, epoch=2, round=17, parked=False, left=[1], joined=None, members=[2, 4],
                   pieces=[Piece("segment3", 2, 4), Piece("group2", 2, 6)], decodings=SPECS.decoding,
                   counts={2: 5, 4: 1}, limits={2: 8, 4: 8}, cancelled=[4], finals={2: 14, 4: 14},
                   joining=GroupAt(GROUP, 2, 15), mask=one, positions=two, index=three, group_mask=four,
                   group_ids=five, states=six),
        Rewound(microbatch=3, epoch=2, stage="stage 0", error=None),
    ]


def test_every_message_round_trips_exactly() -> None:
    samples = _samples()
    assert {type(message) for message in samples} == set(KINDS.values())
    for message in samples:
        back = unpack(pack(message))
        assert type(back) is type(message)
        assert back == message  # tensors by dtype, shape and values


def test_a_messages_tensors_compare_by_value() -> None:
    message = Restore(microbatch=1, part="segment0", block=torch.tensor([[1, 2]]))
    assert message == Restore(microbatch=1, part="segment0", block=torch.tensor([[1, 2]]))
    assert message != Restore(microbatch=1, part="segment0", block=torch.tensor([[1, 3]]))
    assert message != Restore(microbatch=1, part="segment0", block=torch.tensor([[1.0, 2.0]]))


def _raw(header: dict, payload: bytes = b"") -> torch.Tensor:
    encoded = json.dumps(header).encode()
    data = struct.pack("<I", len(encoded)) + encoded
    data += bytes(-len(data) % 8) + payload
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


MICROBATCH = {"epoch": 0, "microbatch": 3}
RESTORE = {**MICROBATCH, "part": "segment0"}
DONE_FIELDS = {"round": {"left": [], "joined": [], "decoded": [], "prefill": None, "chunk": 0, "resumed": [],
                         "lost": False}, "members": [], "complete": [], "idle": True, "next": [[], None], "failed": {}}


def _header(kind: str, fields: dict, tensors: list) -> dict:
    return {"kind": kind, "fields": fields, "tensors": tensors}


def _restore(fields: dict) -> torch.Tensor:
    return _raw(_header("restore", fields, [["int64", [1]]]), bytes(8))


def _pause(**changed: object) -> torch.Tensor:
    return _raw(_header("pause", {"epoch": 1, "takeover": False, **changed}, []))


def _drop(**changed: object) -> torch.Tensor:
    return _raw(_header("drop", {"epoch": 1, "microbatches": [3], "failed": False, "all_but": None, **changed}, []))


def _paused(**changed: object) -> torch.Tensor:
    fields = {"epoch": 1, "stage": "stage 0", "slots": {"3": 9}, "reports": {}}
    return _raw(_header("paused", {**fields, **changed}, []))


def _report(round_fields: dict) -> torch.Tensor:
    done = {"round": round_fields, "members": [], "complete": [], "idle": True, "next": [[], None], "failed": {}}
    fields = {**MICROBATCH, "done": done, "scores": {"logprobs": {}, "prompt_logprobs": {}}}
    return _raw(_header("round_report", fields, [["int64", [0]], None]))


ROUND = {"left": [], "joined": [], "decoded": [], "prefill": None, "chunk": 0, "resumed": [], "lost": False}


@pytest.mark.parametrize("packed", [
    _raw(_header("restore", RESTORE, [["float32", [-1]]])),
    _raw(_header("restore", RESTORE, [["int64", [-1]], ["int64", [1]]]), bytes(8)),
    _raw(_header("restore", RESTORE, [["float32", [4]]]), bytes(8)),  # shorter than its header says
    _raw(_header("restore", RESTORE, [["complex-ish", [1]]]), bytes(8)),
    _raw({"kind": "restore", "fields": RESTORE}),
    torch.frombuffer(bytearray(struct.pack("<I", 1 << 30) + b"{}"), dtype=torch.uint8),
    torch.zeros(3, dtype=torch.uint8),
    torch.zeros(4, 4, dtype=torch.uint8),
    _raw(_header("no-such-kind", RESTORE, [])),
    _raw(_header(["restore"], RESTORE, [])),
    _raw(["restore", RESTORE, []]),
    _restore({"epoch": 0, "part": "segment0"}),
    _restore({**RESTORE, "rows": [1]}),
    _restore({**RESTORE, "microbatch": "3"}),
    _restore({**RESTORE, "microbatch": True}),
    _restore({**RESTORE, "microbatch": 3.0}),
    _restore({**RESTORE, "epoch": None}),
    _raw(_header("restore", RESTORE, []), bytes(8)),
    _raw(_header("restore", RESTORE, [["int64", [1]], ["int64", [1]]]), bytes(16)),
    _raw(_header("restore", RESTORE, [None])),
    _pause(takeover=1),
    _drop(microbatches=[3, "4"]),
    _drop(microbatches={"3": 3}),
    _paused(slots={"three": 9}),
    _paused(slots={"03": 9}),
    _paused(slots=[[3, 9]]),
    _paused(reports={"3": [[DONE_FIELDS]]}),
    _report({key: value for key, value in ROUND.items() if key != "lost"}),
    _report({**ROUND, "prefill": [[6, 7], 2]}),
    _report({**ROUND, "decoded": [1, None]}),
], ids=["negative dimension", "overlapping tensors", "truncated", "unknown dtype", "no tensor list",
        "header longer than the message", "too short", "not 1-D", "unknown kind", "kind not a string",
        "header not an object", "missing field", "unknown field", "string for an int", "bool for an int",
        "float for an int", "null for an int", "a tensor too few", "a tensor too many", "null for a tensor",
        "int for a bool", "string in a list of ints", "object for a list", "key not a number",
        "key not as a number is written", "list for a map", "pair too short", "nested: missing field",
        "nested: triple too short", "nested: null in a tuple of ints"])
def test_a_malformed_message_is_a_transport_error(packed) -> None:
    with pytest.raises(dv.TransportError, match="not a pipeline message"):
        unpack(packed)


def test_every_message_class_has_one_handler_in_each_receiver_that_takes_it() -> None:
    """The head's receiver and a stage worker's loop each dispatch through one table, a handler per class they
    take; together with a waiting worker's (its stage, to wait as a spare, or to stop) they take every class."""
    assert set(KINDS.values()) == TO_HEAD | TO_STAGE | TO_WORKER
    assert not TO_HEAD & (TO_STAGE | TO_WORKER)
    pipe = Pipeline("tiny_models:llama", stages=1)
    assert set(pipe.head.handlers) == TO_HEAD
    for role in (Role("mixed", 0, 1, "stage 0"), Role("prompt", 0, 1, "prompt stage 0"),
                 Role("token", 0, 1, "token stage 0")):
        worker = StageWorker(Stage(tiny_models.llama(), (0, 3)), role, None, None, None, None,  # type: ignore[arg-type]
                             eos=[], pad=0)
        assert set(worker.handlers) == TO_STAGE


def test_rows_end_at_any_end_of_sequence_token_or_their_own_limit() -> None:
    requests = [Request(torch.tensor([5, 6]), 4), Request(torch.tensor([7]), 2), Request(torch.tensor([8]), 4)]
    batch = SlotBatch.open(0, pad=0, policy=STATIC)  # a static microbatch
    group, ids, mask = batch.enter(requests)
    batch.groups.append((group, ids, mask))
    assert ids.tolist() == [[5, 6], [0, 7], [0, 8]]
    batch.add_tokens(group.members, [9, 9, 3])  # each live row's token, round by round
    batch.add_tokens(group.members[:2], [2, 9])
    batch.add_tokens(group.members[:1], [0])  # past its end: not its result's
    results = [batch.result(row, eos=[2, 3]) for row in range(3)]
    assert [result.tokens.tolist() for result in results] == [[9, 2], [9, 9], [3]]
    stamps = batch.stamps
    assert [(result.first_token, result.finished) for result in results] == [(stamps[0][0], stamps[0][1]),
                                                                            (stamps[1][0], stamps[1][1]),
                                                                            (stamps[2][0], stamps[2][0])]
    assert all(result.submitted <= result.first_token for result in results)
    assert [(result.row, result.rows, result.padding) for result in results] == [(0, 3, 0), (1, 3, 1), (2, 3, 1)]


@pytest.mark.parametrize("ids", [[1, -1], [1, 96], [], [[1, 2], [3, 4]], [0.5]])
def test_a_prompt_outside_the_vocabulary_or_not_a_row_of_ids_is_refused(ids) -> None:
    with pytest.raises(dv.ConfigError):
        check_prompt(torch.tensor(ids), context=64, vocabulary=96)


def test_a_microbatch_takes_requests_of_any_decoding_in_turns_between_submissions() -> None:
    """Rows of different settings and seeds share a microbatch; a submission of many prompts does not hold back
    one that comes after it; cancelled requests leave the queue."""
    greedy, sampled = Decoding.of(), Decoding.of(do_sample=True, seed=1, temperature=0.5)
    big = [Request(torch.tensor([index + 1]), 4, sampled if index % 2 else greedy, group=-7) for index in range(6)]
    late = Request(torch.tensor([50]), 4, Decoding.of(do_sample=True, seed=2))
    gone = Request(torch.tensor([60]), 4)
    gone.future.cancel()
    waiting = deque([*big, gone, late])
    assert [int(request.ids) for request in take_microbatch(waiting, 3)] == [1, 50, 2]
    assert [int(request.ids) for request in waiting] == [3, 4, 5, 6]
    assert [int(request.ids) for request in take_microbatch(waiting, 3, fits=lambda rows: len(rows) < 3)] == [3, 4]
    assert [int(request.ids) for request in waiting] == [5, 6]
    assert Decoding.of(do_sample=True).seed is not None  # drawn, so the result can say it


@pytest.mark.parametrize(("settings", "match"), [
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "finite"), ({"top_p": float("inf")}, "finite"), ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"),
    ({"typical_p": 0.5}, "unknown"),
])
def test_decoding_settings_are_checked_as_vllm_checks_them(settings, match) -> None:
    with pytest.raises(dv.ConfigError, match=match):
        Decoding.of(do_sample=True, **settings)


def test_decoding_settings_vllm_accepts_are_taken() -> None:
    assert Decoding.of(do_sample=True, temperature=1e-39) == Decoding()  # below 1e-5: greedy, never overflowing
    assert Decoding.of(do_sample=True, temperature=0.0, seed=4) == Decoding()
    assert dict(Decoding.of(do_sample=True, top_k=-1, seed=1).settings) == {"top_k": 0}  # -1 is off, as 0 is
    assert Decoding.of(do_sample=True, top_p=1, min_p=0, top_k=1, seed=-(2**63)).seed == -(2**63)
    assert Decoding.of(do_sample=True, seed=2**64 - 1).seed == 2**64 - 1
