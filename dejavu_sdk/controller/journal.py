"""The controller's journal: every request it admitted and every token it streamed, in a store that outlives it.

A controller started with `journal=` (`--journal`; any store URL that outlives the process: `lmdb://`, `file://`,
`s3://`, `tcp://` to a `dejavu serve-store`) records each admitted request (its prompts as token ids, limits,
decodings with the seed each choice samples from, stop strings and answer shape), each token as the pipeline
streams it, each choice's end, and each request's answer. Writing never happens on the event loop nor on the
pipeline's receiver thread: they put entries on a queue, and a writer thread groups what arrived within
up to `interval` seconds into one record (a progress record of the stream `dejavu-journal`, under a run id of
the controller's incarnation that sorts by its start), written as soon as the queue is empty. So each record
holds what a step's worth of time added, and its size does not grow with the requests' lengths. Each entry has a
sequence number, and `when_written(n, callback)` says when the entries up to the n-th are written: the API sends
a token to its client only once the journal holds it, so a successor never owes a client a token it cannot know.

`read_journal(url)` gives back every request with the tokens the journal holds of each choice, in order: a record
is written whole or not at all, and records are read in the order they were written, so what a reader sees after a
kill -9 is a prefix of what was streamed.

The journal does not grow without end: the writer folds what it writes (starting from what the journal held when
it opened, a predecessor's requests included), and once the records written since the last snapshot outweigh
`compact_bytes` (and twice that snapshot) it writes a snapshot (the head, every request not answered, and those
answered within `keep_finished` seconds, as step 0 of a new log) and then removes every record before it. A reader
starts at the last snapshot; a kill between the snapshot and the removal leaves records that the next snapshot
removes.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from ..backends import open_store
from ..blocks import ProgressKey
from ..errors import ConfigError, DejaVuError
from ..store import Store
from .limits import KEEP_FINISHED
from .openai_requests import Choice, GenerationRequest

log = logging.getLogger(__name__)

#: The stream id the journal's records live under.
JOURNAL_STREAM = "dejavu-journal"
#: Seconds of entries grouped into one record.
INTERVAL = 0.05
#: Bytes of records (at least) between two snapshots (`compact_bytes`).
COMPACT_BYTES = 8 << 20


@attrs.define
class JournaledRequest:
    """A request as the journal holds it: what was admitted (`admitted`: the request's fields), each choice's
    tokens so far and finish reason once it ended, and whether it was answered (`answered`: its outcome, at
    `answered_at`, seconds since the epoch)."""

    id: str
    admitted: dict[str, Any]
    tokens: dict[int, list[int]] = attrs.field(factory=dict)
    finish: dict[int, str] = attrs.field(factory=dict)
    answered: str | None = None
    answered_at: float = 0.0

    def request(self) -> GenerationRequest:
        """The request as it was admitted."""
        fields = self.admitted
        return GenerationRequest(**{**fields, "choices": [Choice(**choice) for choice in fields["choices"]],
                                    "stop": tuple(fields["stop"])})


class Journal:
    """The writing side, opened on a store URL; `close()` writes what is queued and closes the store."""

    def __init__(self, url: str, interval: float = INTERVAL, keep_finished: float = KEEP_FINISHED,
                 compact_bytes: int = COMPACT_BYTES) -> None:
        if not isinstance(url, str):
            raise ConfigError(f"journal= takes a store URL, got {type(url).__name__}")
        self.store = open_store(url)
        if not self.store.persistent:
            self.store.close()
            raise ConfigError(f"journal={url!r} would not outlive this process: give lmdb://, file://, s3:// or a "
                              "tcp:// store server")
        self.url, self.interval, self.keep_finished, self.compact_bytes = url, interval, keep_finished, compact_bytes
        began = time.monotonic()
        try:
            records = _records(self.store)
        except BaseException:
            self.store.close()
            raise
        #: What the journal held when it opened (a predecessor's requests and head, for a successor to take over),
        #: and the seconds reading it took.
        self.found = JournalState.fold(records)
        self.read_seconds = time.monotonic() - began
        #: What it holds: the writer thread's, each record folded in as it is written.
        self.held = JournalState.fold(records)
        self._since_snapshot = 0  # bytes written since the last snapshot (or the opening)
        self._snapshot_bytes = 0
        self._removable: ProgressKey | None = None  # a snapshot written, whose earlier records are still there
        self._log = 0
        # sorts after every run before it (by its start, or past the last run's when this clock is behind)
        runs = [key.run for key in self.store.progress_keys(JOURNAL_STREAM)]
        start = max(time.time_ns() // 1_000_000, max((int(run[:12], 16) + 1 for run in runs), default=0))
        self.run = f"{start:012x}{secrets.token_hex(4)}"
        #: Entries to write (kind, fields, sequence number); None: close; an Event: set it once what came before
        #: is written.
        self._entries: queue.SimpleQueue[tuple[str, Any, int] | threading.Event | None] = queue.SimpleQueue()
        self._step = 0
        self.error: DejaVuError | None = None  # the write that failed (the journal then stops writing)
        self._lock = threading.Lock()
        self._queued = self.written = 0  # entries queued and written so far
        self._stopped = False  # written no more (failed or closed): every wait ends at once
        self._waiting: list[tuple[int, Callable[[], object]]] = []  # (sequence number, callback) not yet due
        self._thread = threading.Thread(target=self._write_loop, name="dejavu-journal", daemon=True)
        self._thread.start()

    # ---- from any thread: a queue put, nothing more -------------------------------------------------------
    def admitted(self, request_id: str, fields: dict[str, Any]) -> int:
        return self._put("admitted", [request_id, fields])

    def token(self, request_id: str, choice: int, index: int, token: int) -> int:
        """Choice `choice`'s token number `index` (from 0); the entry's sequence number."""
        return self._put("token", [request_id, choice, index, token])

    def finished(self, request_id: str, choice: int, reason: str) -> int:
        return self._put("finished", [request_id, choice, reason])

    def answered(self, request_id: str, outcome: str) -> int:
        return self._put("answered", [request_id, outcome, time.time()])

    def microbatch(self, number: int, rows: list[Any]) -> int:
        """The rows of the pipeline's static microbatch `number`, in order: each a [request id, choice], or None
        (a row of no request of this journal's)."""
        return self._put("microbatch", [number, rows])

    def slot_group(self, slot: int, members: list[int], rows: list[Any]) -> int:
        """A group of requests sent into continuous batching's slot `slot`: the pipeline's numbers for them
        (`members`), and each one's [request id, choice] (or None)."""
        return self._put("slot_group", [slot, members, rows])

    def head(self, url: str | None, token: str | None = None, epoch: int = 0, prefix: str | None = None) -> int:
        """Where this controller's stage workers join (and, when it drew it, their links' token), and its
        pipeline's epoch: a successor listens there too, so that they can rejoin it, in a later epoch. None: the
        controller closed, and its workers stopped."""
        return self._put("head", [url, token, epoch, prefix])

    def _put(self, kind: str, fields: list[Any]) -> int:
        with self._lock:  # sequence numbers in the queue's order
            self._queued += 1
            self._entries.put((kind, fields, self._queued))
            return self._queued

    def when_written(self, sequence: int, callback: Callable[[], object]) -> None:
        """Call `callback()` once the entries up to number `sequence` are written, or the journal writes no more
        (failed or closed): here if that is so already, else on the writer thread."""
        with self._lock:
            due = self._stopped or self.written >= sequence
            if not due:
                self._waiting.append((sequence, callback))
        if due:
            callback()

    def _wrote(self, sequence: int, stopped: bool = False) -> None:
        """Entries up to `sequence` are written (or, `stopped`, none will be): call the callbacks now due."""
        with self._lock:
            self.written = max(self.written, sequence)
            self._stopped = self._stopped or stopped
            due = [callback for number, callback in self._waiting if self._stopped or number <= self.written]
            self._waiting = [(number, callback) for number, callback in self._waiting
                             if not self._stopped and number > self.written]
        for callback in due:
            try:
                callback()
            except Exception:  # noqa: PERF203 - a waiter gone meanwhile (its event loop closed): none to tell
                log.debug("a journal waiter could not be told", exc_info=True)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until what was queued before this call is written (False: not within `timeout` seconds)."""
        written = threading.Event()
        self._entries.put(written)
        return written.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (waiting up to `timeout` seconds), then close the store. Closing twice is
        harmless."""
        if self.store.closed:
            return
        self._entries.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the journal's writer did not finish within %.0f s", timeout)
            return
        self.store.close()

    # ---- the writer thread -------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        closing = False
        while not closing:
            batch: list[tuple[str, Any, int]] = []
            waiting: list[threading.Event] = []  # flushes to answer once this batch is written
            entry = self._entries.get()
            deadline = time.monotonic() + self.interval
            while True:
                if entry is None:
                    closing = True
                elif isinstance(entry, threading.Event):
                    waiting.append(entry)
                else:
                    batch.append(entry)
                if closing or waiting or time.monotonic() >= deadline:
                    break
                try:  # what is queued now, without waiting for more: a token waits for its record
                    entry = self._entries.get_nowait()
                except queue.Empty:
                    break
            if batch and self.error is None:
                self._write(batch)
            if batch:
                self._wrote(batch[-1][2], stopped=self.error is not None)
            for written in waiting:
                written.set()
            self._remove_before_snapshot()
        self._wrote(self._queued, stopped=True)

    def _write(self, batch: list[tuple[str, Any, int]]) -> None:
        record: dict[str, list[Any]] = {}
        for kind, entry, _ in batch:
            record.setdefault(kind, []).append(entry)
        try:
            written = json.dumps(record).encode()
            self.store.put_progress(ProgressKey(JOURNAL_STREAM, self.run, self._log, self._step), written)
        except Exception as error:  # a store that fails, or an entry it cannot hold: the journal stops, serving goes on
            self.error = error if isinstance(error, DejaVuError) else DejaVuError(f"{type(error).__name__}: {error}")
            log.error("the journal at %s stopped: %s", self.url, self.error)
            return
        self._step += 1
        self.held.apply(record)
        self._since_snapshot += len(written)
        if self._since_snapshot > max(self.compact_bytes, 2 * self._snapshot_bytes):
            self._snapshot()

    def _snapshot(self) -> None:
        """Write what the journal holds as step 0 of a new log, then remove every record before it."""
        self.held.forget_answered(time.time() - self.keep_finished)
        snapshot = json.dumps(self.held.snapshot()).encode()
        key = ProgressKey(JOURNAL_STREAM, self.run, self._log + 1, 0)
        # the next records go after it, written or not: readers start at it if it was, else at the one before
        self._log, self._step = key.log, 1
        self._since_snapshot, self._snapshot_bytes = 0, len(snapshot)
        try:
            self.store.put_progress(key, snapshot)
        except Exception as error:  # the records before it stay, and so does what they say
            log.warning("the journal at %s could not write a snapshot (its records stay): %s", self.url, error)
            return
        self._removable = key

    def _remove_before_snapshot(self) -> None:
        """Remove every record before the last snapshot (once the entries it followed are released)."""
        key, self._removable = self._removable, None
        if key is None:
            return
        try:
            for run in sorted({older.run for older in self.store.progress_keys(JOURNAL_STREAM) if older < key}):
                self.store.remove_progress(JOURNAL_STREAM, run, below_log=key.log if run == self.run else None)
        except Exception as error:  # left for the next snapshot: readers start at this one
            log.warning("the journal at %s could not remove the records before its snapshot: %s", self.url, error)


def with_seeds(request: GenerationRequest) -> GenerationRequest:
    """`request` with a seed drawn for each sampled choice that has none: a journaled choice must say which
    generator it samples from, so that a successor can go on with the same tokens."""
    choices = [choice if not choice.decoding.get("do_sample") or choice.decoding.get("seed") is not None
               else attrs.evolve(choice, decoding={**choice.decoding, "seed": secrets.randbits(63)})
               for choice in request.choices]
    return attrs.evolve(request, choices=choices)


@attrs.frozen
class JournaledHead:
    """Where the last controller of a journal had its stage workers join, and their token if it drew it."""

    url: str
    token: str | None
    epoch: int = 0
    #: What its pipeline's replica streams are named from: its workers hold replicas under it.
    prefix: str | None = None


def read_journal(url: str | Store) -> dict[str, JournaledRequest]:
    """Every request the journal at `url` holds, in the order they were admitted, by id."""
    return JournalState.fold(_records(url)).requests


def _records(url: str | Store) -> list[dict[str, Any]]:
    """The journal's records from its last snapshot on, in the order they were written."""
    store = open_store(url)
    try:
        keys = store.progress_keys(JOURNAL_STREAM)
        snapshots = [index for index, key in enumerate(keys) if key.log > 0 and key.step == 0]
        return [json.loads(store.read_progress(key)) for key in keys[snapshots[-1] if snapshots else 0:]]
    finally:
        if isinstance(url, str):
            store.close()


@attrs.define
class JournalState:
    """What a journal's records say: its requests, by id in the order admitted, its head, and the rows of the
    static microbatches that hold a request not answered (`microbatches`: number -> [request id, choice] or None
    per row), and the groups of the slots that do (`slots`)."""

    requests: dict[str, JournaledRequest] = attrs.field(factory=dict)
    head: JournaledHead | None = None
    microbatches: dict[int, list[tuple[str, int] | None]] = attrs.field(factory=dict)
    #: Continuous batching: each slot's groups, in the order sent, as (members, [request id, choice] or None each).
    slots: dict[int, list[tuple[list[int], list[tuple[str, int] | None]]]] = attrs.field(factory=dict)

    @classmethod
    def fold(cls, records: Iterable[dict[str, Any]]) -> JournalState:
        """The state that `records`, in the order they were written, describe."""
        state = cls()
        for record in records:
            state.apply(record)
        return state

    def apply(self, record: dict[str, Any]) -> None:
        """Fold one record in: a snapshot replaces what came before it."""
        requests = self.requests
        if "snapshot" in record:
            requests.clear()
            self.microbatches.clear()
            self.slots.clear()
            for request_id, admitted, tokens, finish, answered, answered_at in record["snapshot"]:
                requests[request_id] = JournaledRequest(
                    request_id, admitted, {int(choice): list(ids) for choice, ids in tokens.items()},
                    {int(choice): reason for choice, reason in finish.items()}, answered, float(answered_at))
        for number, rows in [*record.get("microbatches", []), *record.get("microbatch", [])]:
            self.microbatches[int(number)] = _rows(rows)
        for slot, groups in record.get("slots", []):
            self.slots[int(slot)] = [(list(members), _rows(rows)) for members, rows in groups]
        for slot, members, rows in record.get("slot_group", []):
            self.slots.setdefault(int(slot), []).append((list(members), _rows(rows)))
        for url, token, *epoch in record.get("head", []):
            self.head = None if url is None else JournaledHead(url, token, *epoch)
        for request_id, fields in record.get("admitted", []):
            requests[request_id] = JournaledRequest(request_id, fields)
        unknown = JournaledRequest("", {})  # what is said of a request no longer held (answered, forgotten) goes here
        for request_id, choice, index, token in record.get("token", []):
            tokens = requests.get(request_id, unknown).tokens.setdefault(int(choice), [])
            if index == len(tokens):
                tokens.append(int(token))
        for request_id, choice, reason in record.get("finished", []):
            requests.get(request_id, unknown).finish[int(choice)] = reason
        for request_id, outcome, *when in record.get("answered", []):
            requests.get(request_id, unknown).answered = outcome
            requests.get(request_id, unknown).answered_at = float(when[0]) if when else 0.0

    def forget_answered(self, before: float) -> None:
        """Drop the requests answered before `before` (seconds since the epoch): no successor keeps them."""
        self.requests = {request_id: request for request_id, request in self.requests.items()
                         if request.answered is None or request.answered_at >= before}
        self.microbatches = {number: rows for number, rows in self.microbatches.items() if self._running(rows)}
        self.slots = {slot: groups for slot, groups in self.slots.items()
                      if any(self._running(rows) for _, rows in groups)}

    def _running(self, rows: list[tuple[str, int] | None]) -> bool:
        """Whether one of `rows` is a request not answered yet."""
        return any(row is not None and row[0] in self.requests and self.requests[row[0]].answered is None
                   for row in rows)

    def snapshot(self) -> dict[str, Any]:
        """A record that says all of this at once."""
        head = ([None, None] if self.head is None else
                [self.head.url, self.head.token, self.head.epoch, self.head.prefix])
        return {"snapshot": [[request.id, request.admitted, request.tokens, request.finish, request.answered,
                              request.answered_at] for request in self.requests.values()], "head": [head],
                "microbatches": [[number, rows] for number, rows in self.microbatches.items()],
                "slots": [[slot, groups] for slot, groups in self.slots.items()]}


def _rows(rows: list[Any]) -> list[tuple[str, int] | None]:
    """Rows as a record gives them back: each a (request id, choice), or None."""
    return [None if row is None else (str(row[0]), int(row[1])) for row in rows]
