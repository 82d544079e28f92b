"""The controller's journal: every request it admitted and every token it streamed, in a store that outlives it.

A controller started with `journal=` (`--journal`; any store URL that outlives the process: `lmdb://`, `file://`,
`s3://`, `tcp://` to a `dejavu serve-store`) records each admitted request (its prompts as token ids, limits,
decodings with the seed each choice samples from, stop strings and answer shape), each token as the pipeline
streams it, each choice's end, and each request's answer. The event loop and the pipeline's receiver thread only
put entries on a queue; a writer thread groups what arrived within up to `interval` seconds into one record
(journal_store.py), written as soon as the queue is empty. Each entry has a sequence number, and
`when_written(n, callback)` says when the entries up to the n-th are written: the API sends a token to its client
only once the journal holds it, so a successor never owes a client a token it cannot know.

One controller writes a journal at a time: opening it takes its lease (journal_lease.py). A journal that lost its
records (an LMDB data file of 0 bytes, records without the head every controller writes first) is refused
(ConfigError) unless `reset` starts it afresh. A write that fails is tried again every `RETRY` seconds, with what
was queued since: meanwhile `failure` says why, and with `failure_policy="stop"` (the default) waiters wait (the
API takes no new request and holds tokens back), with "serve" they are told to go on without it. A holder that
finds its lease taken (`fenced`) writes no more, and its waiters are told their entries never will be written.

`read_journal(url)` gives back every request with the tokens the journal holds of each choice, in order; after a
kill -9, a prefix of what was streamed (a record is written whole or not at all, and read in the order written).
The writer folds what it writes (journal_state.py; at most `keep` answered requests, none answered more than
`keep_finished` seconds ago), and once the records written since the last snapshot outweigh `compact_bytes` (and
twice that snapshot) it writes a snapshot of that, as step 0 of a new log, then removes every record before it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from ..backends import open_store
from ..blocks import ProgressKey
from ..errors import ConfigError
from ..store import Store
from .journal_lease import LEASE_SECONDS, Lease
from .journal_state import JournaledHead, JournaledRequest, JournalState, with_seeds
from .journal_store import JOURNAL_STREAM, check_data_file, discard_records, new_run, read_records, remove_before
from .journal_waiting import Waiting
from .limits import JOURNAL_FAILURES, KEEP_FINISHED, MAX_KEPT

log = logging.getLogger(__name__)

__all__ = ["JOURNAL_STREAM", "Journal", "JournalState", "JournaledHead", "JournaledRequest", "read_journal",
           "with_seeds"]

#: Seconds of entries grouped into one record.
INTERVAL = 0.05
#: Bytes of records (at least) between two snapshots (`compact_bytes`).
COMPACT_BYTES = 8 << 20
#: Seconds between two tries of a write that failed.
RETRY = 1.0
#: What a journal that cannot write does (`failure_policy`): its waiters wait ("stop"), or go on ("serve").
FAILURE_POLICIES = JOURNAL_FAILURES
#: Entries a journal serving on without its store keeps for it at most; past them it drops them, and its
#: successor does not know what they said.
MAX_PENDING = 100_000


@attrs.frozen
class _Flush:
    """A `flush` call: set `done` once the entries up to `sequence` are written, or never will be."""

    sequence: int
    done: threading.Event = attrs.field(factory=threading.Event)


class Journal:
    """The writing side, opened on a store URL; `close()` writes what is queued and closes the store.

    `failure_policy`: "stop" or "serve" (see the module). `lease`: seconds the journal's lease lasts unless
    renewed; `take_over`: take it without waiting for another holder's to lapse. `reset`: discard what the journal
    holds and start it empty. `keep`: answered requests held at most."""

    def __init__(self, url: str, interval: float = INTERVAL, keep_finished: float = KEEP_FINISHED,
                 compact_bytes: int = COMPACT_BYTES, *, failure_policy: str = "stop", lease: float = LEASE_SECONDS,
                 take_over: bool = False, reset: bool = False, keep: int = MAX_KEPT) -> None:
        if not isinstance(url, str):
            raise ConfigError(f"journal= takes a store URL, got {type(url).__name__}")
        if failure_policy not in FAILURE_POLICIES:
            raise ConfigError(f"journal_failure must be one of {', '.join(FAILURE_POLICIES)}, got {failure_policy!r}")
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0.2 <= lease <= 3600:
            raise ConfigError(f"journal_lease must be seconds from 0.2 to 3600, got {lease!r}")
        check_data_file(url, reset)
        self.store = open_store(url)
        if not self.store.persistent:
            self.store.close()
            raise ConfigError(f"journal={url!r} would not outlive this process: give lmdb://, file://, s3:// or a "
                              "tcp:// store server")
        self.url, self.interval, self.keep_finished, self.compact_bytes = url, interval, keep_finished, compact_bytes
        self.failure_policy = failure_policy
        self.lease = Lease(self.store, lease)
        try:
            self.run = new_run(self.store)
            self.lease.acquire(self.run, take_over)
            began = time.monotonic()
            records = read_records(self.store)
            if reset:
                if records:
                    log.warning("the journal at %s starts empty: %d records are discarded (journal_reset)", url,
                                len(records))
                discard_records(self.store)
                records = []
            #: What the journal held when it opened (a predecessor's requests and head, for a successor to take
            #: over), the seconds reading it took, and those spent waiting for a former holder's lease to lapse.
            self.found = JournalState.fold(records, keep)
            if records and not self.found.headed:
                raise ConfigError(f"the journal at {url} has {len(records)} records but not the head record its "
                                  "controller writes first: records were lost; restore the journal, or pass "
                                  "--journal-reset (journal_reset=True) to start it empty")
            self.read_seconds = time.monotonic() - began
            self.lease_seconds = self.lease.waited
        except BaseException:
            if self.lease.renewed_at:
                self.lease.release()
            self.store.close()
            raise
        #: What it holds: the writer thread's, each record folded in as it is written.
        self.held = JournalState.fold(records, keep)
        self._since_snapshot = 0  # bytes written since the last snapshot (or the opening)
        self._snapshot_bytes = 0
        self._removable: ProgressKey | None = None  # a snapshot written, whose earlier records are still there
        self._log = self._step = 0
        #: Entries to write (kind, fields, sequence number); None: close; a _Flush: answer it once what came before
        #: is written.
        self._entries: queue.SimpleQueue[tuple[str, Any, int] | _Flush | None] = queue.SimpleQueue()
        #: Why the journal cannot write now (None: it can), whether another controller took it over (it then
        #: writes no more), whether it stopped (fenced, closed, or an entry it cannot hold), the writes that failed
        #: and the entries dropped (serving on without it). `on_failed_write()` is told of each failed write.
        self.failure: str | None = None
        self.fenced = self.stopped = False
        self.failed_writes = self.lost = 0
        self.on_failed_write: Callable[[], object] | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._queued = self.written = 0  # entries queued, and written where a successor reads them, so far
        self._committed = 0  # entries written, whether or not the lease was known to be valid then
        self._waiting = Waiting(self._due)
        self._thread = threading.Thread(target=self._write_loop, name="dejavu-journal", daemon=True)
        self._thread.start()
        head = self.found.head  # every controller's first record says where the head is: what it found
        if head is None:
            self.head(None)
        else:
            self.head(head.url, head.token, head.epoch, head.prefix)

    # ---- from any thread: a queue put, nothing more -------------------------------------------------------
    def admitted(self, request_id: str, fields: dict[str, Any]) -> int:
        return self._put("admitted", [request_id, fields])

    def token(self, request_id: str, choice: int, index: int, token: int, *logprobs: list[Any] | None) -> int:
        """Choice `choice`'s token number `index` (from 0), and where the request asked for them its
        log-probabilities (one wire form, `TokenLogprobs.wire`, or None: lost), which a successor streams again as
        they were. The entry's sequence number."""
        return self._put("token", [request_id, choice, index, token, *logprobs])

    def finished(self, request_id: str, choice: int, reason: str) -> int:
        return self._put("finished", [request_id, choice, reason])

    def answered(self, request_id: str, outcome: str) -> int:
        return self._put("answered", [request_id, outcome, time.time()])

    def slot_group(self, slot: int, members: list[int], rows: list[Any]) -> int:
        """A group of requests sent into the pipeline's slot `slot`: the pipeline's numbers for them
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

    def when_written(self, sequence: int, callback: Callable[[bool], object]) -> None:
        """Call `callback(True)` once the entries up to number `sequence` are written (or, serving on without the
        journal, once it cannot write), `callback(False)` once they never will be (fenced, closed): here if that
        is so already, else on the writer thread."""
        self._waiting.when(sequence, callback)

    def _due(self, sequence: int) -> bool | None:
        """What a waiter for `sequence` is told now (None: nothing yet)."""
        if self.written >= sequence:
            return True
        serving_on = self.failure_policy == "serve" and not self.fenced
        if self.stopped:
            return serving_on
        return True if serving_on and self.failure is not None else None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until what was queued before this call is written; False if it was not within `timeout` seconds
        (or never will be)."""
        with self._lock:
            flush = _Flush(self._queued)
        self._entries.put(flush)
        flush.done.wait(timeout)
        return self.written >= flush.sequence

    def health(self) -> tuple[str, str] | None:
        """("journal_failed", why): it cannot write, and takes nothing more (or another controller took it over);
        ("degraded", why): it cannot write, and serving goes on without it; None: it writes."""
        if self.failure is None:
            return None
        if self.fenced or self.failure_policy == "stop":
            return "journal_failed", self.failure
        return "degraded", self.failure

    def status(self) -> dict[str, Any]:
        """What `GET /v1/status` says of the journal."""
        state = "fenced" if self.fenced else "failed" if self.failure else "closed" if self.stopped else "writing"
        return {"url": self.url, "state": state, "failure": self.failure, "failed_writes": self.failed_writes,
                "lost_entries": self.lost, "on_failure": self.failure_policy, "epoch": self.lease.record.epoch,
                "lease_seconds": self.lease.seconds, "requests_held": len(self.held.requests)}

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (one more try if the store fails; waiting up to `timeout` seconds), release the
        lease, then close the store. Closing twice is harmless."""
        if self.store.closed:
            return
        self._entries.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the journal's writer did not finish within %.0f s", timeout)
            return
        if not self.fenced:
            try:
                self.lease.release()
            except Exception as error:  # a successor waits for it to lapse instead
                log.warning("the journal at %s could not release its lease: %s", self.url, error)
        self.store.close()

    # ---- the writer thread -------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        pending: list[tuple[str, Any, int]] = []  # entries not yet written, in order
        flushes: list[_Flush] = []
        closing = False
        while not closing:
            closing = self._gather(pending, flushes)
            if self.stopped:
                pending.clear()
            elif (closing or self.failure is None or time.monotonic() >= self._retry_at) and self._keep_lease() \
                    and pending:  # the lease is renewed when due, entries or none
                self._write(pending)
            self._waiting.tell()
            for flush in [flush for flush in flushes if self.written >= flush.sequence or self.stopped or closing]:
                flush.done.set()
                flushes.remove(flush)
            self._remove_before_snapshot()
        self.stopped = True
        self._waiting.tell()

    def _gather(self, pending: list[tuple[str, Any, int]], flushes: list[_Flush]) -> bool:
        """Take what is queued into `pending` (waiting until an entry comes, or the lease's renewal or a retry is
        due, and then up to `interval` seconds for more); whether the journal closes."""
        if self.stopped:  # nothing to renew nor to try again: only entries to drop, and the close
            due = None
        else:
            due = max(0.001, self._retry_at - time.monotonic() if self.failure is not None else self.lease.due())
        try:
            entry = self._entries.get(timeout=due)
        except queue.Empty:
            return False
        deadline = time.monotonic() + self.interval
        while True:
            if entry is None:
                return True
            if isinstance(entry, _Flush):
                flushes.append(entry)
                return False
            pending.append(entry)
            if time.monotonic() >= deadline:
                return False
            try:  # what is queued now, without waiting for more: a token waits for its record
                entry = self._entries.get_nowait()
            except queue.Empty:
                return False

    def _keep_lease(self) -> bool:
        """Renew the lease when it is due or no longer valid (what was written meanwhile counts as written once
        it is renewed); whether it is valid now."""
        if self.lease.due() == 0 or not self.lease.valid():
            try:
                renewed = self.lease.renew()
            except Exception as error:
                self._failed(error, "renew its lease")
                return False
            if not renewed:
                self._fence()
                return False
        with self._lock:
            self.written = self._committed
        return True

    def _write(self, pending: list[tuple[str, Any, int]]) -> None:
        """Write `pending` as one record (emptied once written)."""
        record: dict[str, list[Any]] = {}
        for kind, entry, _ in pending:
            record.setdefault(kind, []).append(entry)
        try:
            written = json.dumps(record).encode()
        except (TypeError, ValueError) as error:  # an entry no journal can hold: trying again cannot help
            self.failure = f"the journal at {self.url} cannot hold an entry: {error}"
            self.stopped = True
            log.error("%s; it writes no more", self.failure)
            return
        try:
            self.store.put_progress(ProgressKey(JOURNAL_STREAM, self.run, self._log, self._step), written)
        except Exception as error:
            self._failed(error, "write")
            if self.failure_policy == "serve" and len(pending) > MAX_PENDING:
                self.lost += len(pending)
                log.error("the journal at %s dropped %d entries it could not write: a successor does not know "
                          "what they said", self.url, len(pending))
                pending.clear()
            return
        if self.failure is not None:
            log.warning("the journal at %s writes again (%d writes failed before)", self.url, self.failed_writes)
            self.failure = None
        self._step += 1
        self._committed = pending[-1][2]
        pending.clear()
        self.held.apply(record)
        self._keep_lease()  # a record written after the lease's time counts once it is renewed
        self.held.forget_answered(time.time() - self.keep_finished)
        self._since_snapshot += len(written)
        if self._since_snapshot > max(self.compact_bytes, 2 * self._snapshot_bytes):
            self._snapshot()

    def _failed(self, error: BaseException, doing: str) -> None:
        """A write (or renewal) failed: say why, count it, and try again in RETRY seconds."""
        self.failed_writes += 1
        if self.on_failed_write is not None:
            self.on_failed_write()
        first = self.failure is None
        self.failure = f"the journal at {self.url} cannot {doing}: {type(error).__name__}: {error}"
        self._retry_at = time.monotonic() + RETRY
        if first:
            log.error("%s; %s (it tries again every %.0f s)", self.failure, "new requests are refused and tokens "
                      "held back until it can" if self.failure_policy == "stop" else "serving goes on without it",
                      RETRY)

    def _fence(self) -> None:
        """Another controller took the journal over: write no more, and tell every waiter so."""
        taken = self.lease.taken
        assert taken is not None
        self.fenced = self.stopped = True
        self.failure = (f"another controller ({taken.holder}) took the journal at {self.url} over (epoch "
                        f"{taken.epoch}): this one writes it no more")
        log.error("%s; new requests are refused", self.failure)

    def _snapshot(self) -> None:
        """Write what the journal holds as step 0 of a new log, then remove every record before it."""
        self.held.forget_answered(time.time() - self.keep_finished)
        self.held.prune()
        snapshot = self.held.snapshot()
        key = ProgressKey(JOURNAL_STREAM, self.run, self._log + 1, 0)
        # the next records go after it, written or not: readers start at it if it was, else at the one before
        self._log, self._step = key.log, 1
        self._since_snapshot, self._snapshot_bytes = 0, len(snapshot)
        try:
            self.store.put_progress(key, snapshot)
        except Exception as error:  # the records before it stay, and so does what they say
            self.failed_writes += 1
            if self.on_failed_write is not None:
                self.on_failed_write()
            log.warning("the journal at %s could not write a snapshot (its records stay): %s", self.url, error)
            return
        self._removable = key

    def _remove_before_snapshot(self) -> None:
        """Remove every record before the last snapshot (once the entries it followed are released)."""
        key, self._removable = self._removable, None
        if key is None:
            return
        try:
            remove_before(self.store, key)
        except Exception as error:  # left for the next snapshot: readers start at this one
            log.warning("the journal at %s could not remove the records before its snapshot: %s", self.url, error)


def read_journal(url: str | Store) -> dict[str, JournaledRequest]:
    """Every request the journal at `url` holds, in the order they were admitted, by id."""
    return JournalState.fold(read_records(url)).requests
