"""What a controller's journal says: its requests, where its stage workers join, and the rows of the batches that
hold a running request, folded from its records in the order they were written (`JournalState`).

The writer folds what it writes (`Journal.held`), a successor what it found (`Journal.found`), and
`journal.read_journal(url)` what a store holds. A writer's or successor's state keeps finished requests bounded
(`keep`: at most that many answered requests, the oldest answered going first), and an answered request that no
running batch names keeps only what showing it again needs: its prompts shrink to their number of tokens.
"""

from __future__ import annotations

import collections
import io
import json
import secrets
from collections.abc import Iterable
from typing import Any

import attrs

from .openai_requests import Choice, GenerationRequest

#: Batches a state names before it looks for those with no running row (doubled past what it keeps).
PRUNE_AT = 1024


@attrs.define
class JournaledRequest:
    """A request as the journal holds it: what was admitted (`admitted`: the request's fields), each choice's
    tokens so far and finish reason once it ended, and whether it was answered (`answered`: its outcome, at
    `answered_at`, seconds since the epoch). `prompt_tokens`: set once the prompts were dropped (`shrink`), the
    number of tokens they had."""

    id: str
    _admitted: dict[str, Any] | bytes  # bytes: its JSON, once shrunk (a tenth of the objects' size)
    tokens: dict[int, list[int]] = attrs.field(factory=dict)
    finish: dict[int, str] = attrs.field(factory=dict)
    answered: str | None = None
    answered_at: float = 0.0
    prompt_tokens: int | None = None
    #: Where the request asked for log-probabilities: each choice's tokens' entries, aligned with `tokens`, in their
    #: wire form (`TokenLogprobs.wire`; None: lost).
    logprobs: dict[int, list[Any]] = attrs.field(factory=dict)

    @property
    def admitted(self) -> dict[str, Any]:
        fields = self._admitted
        return json.loads(fields) if isinstance(fields, bytes) else fields

    def request(self) -> GenerationRequest:
        """The request as it was admitted (with empty prompts where they were dropped)."""
        fields = self.admitted
        return GenerationRequest(**{**fields, "choices": [Choice(**choice) for choice in fields["choices"]],
                                    "stop": tuple(fields["stop"])})

    def prompt_count(self) -> int:
        """Its prompts' tokens, all together."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return sum(len(prompt) for prompt in self.admitted.get("prompts", []))

    def shrink(self) -> None:
        """Drop the prompts, keeping their number of tokens, and keep the rest as JSON: what an answered request
        is shown with needs no more."""
        if isinstance(self._admitted, dict):
            fields = self._admitted
            self.prompt_tokens = self.prompt_count()
            self._admitted = json.dumps({
                **fields, "prompts": [[] for _ in fields.get("prompts", [])],
                "choices": [{**choice, "prompt": []} for choice in fields.get("choices", [])]}).encode()


@attrs.frozen
class JournaledHead:
    """Where the last controller of a journal had its stage workers join, and their token if it drew it."""

    url: str
    token: str | None
    epoch: int = 0
    #: What its pipeline's replica streams are named from: its workers hold replicas under it.
    prefix: str | None = None


@attrs.define
class JournalState:
    """What a journal's records say: its requests, by id in the order admitted, its head (`headed`: whether a
    record said where it is, as the first record of every controller does, and every snapshot), and the groups of
    the microbatches (slots) that hold a request not answered (`slots`). `keep`: answered requests kept at most
    (None: all of them, as they were admitted)."""

    requests: dict[str, JournaledRequest] = attrs.field(factory=dict)
    head: JournaledHead | None = None
    headed: bool = False
    #: Each slot's groups, in the order sent, as (members, [request id, choice] or None each).
    slots: dict[int, list[tuple[list[int], list[tuple[str, int] | None]]]] = attrs.field(factory=dict)
    keep: int | None = None
    #: Ids of the answered requests held, the first answered first; those of them whose prompts are not dropped.
    _answered: collections.OrderedDict[str, None] = attrs.field(factory=collections.OrderedDict, init=False)
    _whole: set[str] = attrs.field(factory=set, init=False)
    _prune_at: int = attrs.field(default=PRUNE_AT, init=False)

    @classmethod
    def fold(cls, records: Iterable[dict[str, Any]], keep: int | None = None) -> JournalState:
        """The state that `records`, in the order they were written, describe."""
        state = cls(keep=keep)
        for record in records:
            state.apply(record)
        return state

    def apply(self, record: dict[str, Any]) -> None:
        """Fold one record in: a snapshot replaces what came before it."""
        requests = self.requests
        if "snapshot" in record:
            self._restart(record["snapshot"])
        for slot, groups in record.get("slots", []):
            self.slots[int(slot)] = [(list(members), _rows(rows)) for members, rows in groups]
        for slot, members, rows in record.get("slot_group", []):
            self.slots.setdefault(int(slot), []).append((list(members), _rows(rows)))
        for url, token, *epoch in record.get("head", []):
            self.head = None if url is None else JournaledHead(url, token, *epoch)
            self.headed = True
        for request_id, fields in record.get("admitted", []):
            requests[request_id] = JournaledRequest(request_id, fields)
        unknown = JournaledRequest("", {})  # what is said of a request no longer held (answered, forgotten) goes here
        for request_id, choice, index, token, *logprobs in record.get("token", []):
            held = requests.get(request_id, unknown)
            tokens = held.tokens.setdefault(int(choice), [])
            if index == len(tokens):
                tokens.append(int(token))
                if logprobs:
                    held.logprobs.setdefault(int(choice), []).append(logprobs[0])
        for request_id, choice, reason in record.get("finished", []):
            requests.get(request_id, unknown).finish[int(choice)] = reason
        for request_id, outcome, *when in record.get("answered", []):
            request = requests.get(request_id)
            if request is not None:
                request.answered, request.answered_at = outcome, float(when[0]) if when else 0.0
                self._note_answered(request_id)
        if self.keep is not None:
            self._bound()

    def _restart(self, snapshot: list[list[Any]]) -> None:
        """Replace what is held by what a snapshot says."""
        self.requests.clear()
        self.slots.clear()
        self._answered.clear()
        self._whole.clear()
        for request_id, admitted, tokens, finish, answered, answered_at, *more in snapshot:
            prompt_tokens, logprobs = more[0] if more else None, more[1] if len(more) > 1 else {}
            self.requests[request_id] = JournaledRequest(
                request_id, admitted, {int(choice): list(ids) for choice, ids in tokens.items()},
                {int(choice): reason for choice, reason in finish.items()}, answered, float(answered_at),
                prompt_tokens, {int(choice): entries for choice, entries in logprobs.items()})
        for request in sorted((request for request in self.requests.values() if request.answered is not None),
                              key=lambda request: request.answered_at):
            self._note_answered(request.id)

    def _note_answered(self, request_id: str) -> None:
        self._answered[request_id] = None
        self._answered.move_to_end(request_id)
        if self.requests[request_id].prompt_tokens is None:
            self._whole.add(request_id)
        elif self.keep is not None:  # its prompts were dropped already
            self.requests[request_id].shrink()

    def _bound(self) -> None:
        """Keep at most `keep` answered requests, and drop the prompts of answered ones no running batch names
        (looked for once the batches or those requests outnumber what was last left, twice over)."""
        assert self.keep is not None
        while len(self._answered) > self.keep:
            request_id, _ = self._answered.popitem(last=False)
            self.requests.pop(request_id, None)
            self._whole.discard(request_id)
        if len(self.slots) + len(self._whole) > self._prune_at:
            self.prune()

    def prune(self) -> None:
        """Drop the batches with no running row, and the prompts of answered requests no batch left names."""
        self.slots = {slot: groups for slot, groups in self.slots.items()
                      if any(self._running(rows) for _, rows in groups)}
        named = {row[0] for groups in self.slots.values() for _, rows in groups for row in rows if row is not None}
        for request_id in [request_id for request_id in self._whole if request_id not in named]:
            self.requests[request_id].shrink()
            self._whole.discard(request_id)
        self._prune_at = max(PRUNE_AT, 2 * (len(self.slots) + len(self._whole)))

    def forget_answered(self, before: float) -> None:
        """Drop the requests answered before `before` (seconds since the epoch), looking from the first answered
        on: no successor keeps them."""
        while self._answered:
            request_id = next(iter(self._answered))
            if self.requests[request_id].answered_at >= before:
                break
            del self._answered[request_id]
            del self.requests[request_id]
            self._whole.discard(request_id)

    def _running(self, rows: list[tuple[str, int] | None]) -> bool:
        """Whether one of `rows` is a request not answered yet."""
        return any(row is not None and row[0] in self.requests and self.requests[row[0]].answered is None
                   for row in rows)

    def snapshot(self) -> bytes:
        """A record that says all of this at once, as JSON (an answered request's admitted fields as it holds
        them: written as they are, not decoded again)."""
        head = ([None, None] if self.head is None else
                [self.head.url, self.head.token, self.head.epoch, self.head.prefix])
        out = io.BytesIO()
        out.write(b'{"snapshot": [')
        for number, request in enumerate(self.requests.values()):
            admitted = request._admitted
            out.write(b",[" if number else b"[")
            out.write(json.dumps(request.id).encode() + b",")
            out.write(admitted if isinstance(admitted, bytes) else json.dumps(admitted).encode())
            more = ([request.prompt_tokens, request.logprobs] if request.logprobs else
                    [] if request.prompt_tokens is None else [request.prompt_tokens])
            rest = [request.tokens, request.finish, request.answered, request.answered_at, *more]
            out.write(b"," + json.dumps(rest).encode()[1:])
        out.write(b"], " + json.dumps({"head": [head],
                                      "slots": [[slot, groups] for slot, groups in self.slots.items()]}).encode()[1:])
        return out.getvalue()


def with_seeds(request: GenerationRequest) -> GenerationRequest:
    """`request` with a seed drawn for each sampled choice that has none: a journaled choice must say which
    generator it samples from, so that a successor can go on with the same tokens."""
    choices = [choice if not choice.decoding.get("do_sample") or choice.decoding.get("seed") is not None
               else attrs.evolve(choice, decoding={**choice.decoding, "seed": secrets.randbits(63)})
               for choice in request.choices]
    return attrs.evolve(request, choices=choices)


def _rows(rows: list[Any]) -> list[tuple[str, int] | None]:
    """Rows as a record gives them back: each a (request id, choice), or None."""
    return [None if row is None else (str(row[0]), int(row[1])) for row in rows]
