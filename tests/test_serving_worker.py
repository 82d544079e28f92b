"""A stage worker trusts no message by its shape alone: stale epochs and unknown microbatches are dropped, and a
microbatch whose computation fails is that microbatch's failure, not the worker's."""

from __future__ import annotations

import types

import attrs
import pytest
import tiny_models
import torch

from dejavu_sdk import open_store
from dejavu_sdk.blocks import BlockKey
from dejavu_sdk.generation.row_specs import RowSpecs
from dejavu_sdk.generation.stage import Stage
from dejavu_sdk.serving.wire.messages import (
    Cancel,
    Decode,
    Drop,
    End,
    Freed,
    Kv,
    Message,
    MicrobatchFailed,
    Pause,
    Paused,
    Prefill,
    Rewind,
    Rewound,
    Tokens,
    pack,
    unpack,
)
from dejavu_sdk.serving.worker.stage import Role, StageWorker

GREEDY = {"do_sample": False}


class _Link:
    """A link that keeps what is sent on it."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send_tensor(self, tensor: torch.Tensor) -> None:
        self.sent.append(unpack(pack(unpack(tensor))))

    post_tensor = send_tensor

    def close(self) -> None:
        pass


def _worker(epoch: int = 2) -> tuple[StageWorker, _Link, _Link]:
    head, first = _Link(), _Link()
    worker = StageWorker(Stage(tiny_models.llama(), (0, 3)), Role("mixed", 0, 1, "stage 0"), None, head, None,  # type: ignore[arg-type]
                         first, eos=[], pad=0, recovery=True, epoch=epoch)  # type: ignore[arg-type]
    return worker, head, first


def _prefill(number: int, ids: list[int], epoch: int = 2) -> Prefill:
    return Prefill(microbatch=number, specs=RowSpecs([4], [{"do_sample": False}]), epoch=epoch,
                   inputs=torch.tensor([ids]), mask=torch.ones(1, len(ids), dtype=torch.long))


def test_messages_of_an_older_epoch_are_dropped_whatever_their_kind() -> None:
    worker, head, first = _worker(epoch=2)
    worker.handle(Pause(epoch=1, microbatches=[]))
    worker.handle(_prefill(5, [3, 4, 5], epoch=1))
    worker.handle(Drop(epoch=0, microbatches=[5]))
    assert worker.epoch == 2  # a stale pause rolls nothing back
    assert (head.sent, first.sent, worker.microbatches) == ([], [], {})


def test_a_step_of_a_microbatch_the_worker_does_not_hold_is_dropped() -> None:
    worker, head, first = _worker()
    worker.handle(Decode(microbatch=9, epoch=2, inputs=torch.tensor([[1]])))
    worker.handle(Cancel(microbatch=9, rows=[0], epoch=2))
    worker.handle(End(microbatch=9, epoch=2))
    assert head.sent == [Freed(microbatch=9, epoch=2)]  # ending what is gone is harmless
    assert first.sent == []


@pytest.mark.parametrize("how", ["in its prefill", "before it came"])
def test_a_prefill_does_not_compute_rows_cancelled_before_it(how) -> None:
    worker, head, _ = _worker()
    message = _prefill(3, [3, 4, 5])
    if how == "before it came":  # a cancel that overtook its microbatch is kept for it
        worker.handle(Cancel(microbatch=3, rows=[1], epoch=2))
    worker.handle(attrs.evolve(message, specs=RowSpecs([4, 4], [GREEDY] * 2),
                               ended=[1] if how == "in its prefill" else [], inputs=message.inputs.repeat(2, 1),
                               mask=message.mask.repeat(2, 1)))
    (tokens,) = head.sent
    assert isinstance(tokens, Tokens)
    assert tokens.tokens[1] == 0  # padding: the row was cancelled
    assert worker.row_steps == 1


def test_a_failing_computation_fails_its_microbatch_and_the_worker_goes_on() -> None:
    worker, head, first = _worker()
    worker.handle(_prefill(1, [3, 500, 5]))  # an id outside the embedding: the forward raises
    (failed,) = head.sent
    assert isinstance(failed, MicrobatchFailed)
    assert failed.microbatch == 1
    assert "IndexError" in failed.error
    assert 1 not in worker.microbatches
    worker.handle(_prefill(2, [3, 4, 5]))
    assert [type(message) for message in head.sent[1:]] == [Tokens]
    assert [type(message) for message in first.sent] == [Decode]
    assert 2 in worker.microbatches


def test_prompt_kv_of_a_failed_microbatch_arriving_after_its_drop_is_not_kept() -> None:
    head = _Link()
    worker = StageWorker(Stage(tiny_models.llama(), (0, 3)), Role("token", 0, 1, "token stage 0"), None, head,  # type: ignore[arg-type]
                         None, _Link(), eos=[], pad=0, recovery=True, epoch=2)  # type: ignore[arg-type]
    piece = torch.zeros(1, 2, 1, 2, 3, 16)
    worker.handle(Drop(microbatches=[7], failed=True, epoch=2))
    worker.handle(Kv(microbatch=7, layers=(0, 1), epoch=2, piece=piece))
    assert worker.staged == {}
    worker.handle(Kv(microbatch=8, layers=(0, 1), epoch=2, piece=piece))
    assert list(worker.staged) == [8]  # another microbatch's pieces are kept as before


SAMPLED = {"do_sample": True, "seed": 7, "temperature": 1.0}


def _run_steps(worker: StageWorker, head: _Link, first: _Link, steps: int) -> None:
    """Feed the worker its own next steps (the single stage's way back to itself), `steps` times."""
    for _ in range(steps):
        decode = first.sent.pop()
        assert isinstance(decode, Decode)
        worker.handle(attrs.evolve(decode, epoch=worker.epoch))


def _sampled_prefill(number: int) -> Prefill:
    return attrs.evolve(_prefill(number, [3, 4, 5]), specs=RowSpecs([40, 40], [SAMPLED, GREEDY]),
                        inputs=torch.tensor([[3, 4, 5], [0, 6, 7]]), mask=torch.tensor([[1, 1, 1], [0, 1, 1]]))


def _tokens(head: _Link) -> list[list[int]]:
    return [message.tokens.tolist() for message in head.sent if isinstance(message, Tokens)]


def test_a_successor_takes_a_microbatch_over_where_the_last_stage_stands() -> None:
    """A worker's microbatch handed to the worker of a successor head (`Holdings`): `pause` reports its step and
    every step's tokens, `rewind` with `keep` goes on with its own picker, and the tokens after it are those of
    a worker that never stopped (sampled rows included); a `keep` at another step is refused, and changes
    nothing."""
    reference, reference_head, reference_first = _worker()
    reference.handle(_sampled_prefill(4))
    _run_steps(reference, reference_head, reference_first, 11)
    expected = _tokens(reference_head)

    worker, head, first = _worker()
    worker.handle(_sampled_prefill(4))
    _run_steps(worker, head, first, 5)  # 6 steps: the head dies with the next one on its way
    successor, successor_head, successor_first = _worker(epoch=3)
    successor.microbatches, successor.caches = worker.microbatches, worker.caches
    successor.handle(Pause(epoch=4, microbatches=[4], takeover=True))
    (paused,) = successor_head.sent
    assert isinstance(paused, Paused)
    assert paused.caches == {4: 3 + 6 - 1}
    assert paused.steps == {4: (6, expected[:6])}
    rewind = Rewind(microbatch=4, specs=RowSpecs([40, 40], [SAMPLED, GREEDY]), epoch=4, positions=3 + 6 - 1,
                    steps=5, replicated=0, keep=True, mask=torch.tensor([[1, 1, 1], [0, 1, 1]]),
                    ended=torch.zeros(2, dtype=torch.uint8), rng=torch.empty(0, dtype=torch.uint8))
    successor.handle(rewind)
    refused = successor_head.sent[-1]
    assert isinstance(refused, Rewound)
    assert refused.error is not None
    assert "step 6" in refused.error
    successor.handle(attrs.evolve(rewind, steps=6))
    assert successor_head.sent[-1] == Rewound(stage="stage 0", microbatch=4, epoch=4, error=None)
    successor.handle(Decode(microbatch=4, epoch=4, inputs=torch.tensor([expected[5]]).T))
    _run_steps(successor, successor_head, successor_first, 5)
    assert _tokens(successor_head) == expected[6:]


def test_a_drop_removes_the_replicas_held_here_of_those_microbatches_only() -> None:
    """What a stage holds for its neighbour of a microbatch dropped (not taken over by a successor, started over,
    failed) goes with it; the replicas of other microbatches, and of other pipelines, stay."""
    worker, _, _ = _worker()
    worker.prefix = "p1-"
    store = open_store("memory://")
    worker.inbox = types.SimpleNamespace(store=store)  # type: ignore[assignment]
    block = torch.zeros(1, 2, 1, 2, 3, 16)
    streams = ["p1-stage0-microbatch7", "p1-stage0-microbatch7-group3", "p1-stage0-microbatch8",
               "p2-stage0-microbatch7", "p1-stage1-microbatch17"]
    for stream in streams:
        store.flush(BlockKey(stream, (0, 1), (0, 3)), block)
    worker.handle(Drop(microbatches=[7], epoch=2))
    assert sorted({key.stream_id for key in store.keys(None)}) == sorted(streams[2:])
