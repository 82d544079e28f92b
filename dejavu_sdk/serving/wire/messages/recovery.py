"""A recovery's steps: the head asks every stage in turn, and waits for each answer before the next step.

`Pause` -> `Paused` (a new epoch; what each survivor holds), `Relink` -> `Relinked` (new neighbours),
`SendReplica` -> `Sent` (a replica holder sends a piece of a dead stage's replica to its replacement as `Restore`),
`Drop` (microbatches that start over, failed, or were not taken over), `RewindSlot` -> `Rewound` (go on with a slot
from a given round). A successor head taking over its predecessor's workers sends the same.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ....generation.logprobs import Scores
from ....generation.row_specs import Group
from ...kv.slot_replicas import Piece
from .base import BY_VALUE, EpochMessage, MicrobatchMessage
from .life import Links
from .steps import RoundDone


@attrs.frozen(kw_only=True)
class Pause(EpochMessage):
    """The head -> each surviving stage: a new `epoch` begins (older messages are dropped from now on): report what
    is held (`Paused`); for a successor's `takeover`, the last stage's round reports too."""

    kind = "pause"
    takeover: bool = False


@attrs.frozen(kw_only=True)
class Paused(EpochMessage):
    """A stage -> the head, paused: the rounds of each slot it ran (`slots`), and for a takeover, on the last stage,
    each slot's round reports with their tokens and log-probabilities (`reports`). The head plans where each slot
    goes on from."""

    kind = "paused"
    stage: str
    slots: dict[int, int]
    reports: dict[int, list[tuple[RoundDone, list[int], Scores]]]


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
    """The head -> a replica holder: send piece `part` of stage `owner`'s replica of slot `microbatch` (`layers`
    layers, up to `positions`) to that stage's replacement at `to` (`Restore`), and answer `Sent` (with `item`,
    which names the piece asked for)."""

    kind = "send_replica"
    owner: int
    layers: int
    positions: int
    to: str
    part: str
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
    """A replica holder (or the head, from the replica store) -> a replacement: piece `part` of slot `microbatch`'s
    replica (`block`). Kept until the slot's rewind."""

    kind = "restore"
    part: str
    block: torch.Tensor = attrs.field(eq=BY_VALUE)


@attrs.frozen(kw_only=True)
class Drop(EpochMessage):
    """The head -> stages: forget `microbatches` (they start over from their prompts, `failed`, or ended
    meanwhile) and the replicas held of them; a successor's drops everything `all_but` those it took over."""

    kind = "drop"
    microbatches: list[int]
    failed: bool = False
    all_but: list[int] | None = None


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
