"""A worker's life: joining the head, taking a stage (or waiting as a spare), heartbeats, failures, stopping.

Sent by a worker to the head: `Join`, `Rejoin`, `Warm`, `Ready`, `Heartbeat`, `Failed`, `Stats`. Sent by the head
to a worker: `Standby`, `Assign`, `AskRejoin`, `AskStats`, `Fenced`, `Shutdown`.
"""

from __future__ import annotations

from typing import Any

import attrs

from .base import EpochMessage, Message


@attrs.frozen(kw_only=True)
class Join(Message):
    """A new worker -> the head: its inbox `url`, process id and launcher-given id (`worker`; None for one
    started by hand). The head assigns it a stage, or (none needing it) sends it `Standby`."""

    kind = "join"
    url: str
    pid: int
    worker: str | None


@attrs.frozen(kw_only=True)
class Rejoin(Message):
    """A worker whose head died -> the head now at its address: take my `stage` back (its `layers` of `model`,
    loaded, as served in `epoch`). The head assigns it that stage again (a later epoch), or tells it to stop."""

    kind = "rejoin"
    url: str
    pid: int
    worker: str | None
    stage: str
    layers: list[int]
    model: str
    epoch: int


@attrs.frozen(kw_only=True)
class AskRejoin(Message):
    """A starting head -> a former head's worker whose heartbeat reached it: send `Rejoin` (the worker's loop
    stops serving, and rejoins)."""

    kind = "ask_rejoin"
    stage: str


@attrs.frozen(kw_only=True)
class Standby(Message):
    """The head -> a worker that no stage needs now: load `model` (with `threads` torch threads unless the worker
    chose its own), answer `Warm`, and wait for an `Assign`."""

    kind = "standby"
    model: str
    threads: int


@attrs.frozen(kw_only=True)
class Warm(Message):
    """A spare -> the head: the model is loaded at inbox `url`; the head keeps it to replace a stage."""

    kind = "warm"
    url: str


@attrs.frozen
class Links:
    """Where a stage's output goes: its `layers`, its pipeline's `first` stage (the last stage's way back), the
    `next` stage (None: the last), a prompt stage's `token_stages` and the layer boundaries between them
    (`token_boundaries`), and a decoding stage's replica `holder` or `replica_store` (streams named with
    `replica_prefix`); each message on a link must arrive within `link_timeout` seconds (None: the transport's)."""

    layers: tuple[int, int]
    first: str
    next: str | None
    token_stages: list[str] = attrs.field(factory=list)
    token_boundaries: list[int] = attrs.field(factory=list)
    holder: str | None = None
    replica_store: str | None = None
    replica_prefix: str = ""
    link_timeout: float | None = None


@attrs.frozen(kw_only=True)
class Assign(Message):
    """The head -> a worker (new, spare, or rejoining): be `stage`, the `number`th of `stages` in its pipeline of
    `role` ("mixed", "prompt" or "token"), of `model`, linked by `links`, from `epoch`; with the pipeline's
    settings (`threads` torch threads to start with, up to `most_threads` where the machine's other processes
    leave cores idle; the tiers of its prompt prefixes, `prefix_cache`, in chunks of `prefix_chunk` positions).
    The worker loads it, opens its links and answers `Ready` (or `Failed`)."""

    kind = "assign"
    model: str
    stage: str
    role: str
    number: int
    stages: int
    links: Links
    epoch: int
    threads: int
    most_threads: int
    eos: list[int]
    pad: int
    swapping: bool
    heartbeat: float
    missed_beats: int
    orphan_timeout: float
    recovery: bool
    take_over: bool
    batching: str
    max_prefill_tokens: int | None
    prefix_cache: tuple[str, ...] = ()
    prefix_chunk: int = 256


@attrs.frozen(kw_only=True)
class Ready(EpochMessage):
    """A worker -> the head: `stage` is loaded and linked; the head starts (or a recovery goes on)."""

    kind = "ready"
    stage: str


@attrs.frozen(kw_only=True)
class Heartbeat(EpochMessage):
    """A worker -> the head, every `heartbeat` seconds: `stage` (or "standby") lives, served at inbox `url` in its
    epoch, and has run `work` layers so far. The head counts a stage silent for a few beats dead, and tells a
    replaced worker that still beats to exit (`Fenced`)."""

    kind = "heartbeat"
    stage: str
    url: str | None = None
    work: int | None = None


@attrs.frozen(kw_only=True)
class Failed(EpochMessage):
    """A worker -> the head: `stage` could not go on (`error`), and its process stops. The head recovers, or fails
    the requests in flight."""

    kind = "failed"
    stage: str
    error: str


@attrs.frozen(kw_only=True)
class Fenced(Message):
    """The head -> a replaced worker that still speaks: another worker has served `stage` since (the head is in
    `epoch`, the worker was in `was`): exit."""

    kind = "fenced"
    stage: str
    epoch: int
    was: int


@attrs.frozen(kw_only=True)
class Shutdown(Message):
    """The head -> a worker: stop."""

    kind = "shutdown"


@attrs.frozen(kw_only=True)
class AskStats(Message):
    """The head -> a stage worker: report your caches (`Stats`)."""

    kind = "ask_stats"


@attrs.frozen(kw_only=True)
class Stats(Message):
    """A stage worker -> the head, asked: what `Pipeline.stage_stats` gives for `stage` (`figures`, free-form:
    its caches' bytes and swaps, its staged KV, the rows it gave tokens)."""

    kind = "stats"
    stage: str
    figures: dict[str, Any]
