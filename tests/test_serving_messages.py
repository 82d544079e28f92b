"""Pipeline messages and microbatches: exact round trips, and a peer's malformed message is a TransportError."""

from __future__ import annotations

import json
import struct
from collections import deque

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.batching import Microbatch, Request, check_prompt
from dejavu_sdk.generation.decoding import Decoding
from dejavu_sdk.generation.turns import take_microbatch
from dejavu_sdk.serving.messages import Message, pack, unpack


def test_a_message_round_trips_exactly() -> None:
    tensors = (torch.randn(2, 3, 5), torch.arange(7), torch.zeros(0, 4), torch.randn(3).to(torch.bfloat16))
    back = unpack(pack(Message("decode", {"microbatch": 3, "rows": [1, 2]}, tensors)))
    assert (back.kind, back.fields) == ("decode", {"microbatch": 3, "rows": [1, 2]})
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back.tensors, tensors, strict=True))


def _raw(header: dict, payload: bytes = b"") -> torch.Tensor:
    encoded = json.dumps(header).encode()
    data = struct.pack("<I", len(encoded)) + encoded
    data += bytes(-len(data) % 8) + payload
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize("packed", [
    _raw({"kind": "x", "fields": {}, "tensors": [["float32", [-1]]]}),
    _raw({"kind": "x", "fields": {}, "tensors": [["int64", [-1]], ["int64", [1]]]}, bytes(8)),
    _raw({"kind": "x", "fields": {}, "tensors": [["float32", [4]]]}, bytes(8)),  # shorter than its header says
    _raw({"kind": "x", "fields": {}, "tensors": [["complex-ish", [1]]]}, bytes(8)),
    _raw({"kind": "x"}),
    torch.frombuffer(bytearray(struct.pack("<I", 1 << 30) + b"{}"), dtype=torch.uint8),
    torch.zeros(3, dtype=torch.uint8),
    torch.zeros(4, 4, dtype=torch.uint8),
], ids=["negative dimension", "overlapping tensors", "truncated", "unknown dtype", "no tensor list",
        "header longer than the message", "too short", "not 1-D"])
def test_a_malformed_message_is_a_transport_error(packed) -> None:
    with pytest.raises(dv.TransportError, match="not a pipeline message"):
        unpack(packed)


def test_rows_end_at_any_end_of_sequence_token_or_their_own_limit() -> None:
    requests = [Request(torch.tensor([5, 6]), 4), Request(torch.tensor([7]), 2), Request(torch.tensor([8]), 4)]
    batch = Microbatch.of(0, requests, pad=0)
    assert batch.ids.tolist() == [[5, 6], [0, 7], [0, 8]]
    for step in ([9, 9, 3], [2, 9, 9], [0, 9, 9], [0, 9, 0]):  # one token per row, step by step
        batch.add_step(step)
    results = batch.results(eos=[2, 3])
    assert [result.tokens.tolist() for result in results] == [[9, 2], [9, 9], [3]]
    arrived = batch.arrived
    assert [(result.first_token, result.finished) for result in results] == [(arrived[0], arrived[1]),
                                                                            (arrived[0], arrived[1]),
                                                                            (arrived[0], arrived[0])]
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
