"""A recovery's steps: the head asks every stage in turn, and waits for each answer before the next step.

`Pause` -> `Paused` (a new epoch; what each survivor holds), `Relink` -> `Relinked` (new neighbours),
`SendReplica` -> `Sent` (a replica holder sends a dead stage's replica to its replacement as `Restore`), `Drop`
(microbatches that start over, failed, or were not taken over), `Rewind` or `RewindSlot` -> `Rewound` (go on with a
static microbatch or a slot from a given point). A successor head taking over its predecessor's workers sends the
same.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ....generation.row_specs import Group, RowSpecs
from ...kv.slot_replicas import Piece
from .base import BY_VALUE, EpochMessage, MicrobatchMessage
from .life import Links
from .steps import RoundDone


@attrs.frozen(kw_only=True)
class Pause(EpochMessage):
    """The head -> each surviving stage: a new `epoch` begins (older messages are dropped from now on): finish
    replicating, and report what is held (`Paused`), with how far the replicas held of `microbatches` for stage
    `replica_of` (None: none; of `replica_layers` layers) reach; for a successor's `takeover`, the last stage's
    steps and round reports too."""

    kind = "pause"
    microbatches: list[int]
    replica_of: int | None = None
    replica_layers: int = 0
    takeover: bool = False


@attrs.frozen(kw_only=True)
class Paused(EpochMessage):
    """A stage -> the head, paused: the cache positions of each static microbatch it holds (`caches`), how far the
    replicas it holds reach (`holds`), the rounds of each slot it ran (`slots`), and for a takeover, on the last
    stage, each static microbatch's step and every step's tokens (`steps`) and each slot's round reports with
    their tokens (`reports`). The head plans where each microbatch goes on from."""

    kind = "paused"
    stage: str
    caches: dict[int, int]
    holds: dict[int, int]
    slots: dict[int, int]
    steps: dict[int, tuple[int, list[list[int]]]]
    reports: dict[int, list[tuple[RoundDone, list[int]]]]


@attrs.frozen(kw_only=True)
class Relink(EpochMessage):
    """The head -> each surviving stage: reconnect to the neighbours at `links` (some of them replacements);
    answered `Relinked`."""

    kind = "relink"
    links: Links


@attrs.frozen(kw_only=True)
class Relinked(EpochMessage):
    """A stage -> the head: `stage` reconnected."""

    kind = "relinked"
    stage: str


@attrs.frozen(kw_only=True)
class SendReplica(MicrobatchMessage):
    """The head -> a replica holder: send stage `owner`'s replica of microbatch `microbatch` (`layers` layers, up
    to `positions`; a slot's: its `part`) to that stage's replacement at `to` (`Restore`), and answer `Sent` (with
    `item`, which names the piece asked for)."""

    kind = "send_replica"
    owner: int
    layers: int
    positions: int
    to: str
    part: str | None = None
    item: str | None = None


@attrs.frozen(kw_only=True)
class Sent(MicrobatchMessage):
    """A replica holder -> the head: `stage` sent the replica asked for (`item`), or why not (`error`; `unreachable`:
    the replacement is gone too). A replica that cannot be read back sends its microbatch back to its prompt."""

    kind = "sent"
    stage: str
    item: str | None = None
    error: str | None = None
    unreachable: bool = False


@attrs.frozen(kw_only=True)
class Restore(MicrobatchMessage):
    """A replica holder (or the head, from the replica store) -> a replacement: the cache of microbatch
    `microbatch` as its replica held it (`block`; a slot's replica `part`). Kept until the microbatch's rewind."""

    kind = "restore"
    part: str | None = None
    block: torch.Tensor = attrs.field(eq=BY_VALUE)


@attrs.frozen(kw_only=True)
class Drop(EpochMessage):
    """The head -> stages: forget `microbatches` (they start over from their prompts, `failed`, or ended
    meanwhile) and the replicas held of them; a successor's drops everything `all_but` those it took over."""

    kind = "drop"
    microbatches: list[int]
    failed: bool = False
    all_but: list[int] | None = None


@attrs.frozen(kw_only=True)
class Rewind(MicrobatchMessage):
    """The head -> each decoding stage: go on with static microbatch `microbatch` from cache position `positions`,
    fed next with the token of step `steps`: crop the cache to it (a replacement builds it from its restored
    replica) and replicate from `replicated`. The last stage rebuilds its picker from `specs`, the generators'
    states (`rng`), the rows `ended` and the tokens so far (`generated`, a list per row); with `keep` (a successor's
    takeover) it goes on with its own, at that step. `mask` is the prompts'. Answered `Rewound`."""

    kind = "rewind"
    specs: RowSpecs
    positions: int
    steps: int
    replicated: int
    generated: list[list[int]] = attrs.field(factory=list)
    keep: bool = False
    mask: torch.Tensor = attrs.field(eq=BY_VALUE)
    ended: torch.Tensor = attrs.field(eq=BY_VALUE)
    rng: torch.Tensor = attrs.field(eq=BY_VALUE)


@attrs.frozen
class GroupAt:
    """The group joining a slot where its rewind goes on: its members and rows' specs, the prompt columns run
    (`done`), and the round its prefill began (its replica piece is `group{started}`)."""

    group: Group
    done: int
    started: int


@attrs.frozen(kw_only=True)
class RewindSlot(MicrobatchMessage):
    """The head -> each decoding stage: go on with slot `microbatch` right after round `round`, the next round's row
    change (requests that `left`, the group that `joined`) made: its rows then (`members`, their `mask` and
    `positions`), whether it is `parked`, each member's final cache length (`finals`) and the group `joining`
    (with its `group_mask`, and `group_ids` for the first stage). A replacement rebuilds the slot from its
    replica's `pieces` (by `index`); the last stage its choices: each row's decoding (`decodings`), generators'
    `states`, token `counts`, `limits`, and the requests `cancelled`. Answered `Rewound`."""

    kind = "rewind_slot"
    round: int
    parked: bool
    left: list[int]
    joined: list[int] | None
    members: list[int]
    pieces: list[Piece]
    decodings: list[dict[str, Any]]
    counts: dict[int, int]
    limits: dict[int, int]
    cancelled: list[int]
    finals: dict[int, int]
    joining: GroupAt | None = None
    mask: torch.Tensor = attrs.field(eq=BY_VALUE)
    positions: torch.Tensor = attrs.field(eq=BY_VALUE)
    index: torch.Tensor = attrs.field(eq=BY_VALUE)
    group_mask: torch.Tensor = attrs.field(eq=BY_VALUE)
    group_ids: torch.Tensor = attrs.field(eq=BY_VALUE)
    states: torch.Tensor = attrs.field(eq=BY_VALUE)


@attrs.frozen(kw_only=True)
class Rewound(MicrobatchMessage):
    """A decoding stage -> the head: `stage` went on with microbatch (or slot) `microbatch`, or why it cannot
    (`error`: it then starts over, or the slot's rows go on elsewhere)."""

    kind = "rewound"
    stage: str
    error: str | None = None
