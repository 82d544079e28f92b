"""A microbatch's steps: what the head sends the first stage, each stage the next, and the last stage the head.

Every microbatch is a slot (static batching or continuous, a policy of the slot): `OpenSlot` and `Enter` bring a
group of requests to a slot's first stage; each round goes through the stages as a `SlotRound`, and the last stage
reports it (`RoundReport`) and starts the next; the first stage answers a group's members cancelled before they
entered with `NotEntered`. An idle slot that no group is bound for is ended by the head: `End` goes through the
stages, the last of which answers `Freed`. Disaggregated, the head sends a group's prompts to the prompt pipeline
(`Prefill`), whose stages stream each layer's `Kv` to the token stages and whose last stage reports the first
tokens (`Prefilled`); the group then enters its slot with its KV staged. A stage whose computation fails on a
microbatch reports `MicrobatchFailed`; one that lost a neighbour, `LinkLost`. `Cancel` ends rows at their next
round.
"""

from __future__ import annotations

import attrs
import torch

from ....generation.decoding import RowFailure
from ....generation.logprobs import Scores
from ....generation.row_specs import Group, RowSpecs
from ....generation.slots import Round
from .base import BY_VALUE, EpochMessage, MicrobatchMessage, empty_tensor

#: The prompt columns of a group that a round runs: its members, and the columns [start, stop).
Columns = tuple[tuple[int, ...], int, int]


@attrs.frozen(kw_only=True)
class Prefill(MicrobatchMessage):
    """A static microbatch's prompts (under continuous batching, disaggregated: a group's, bound for a slot): the
    head -> the first stage (`inputs`: ids), each stage -> the next (`inputs`: its hidden states; a prompt stage's
    of the `columns` [start, stop) it ran). `mask` is the prompts', `specs` each row's limit and decoding, `ended`
    the rows ended already (cancelled). A mixed stage runs the prompts into the cache it decodes on; a prompt stage
    runs them a chunk at a time, streaming each layer's KV; the last stage picks the first tokens."""

    kind = "prefill"
    specs: RowSpecs
    ended: list[int] = attrs.field(factory=list)
    columns: tuple[int, int] | None = None
    inputs: torch.Tensor = attrs.field(eq=BY_VALUE)
    mask: torch.Tensor = attrs.field(eq=BY_VALUE)


@attrs.frozen
class Staged:
    """A group the prompt pipeline prefilled, as microbatch `number` there (its KV is staged on the token stages
    under that number): its `first` tokens, the members that `ended` with them, the columns each of its steps
    ran (`chunk`, 0: all in one), and the log-probabilities of its first tokens and prompts, by member (`scores`:
    the last token stage keeps them with the round it joins in, for a successor head)."""

    number: int
    first: list[int]
    ended: list[int]
    chunk: int
    scores: Scores = attrs.field(factory=Scores)


@attrs.frozen(kw_only=True)
class Enter(MicrobatchMessage):
    """The head -> a slot's first stage: `group` joins slot `microbatch` at a round after the groups queued before
    it (`ids` its prompts, `mask` theirs); disaggregated, it was prefilled already (`staged`; its generators' states
    in `rng`, no ids). `salt`: its tenant's, for the prompt prefixes it reads and keeps. The stage queues it; a
    parked slot starts a round at once."""

    kind = "enter"
    group: Group
    staged: Staged | None = None
    salt: str = ""
    ids: torch.Tensor = attrs.field(eq=BY_VALUE, factory=empty_tensor)
    mask: torch.Tensor = attrs.field(eq=BY_VALUE)
    rng: torch.Tensor = attrs.field(eq=BY_VALUE, factory=empty_tensor)


@attrs.frozen(kw_only=True)
class OpenSlot(Enter):
    """The head -> the first stage: open slot `microbatch` with its first `group` (as `Enter` brings one), which
    starts its first round at once."""

    kind = "open_slot"


@attrs.frozen
class GroupStart:
    """What each stage needs of a group as its prefill starts in a round: its rows' `specs`, and whether the prompt
    pipeline prefilled it (`staged`). With prompt prefixes (a group of one prompt): the names of its prompt's whole
    chunks (`digests`, `prefix.keys`), by which each stage reads and keeps its own layers' chunks, and the
    positions the first stage read, which each stage after it reads too (`cached`)."""

    specs: RowSpecs
    staged: Staged | None = None
    digests: tuple[str, ...] = ()
    cached: int = 0


@attrs.frozen(kw_only=True)
class SlotRound(MicrobatchMessage):
    """A round of slot `microbatch`: the last stage (or, after a recovery, the head: its row change `applied`
    already) -> the first stage, with the requests whose rows `left`, the group that `joined` (None: none) and the
    next tokens (`inputs`); each stage -> the next, with its decode output (`inputs`), the prompt `prefill` columns
    the first stage chose to run and their output (`prefill_inputs`), and at a group's start (`starting`) its
    `group_mask` and generators' states (`rng`). Each stage changes its rows, decodes, prefills and passes it on;
    the last stage reports it (`RoundReport`) and starts the next. `missed`: a stage found fewer of a starting
    group's prompt-prefix chunks than the stages before it read (the positions it found): the stages after it skip
    the group's columns, and the last stage passes it on as the next round's `restart`, at which every stage drops
    what it ran of the group and the first starts it again, from at most that many positions."""

    kind = "round"
    left: list[int]
    joined: list[int] | None
    applied: bool = False
    missed: int | None = None
    restart: int | None = None
    prefill: Columns | None = None
    starting: GroupStart | None = None
    inputs: torch.Tensor = attrs.field(eq=BY_VALUE)
    prefill_inputs: torch.Tensor = attrs.field(eq=BY_VALUE, factory=empty_tensor)
    group_mask: torch.Tensor = attrs.field(eq=BY_VALUE, factory=empty_tensor)
    rng: torch.Tensor = attrs.field(eq=BY_VALUE, factory=empty_tensor)


@attrs.frozen(kw_only=True)
class Kv(MicrobatchMessage):
    """A prompt stage -> a token stage: the prompt KV of global `layers` [first, stop) of microbatch (or group)
    `microbatch` (`piece`, the positions after those sent before; `last`: those layers have no more to come). The
    token stage keeps it until the microbatch's first step there."""

    kind = "kv"
    layers: tuple[int, int]
    last: bool = True
    piece: torch.Tensor = attrs.field(eq=BY_VALUE)


@attrs.frozen(kw_only=True)
class Cancel(MicrobatchMessage):
    """The head -> the first decoding stage, each stage -> the next: end `rows` (in a slot, requests by number) of
    microbatch `microbatch` at their next step (their requests were cancelled); the last stage ends them."""

    kind = "cancel"
    rows: list[int]


@attrs.frozen(kw_only=True)
class NotEntered(MicrobatchMessage):
    """A slot's first stage -> the head: `members` of a group queued for slot `microbatch` were cancelled before
    they entered, and were taken out of it; the head no longer counts them on their way in."""

    kind = "not_entered"
    members: list[int]


@attrs.frozen(kw_only=True)
class End(MicrobatchMessage):
    """Free microbatch (or idle slot) `microbatch`'s cache: the last stage (or the head, for an idle slot) -> the
    first decoding stage, each -> the next; the last to free it answers the head `Freed`."""

    kind = "end"


@attrs.frozen
class RoundDone:
    """What a slot's round did, as its last stage reports it: the `round` (the schedule's), the `members` it gave a
    token (in the order of the report's tokens), the group whose prompts are now in (`complete`), whether the round
    ran nothing (`idle`: the slot is parked), the row change the next round opens with (`next`: requests that
    left, and the group that joins, or None), and the members that `failed`, with why."""

    round: Round
    members: list[int]
    complete: list[int]
    idle: bool
    next: tuple[list[int], list[int] | None]
    failed: dict[int, RowFailure]


@attrs.frozen(kw_only=True)
class RoundReport(MicrobatchMessage):
    """The last stage -> the head: slot `microbatch`'s round (`done`), its `tokens` (a member each), the
    log-probabilities of the members that ask (`scores`, by member), and with recovery the generators' `states`
    after it (a member each; None: no member samples). The head streams and answers, and lets requests into the
    slot's free rows. A round of an epoch before the head's counts until a recovery plans the slot."""

    kind = "round_report"
    done: RoundDone
    scores: Scores = attrs.field(factory=Scores)
    tokens: torch.Tensor = attrs.field(eq=BY_VALUE)
    states: torch.Tensor | None = attrs.field(eq=BY_VALUE, default=None)


@attrs.frozen(kw_only=True)
class Prefilled(MicrobatchMessage):
    """Disaggregated: the prompt pipeline's last stage -> the head: the first `tokens` `[rows, 1]` of microbatch
    (or group) `microbatch`, its prompts' `mask`, the rows `ended` with them (uint8), its generators' states
    (`rng`, empty when none samples), the rows that `failed`, the log-probabilities (`scores`, by row) and the
    columns each prompt step ran (`chunk`, 0: all in one). The head stages the microbatch for a token stage
    (`Start`), or sends the group to its slot (`Enter`)."""

    kind = "prefilled"
    failed: dict[int, RowFailure] = attrs.field(factory=dict)
    chunk: int = 0
    scores: Scores = attrs.field(factory=Scores)
    tokens: torch.Tensor = attrs.field(eq=BY_VALUE)
    mask: torch.Tensor = attrs.field(eq=BY_VALUE)
    ended: torch.Tensor = attrs.field(eq=BY_VALUE)
    rng: torch.Tensor = attrs.field(eq=BY_VALUE)


@attrs.frozen(kw_only=True)
class Freed(MicrobatchMessage):
    """The last stage to free microbatch (or slot) `microbatch`'s cache -> the head: its room is free."""

    kind = "freed"


@attrs.frozen(kw_only=True)
class MicrobatchFailed(MicrobatchMessage):
    """A stage -> the head: its computation failed on microbatch `microbatch` (`error`); the stage goes on. The
    head fails its requests and has every stage drop it."""

    kind = "microbatch_failed"
    stage: str
    error: str


@attrs.frozen(kw_only=True)
class LinkLost(EpochMessage):
    """A stage -> the head, once per epoch: `stage` could not reach a neighbour (`error`), and waits for a recovery
    (with recovery; without, it reports `Failed` and stops)."""

    kind = "link_lost"
    stage: str
    error: str
