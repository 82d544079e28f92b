"""The pipeline's recoveries, run one at a time, each on a thread of its own (`Recoveries`): a recovery
(`recovery.Recovery`) replaces the dead stages, and the ledger resumes what was in flight from where the recovery
left it; a failure reported meanwhile is looked at once it ends, and one that cannot be mended fails the requests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import TransportError
from ...generation.batching import Request
from ..kv.replication import remove_replicas
from ..wire.messages import Message, MicrobatchMessage
from .fleet import Fleet
from .ledger import Ledger, Outcome, answer
from .recovery import ATTEMPTS, Recovery, RecoveryReport, RecoveryRetry
from .takeover import Takeover, TakeoverReport

log = logging.getLogger(__name__)


class Recoveries:
    """Runs the pipeline's recoveries, one at a time, each on a thread of its own (the head's receiver keeps
    taking the stages' answers meanwhile, and hands them over as `replies`), and keeps their `reports`.

    A recovery holds the ledger (nothing new starts), replaces the dead stages (up to ATTEMPTS times, as more
    die meanwhile), and resumes the ledger's microbatches; or fails every request (`fail`), never staying held.
    A failure reported while one runs is looked at again once it ends. `send(index, message)` sends a step's
    message, `admit()` lets new work in, `closed()` says whether the pipeline was closed; `notify_failure` and
    `notify_recovery` pass each failure's description and each report to the user's callbacks."""

    def __init__(self, ledger: Ledger, fleet: Fleet, replies: queue.SimpleQueue[Message],
                 fail: Callable[[TransportError], None], send: Callable[[int, Message], None],
                 admit: Callable[[], None], closed: Callable[[], bool], notify_failure: Callable[[str], None],
                 notify_recovery: Callable[[RecoveryReport], None], eos: list[int], pad: int) -> None:
        self.ledger, self.fleet, self.replies = ledger, fleet, replies
        self.fail, self.send, self.admit, self.closed = fail, send, admit, closed
        self.notify_failure, self.notify_recovery = notify_failure, notify_recovery
        self.assignment = lambda index: fleet.assignment(index, eos, pad, True)
        self.reports: list[RecoveryReport] = []
        self.thread: threading.Thread | None = None
        #: A successor head is taking over its predecessor's stages (`Pipeline.take_over`): a failure waits for it,
        #: as for a recovery under way.
        self.taking_over = False
        #: A failure reported during a recovery (or a takeover), with the epoch it was seen in, to look at after it.
        self._meanwhile: tuple[str, int | None] | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None or self.taking_over

    def take_over(self, groups: Mapping[int, Sequence[tuple[Sequence[int], Sequence[Any]]]],
                  stand_in: Callable[[Any], Request | None], carry_out: Callable[[Outcome], None]) -> TakeoverReport:
        """`Pipeline.take_over`: go on with what the rejoined workers hold, then let requests start; `carry_out`
        carries out the ledger's outcomes."""
        ledger, options = self.ledger, self.fleet.options
        with ledger.lock:  # the numbers its predecessor gave are not given again
            ledger.renumber_from(max([*groups, -1]) + 1)
        report = TakeoverReport()
        try:
            if self.fleet.rejoined and self.taking_over:
                steps = Recovery(ledger, self.fleet, self.replies, set(), "taking over", time.monotonic(),
                                 self.assignment, self.closed)
                report = Takeover(ledger, steps, groups, stand_in).run()
            resilience = options.resilience
            if resilience.replica_store is not None:  # the predecessor's replicas of what did not go on
                kept = set(report.resumed)
                remove_replicas(resilience.replica_store, lambda number: number not in kept, resilience.replica_prefix)
            carry_out(report.outcome)
            carry_out(ledger.resumes.resume_slots(report.resumed, {}))
        finally:
            self.fleet.taking_over = False
            self._end_takeover(report.failure)
        self.admit()
        return report

    def _end_takeover(self, failure: str | None) -> None:
        """The takeover ended (`failure`: what stopped it, if anything): what was reported meanwhile, or that
        failure, starts a recovery now."""
        with self.ledger.lock:
            self.taking_over = False
            pending, self._meanwhile = self._meanwhile, None
        reason = failure if failure is not None else None if pending is None else pending[0]
        if reason is not None:
            self.start(set(), reason)

    def start(self, dead: set[int], reason: str, epoch: int | None = None) -> None:
        """Recover from the `dead` stages (and whatever else is found dead) for `reason`, which a stage reported in
        `epoch` (None: the head found it now)."""
        with self.ledger.lock:
            if self.thread is not None or self.taking_over:
                self._meanwhile = self._meanwhile or (reason, epoch)
                return
            if self.ledger.failure is not None or self.closed():
                return
            self.ledger.held = True
            self.thread = threading.Thread(target=self._run, args=(dead, reason), name="dejavu-pipeline-recovery",
                                           daemon=True)
            self.thread.start()  # started as it is set: whoever sees it may join it
        log.warning("recovering: %s", reason)
        self.notify_failure(reason)

    def join(self, timeout: float) -> None:
        thread = self.thread
        if thread is not None:  # it sees the pipeline closed (its waits are bounded), so no spare is left
            thread.join(timeout=timeout)

    def _run(self, dead: set[int], reason: str) -> None:
        again: str | None = None
        recovered = -1  # the epoch of the recovery that succeeded: failures seen before it are mended
        try:
            report = self._attempts(dead, reason)
            if report is None:
                return
            recovered = report.epoch
            outcome = self.ledger.resumes.resume_slots(report.resumed, report.recomputed)
            answer(outcome.answers)
            try:
                for index, message in outcome.sends:
                    # the poison bound counts a microbatch resumed once its message is on its way: a stage it kills
                    # on arrival may break the send itself
                    if isinstance(message, MicrobatchMessage):
                        self.ledger.seen_by_recovery(message.microbatch)
                    self.send(index, message)
            except TransportError as lost:  # a stage died as the pipeline went on: recover again
                again = f"resuming after a recovery failed: {lost}"
            self.notify_recovery(report)
            if not self.closed():
                self.fleet.top_up()
        except Exception as error:  # whatever else stops a recovery fails the requests, rather than hang them
            self.fail(TransportError(f"recovery failed: {type(error).__name__}: {error}"))
        finally:
            with self.ledger.lock:
                self.thread = None
                if again is None and self._meanwhile is not None:
                    reported, epoch = self._meanwhile
                    again = None if epoch is not None and epoch < recovered else reported
                self._meanwhile = None
        if again is not None:
            self.start(set(), again)
        self.admit()

    def _attempts(self, dead: set[int], reason: str) -> RecoveryReport | None:
        error: Exception | None = None
        detected = time.monotonic()
        for _ in range(ATTEMPTS):
            while not self.replies.empty():  # answers to an earlier attempt are of no use to this one
                self.replies.get_nowait()
            try:
                report = Recovery(self.ledger, self.fleet, self.replies, dead, reason, detected, self.assignment,
                                  self.closed).run()
            except RecoveryRetry as retry:  # another stage died meanwhile: replace it too
                dead |= {self.fleet.layout.index_of(name) for name in retry.stages}
                reason, error = f"{reason}; then {retry}", retry
                continue
            self.reports.append(report)
            return report
        self.fail(TransportError(f"recovery failed after {ATTEMPTS} attempts: {error}"))
        return None
