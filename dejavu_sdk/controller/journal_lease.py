"""One writer per journal: a lease, with an epoch, kept in the journal's own store.

Stores have no compare-and-swap, so the lease is last-writer-wins with verification. Each holder writes its own
record (`LEASE_STREAM`, its run id, its epoch) and renews it every quarter of the lease (`renew`); after every
write it reads every lease record back, and a holder that finds a later epoch has been taken over: it is fenced,
and writes no more. A controller that opens a journal (`acquire`) takes the epoch after every one written so far,
and only once the last holder is gone: it released its lease (closed), or did not renew it while this one
watched (the lease's time, less what the record's age already shows, at least half of it), or `take_over` says
to go ahead. Two that start together both write, both read back, and the one that sees the other steps back (both
may). A holder writes journal records only within 0.45 leases of the start of its last renewal, or after a
renewal that found no later epoch: a successor reads the journal at least half a lease after the last renewal it
saw, or after its own lease record is written, so it sees every record the holder counted as written.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

import attrs

from ..blocks import ProgressKey
from ..errors import BlockNotFound, CorruptBlock, JournalInUse
from ..store import Store
from .limits import JOURNAL_LEASE

log = logging.getLogger(__name__)

#: The stream id of the lease records, beside the journal's own (a store token for the prefix "dejavu-journal"
#: reaches both).
LEASE_STREAM = "dejavu-journal-lease"
#: Seconds a lease lasts unless renewed (`journal_lease`).
LEASE_SECONDS = JOURNAL_LEASE
#: A holder renews every RENEW of a lease, and writes records within VALID of one from the start of its last
#: renewal; a successor watches a lease for at least WATCH of it.
RENEW, VALID, WATCH = 0.25, 0.45, 0.5


@attrs.frozen
class LeaseRecord:
    """One controller's lease: its journal run id, epoch, renewals so far and when the last one was written
    (seconds since the epoch, its clock), how long it lasts, whether it was released, and who holds it."""

    run: str
    epoch: int
    renewals: int = 0
    at: float = 0.0
    seconds: float = LEASE_SECONDS
    released: bool = False
    holder: str = ""

    def key(self) -> ProgressKey:
        return ProgressKey(LEASE_STREAM, self.run, self.epoch, 0)


def read_leases(store: Store) -> list[LeaseRecord]:
    """Every lease record the store holds (one a damaged or half-removed record leaves out)."""
    leases = []
    for key in store.progress_keys(LEASE_STREAM):
        try:
            fields = json.loads(store.read_progress(key))
        except (BlockNotFound, CorruptBlock, ValueError):  # removed meanwhile, or torn: no lease of anyone's
            continue
        leases.append(LeaseRecord(**fields))
    return leases


class Lease:
    """A controller's lease on the journal in `store`, taken by `acquire` (JournalInUse: another holds it)."""

    def __init__(self, store: Store, seconds: float = LEASE_SECONDS) -> None:
        self.store, self.seconds = store, seconds
        self.record = LeaseRecord("", 0, seconds=seconds, holder=f"pid {os.getpid()} on {socket.gethostname()}")
        self.renewed_at = 0.0  # time.monotonic() at the start of the last renewal that found no later epoch
        self.taken: LeaseRecord | None = None  # the lease of the controller that took the journal over
        self.waited = 0.0  # seconds `acquire` watched a former holder's lease

    def acquire(self, run: str, take_over: bool = False) -> None:
        """Take the lease for the journal's run `run`, in the epoch after every one written; JournalInUse if another
        controller holds it (its lease was renewed while this one watched, or it took the lease meanwhile)."""
        leases = read_leases(self.store)
        epoch = max((lease.epoch for lease in leases), default=0) + 1
        holders = [lease for lease in leases if lease.epoch == epoch - 1 and not lease.released]
        if holders and not take_over:
            self._watch(holders)
        self.record = attrs.evolve(self.record, run=run, epoch=epoch)
        began = time.monotonic()
        self._write()
        rivals = [lease for lease in read_leases(self.store)
                  if lease.run != self.record.run and lease.epoch >= epoch and not lease.released]
        if rivals:
            self.release()
            raise JournalInUse(f"another controller ({rivals[0].holder}) took this journal's lease at the same "
                               "time: start again once one of them serves")
        self.renewed_at = began
        for lease in leases:  # the former holders': none writes again without finding this epoch
            self.store.remove_progress(LEASE_STREAM, lease.run)

    def _watch(self, holders: list[LeaseRecord]) -> None:
        """Raise JournalInUse if a lease of `holders` is renewed (or another is taken) within its time, less the
        age its record shows, and at least half of it."""
        began = time.monotonic()
        seconds = max(holder.seconds for holder in holders)
        age = max(0.0, time.time() - max(holder.at for holder in holders))
        deadline = began + min(seconds, max(WATCH * seconds, seconds - age))
        seen = {holder.run: holder.renewals for holder in holders}
        while time.monotonic() < deadline:
            time.sleep(min(0.1, seconds / 20))
            leases = read_leases(self.store)
            for lease in leases:
                if not lease.released and lease.epoch >= holders[0].epoch and seen.get(lease.run, -1) != lease.renewals:
                    raise JournalInUse(
                        f"another controller ({lease.holder}) serves from this journal: its lease (epoch "
                        f"{lease.epoch}) was renewed {max(0.0, time.time() - lease.at):.1f} s ago; stop it first, or "
                        "pass --take-over-journal (take_over_journal=True) if it is gone for good")
            if all(lease.released for lease in leases if lease.run in seen):  # it closed meanwhile
                break
        self.waited = time.monotonic() - began
        log.warning("the journal's lease (epoch %d, %s) was not renewed for %.1f s: taking the journal over",
                    holders[0].epoch, holders[0].holder, self.waited)

    def renew(self) -> bool:
        """Write the lease again and read every lease back; False (fenced, for good) if another controller took
        the journal over. A StoreError goes to the caller."""
        if self.taken is not None:
            return False
        began = time.monotonic()
        self.record = attrs.evolve(self.record, renewals=self.record.renewals + 1)
        self._write()
        later = [lease for lease in read_leases(self.store) if lease.epoch > self.record.epoch and not lease.released]
        if later:
            self.taken = later[0]
            return False
        self.renewed_at = began
        return True

    def due(self) -> float:
        """Seconds until the next renewal (0: now)."""
        return max(0.0, self.renewed_at + RENEW * self.seconds - time.monotonic())

    def valid(self) -> bool:
        """Whether a record written now is one a successor sees (the last renewal was recent enough)."""
        return self.taken is None and time.monotonic() < self.renewed_at + VALID * self.seconds

    def release(self) -> None:
        """Say that this controller writes no more: a successor takes the journal at once."""
        self.record = attrs.evolve(self.record, released=True)
        self._write()

    def _write(self) -> None:
        self.record = attrs.evolve(self.record, at=time.time())
        self.store.put_progress(self.record.key(), json.dumps(attrs.asdict(self.record)).encode())
