"""A stage worker trusts no message by its shape alone: stale epochs and unknown microbatches are dropped, and a
microbatch whose computation fails is that microbatch's failure, not the worker's."""

from __future__ import annotations

import time
import types

import attrs
import pytest
import tiny_models
import torch

from dejavu_sdk import open_store, open_transport, serve
from dejavu_sdk.blocks import BlockKey
from dejavu_sdk.errors import TransportError
from dejavu_sdk.generation.batching import left_pad
from dejavu_sdk.generation.row_specs import Group, RowSpecs
from dejavu_sdk.generation.stage import Stage
from dejavu_sdk.serving.wire.link_tls import inbox_options
from dejavu_sdk.serving.wire.messages import (
    Cancel,
    Drop,
    End,
    Failed,
    Freed,
    Kv,
    Message,
    MicrobatchFailed,
    OpenSlot,
    Pause,
    Paused,
    RoundReport,
    Shutdown,
    SlotRound,
    pack,
    unpack,
)
from dejavu_sdk.serving.worker import stage as stage_module
from dejavu_sdk.serving.worker.stage import Role, StageWorker

GREEDY = {"do_sample": False}
SAMPLED = {"do_sample": True, "seed": 7, "temperature": 1.0}


class _Link:
    """A link that keeps what is sent on it."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send_tensor(self, tensor: torch.Tensor) -> None:
        self.sent.append(unpack(pack(unpack(tensor))))

    post_tensor = send_tensor

    def close(self) -> None:
        pass


def _worker(epoch: int = 2, batching: str = "static") -> tuple[StageWorker, _Link, _Link]:
    head, first = _Link(), _Link()
    worker = StageWorker(Stage(tiny_models.llama(), (0, 3)), Role("mixed", 0, 1, "stage 0"), None, head, None,  # type: ignore[arg-type]
                         first, eos=[], pad=0, recovery=True, epoch=epoch, batching=batching)  # type: ignore[arg-type]
    return worker, head, first


def _open(number: int, prompts: list[list[int]], decodings: list[dict] | None = None, epoch: int = 2) -> OpenSlot:
    """A slot opened with a group of `prompts` (members 10, 11, ...), 40 new tokens each."""
    ids, mask = left_pad([torch.tensor(prompt) for prompt in prompts], 0)
    decodings = decodings or [GREEDY] * len(prompts)
    specs = RowSpecs([40] * len(prompts), decodings)
    return OpenSlot(microbatch=number, epoch=epoch, group=Group(list(range(10, 10 + len(prompts))), specs), ids=ids,
                    mask=mask)


def _run_rounds(worker: StageWorker, first: _Link, rounds: int) -> None:
    """Feed the worker its own next rounds (the single stage's way back to itself), `rounds` times."""
    for _ in range(rounds):
        following = first.sent.pop()
        assert isinstance(following, SlotRound)
        worker.handle(attrs.evolve(following, epoch=worker.epoch))


def _tokens(head: _Link) -> list[list[int]]:
    return [message.tokens.tolist() for message in head.sent if isinstance(message, RoundReport)]


def test_messages_of_an_older_epoch_are_dropped_whatever_their_kind() -> None:
    worker, head, first = _worker(epoch=2)
    worker.handle(Pause(epoch=1))
    worker.handle(_open(5, [[3, 4, 5]], epoch=1))
    worker.handle(Drop(epoch=0, microbatches=[5]))
    assert worker.epoch == 2  # a stale pause rolls nothing back
    assert (head.sent, first.sent, worker.slots) == ([], [], {})


def test_a_round_of_a_slot_the_worker_does_not_hold_is_dropped() -> None:
    worker, head, first = _worker()
    worker.handle(SlotRound(microbatch=9, epoch=2, left=[], joined=None, inputs=torch.tensor([[1]])))
    worker.handle(Cancel(microbatch=9, rows=[10], epoch=2))
    worker.handle(End(microbatch=9, epoch=2))
    assert head.sent == [Freed(microbatch=9, epoch=2)]  # ending what is gone is harmless
    assert first.sent == []


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_a_row_cancelled_before_its_slot_came_gets_no_token(batching) -> None:
    worker, head, first = _worker(batching=batching)
    worker.handle(Cancel(microbatch=3, rows=[11], epoch=2))  # it overtook its slot's opening: kept for it
    worker.handle(_open(3, [[3, 4, 5], [6, 7, 8]]))
    (report,) = head.sent
    assert isinstance(report, RoundReport)
    assert report.tokens.tolist()[1] == 0  # padding: the row was cancelled
    assert report.done.next[1] == ([10, 11] if batching == "static" else [10])  # static: it stays, as padding
    _run_rounds(worker, first, 1)
    assert head.sent[-1].done.members == [10]  # only the live row gets a token
    assert worker.row_steps == 2  # the live row's first token and its next, not the cancelled row's


def test_a_failing_computation_fails_its_microbatch_and_the_worker_goes_on() -> None:
    worker, head, first = _worker()
    worker.handle(_open(1, [[3, 500, 5]]))  # an id outside the embedding: the forward raises
    (failed,) = head.sent
    assert isinstance(failed, MicrobatchFailed)
    assert failed.microbatch == 1
    assert "IndexError" in failed.error
    assert 1 not in worker.slots
    worker.handle(_open(2, [[3, 4, 5]]))
    assert [type(message) for message in head.sent[1:]] == [RoundReport]
    assert [type(message) for message in first.sent] == [SlotRound]
    assert 2 in worker.slots


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


def test_a_successor_finds_a_slot_where_the_last_stage_stands() -> None:
    """A worker's slot handed to the worker of a successor head (`Holdings`): `pause` reports its rounds and
    every round's report, and its next round gives the tokens of a worker that never stopped (sampled rows
    included)."""
    prompts = [[3, 4, 5], [6, 7]]
    reference, reference_head, reference_first = _worker()
    reference.handle(_open(4, prompts, [SAMPLED, GREEDY]))
    _run_rounds(reference, reference_first, 11)
    expected = _tokens(reference_head)

    worker, _, first = _worker()
    worker.handle(_open(4, prompts, [SAMPLED, GREEDY]))
    _run_rounds(worker, first, 5)  # 6 rounds: the head dies with the next one on its way
    successor, successor_head, successor_first = _worker(epoch=3)
    successor.slots, successor.caches = worker.slots, worker.caches
    successor.handle(Pause(epoch=4, takeover=True))
    (paused,) = successor_head.sent
    assert isinstance(paused, Paused)
    assert paused.slots == {4: 6}
    assert [tokens for _, tokens, _ in paused.reports[4]] == expected[:6]
    successor.handle(attrs.evolve(first.sent[-1], epoch=4))  # the round that was on its way
    _run_rounds(successor, successor_first, 5)
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


class _Inbox:
    """An inbox that hands out `messages` in order, then is quiet."""

    def __init__(self, *messages: Message) -> None:
        self.queued = [pack(message) for message in messages]

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor:
        if not self.queued:
            raise TransportError("no tensor arrived")
        return self.queued.pop(0)


class _GoneLink(_Link):
    """A neighbour that stopped: every post to it fails."""

    def send_tensor(self, tensor: torch.Tensor) -> None:
        raise TransportError("tcp://127.0.0.1:1 closed the connection")

    post_tensor = send_tensor


def _first_of_two(inbox: _Inbox) -> tuple[StageWorker, _Link]:
    head = _Link()
    worker = StageWorker(Stage(tiny_models.llama(), (0, 2)), Role("mixed", 0, 2, "stage 0"), inbox, head,  # type: ignore[arg-type]
                         _GoneLink(), None, eos=[], pad=0, recovery=False, epoch=2)  # type: ignore[arg-type]
    return worker, head


def test_a_neighbour_gone_because_the_head_closed_the_pipeline_ends_the_worker_cleanly() -> None:
    """The head tells the stages to stop one after another: a neighbour that took its word first must not turn
    this worker's last post to it into a failed exit, once this worker's own `Shutdown` comes."""
    worker, head = _first_of_two(_Inbox(End(microbatch=4, epoch=2), Shutdown()))
    worker.run()  # returns: the lost post was the pipeline's end
    assert [type(message) for message in head.sent] == [Failed]  # the head heard of it all the same


def test_a_neighbour_gone_with_no_shutdown_coming_is_the_worker_s_failure(monkeypatch) -> None:
    monkeypatch.setattr(stage_module, "STOP_GRACE", 0.2)
    worker, head = _first_of_two(_Inbox(End(microbatch=4, epoch=2)))
    with pytest.raises(TransportError, match="closed the connection"):
        worker.run()
    (failed,) = head.sent
    assert isinstance(failed, Failed)
    assert "closed the connection" in failed.error


def test_a_pipeline_inbox_never_closes_a_link_for_being_idle() -> None:
    """A stage's steps to the next are posts, never answered: a server that closes such a link once it has been
    idle `idle_timeout` leaves the next post unable to know whether the earlier ones arrived (an error, which would
    fail or recover a pipeline that was merely quiet for ten minutes). A pipeline's inboxes keep their links."""
    with serve("tcp://127.0.0.1:0", idle_timeout=0.3) as plain, open_transport(plain.url) as link:
        link.post_tensor(torch.ones(2))
        plain.recv_tensor(timeout=10)
        time.sleep(1.0)
        with pytest.raises(TransportError, match="may not have arrived"):
            link.post_tensor(torch.ones(2))
    with serve("tcp://127.0.0.1:0", **inbox_options(None)) as inbox:
        assert inbox.options.idle_timeout is None
