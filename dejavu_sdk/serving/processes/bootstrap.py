"""A stage worker's process: join the head, take a stage (or wait as a warm spare), load it, open its links,
beat, run it, and close.

Launchers start `python -m dejavu_sdk.serving.processes.bootstrap --join URL --worker-id ID` (`main`); `dejavu worker
--join URL` on any machine calls `run_worker` too. The worker sends its id in `Join` (`worker`: the
launcher's, which the head keys spares by, or None for a worker started by hand) with its process id (`pid`).
The head then sends `Assign` (the stage: `StageWorker` runs it until `Shutdown`), `Standby` (load the model
now, answer `Warm`, and wait for an `Assign`) or `Shutdown`. The token of the head's servers comes from
`DEJAVU_TOKEN`.

A worker whose head is gone (its heartbeats unanswered, or a message to it not sent: `HeadGone`) is an orphan: it
keeps its stage loaded and sends `Rejoin` to the head's address every REJOIN_EVERY seconds, for the orphan
timeout; a successor there answers with an assignment (the same stage, in a later epoch) or `Shutdown`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ...backends import open_transport, serve
from ...blocks import KVSpec
from ...errors import DejaVuError, ServerBusy, TransportError
from ...generation.stage import Stage
from ...models import load_model
from ...prefix.keys import PrefixIdentity
from ...prefix.reuse import PrefixReuse, kv_spec_of
from ...transports.access import TOKEN_VARIABLE
from ...transports.base import Server, Transport
from ..wire.link_tls import LinkTls, inbox_options, link_options
from ..wire.messages import Assign, Fenced, Join, Message, Ready, Rejoin, Shutdown, Standby, Warm, pack, unpack
from ..wire.messages import Heartbeat as Beat
from ..worker.stage import QUIET, StageWorker, failure_message
from ..worker.state import HeadGone, Holdings, Role, open_links
from ..worker.thread_share import ThreadShare

#: Seconds a worker waits for its assignment after joining.
ASSIGN_TIMEOUT = 120.0
#: Seconds a worker keeps trying to reach a head that is not listening yet.
JOIN_TIMEOUT = 120.0
#: Seconds a worker's heartbeats may go unanswered (a head busy on a loaded machine, or stopped) before the worker
#: counts its head gone; a head whose process is gone (its address refuses) is counted gone at once.
HEAD_SILENCE = 10.0
#: Seconds between an orphan's tries to rejoin the head at its address.
REJOIN_EVERY = 0.5
#: The transports whose head an orphan can rejoin: a new head at the same address takes a new connection.
REJOINABLE = ("tcp",)

log = logging.getLogger(__name__)


class Heartbeat:
    """Sends `heartbeat` to the head every `interval` seconds from a thread and a link of its own, however busy
    the stage is (a stopped or hung process sends none: the head counts it dead after a few missed), with the
    worker's epoch and inbox (a worker replaced meanwhile is told there to exit) and the layers its stage has
    run so far (`work`): a stage deep in a long prompt is computing, not stuck. Each waits for the head's
    inbox to take it, at most `timeout` seconds: a head whose address refuses, or that has taken none for
    HEAD_SILENCE seconds (at least `timeout`), is kept as `error` for the worker's loop to raise."""

    def __init__(self, head: str, stage: str, interval: float, timeout: float,
                 epoch: Callable[[], int] = lambda: 0, url: str | None = None,
                 work: Callable[[], int] = lambda: 0) -> None:
        self.stage, self.interval, self.timeout, self.epoch, self.url = stage, interval, timeout, epoch, url
        self.work = work
        self.head = open_transport(head, timeout=timeout, **link_options(LinkTls.from_environment()))
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dejavu-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        answered = time.monotonic()  # when the head last answered one (taken, or refused as busy)
        while not self._stop.wait(self.interval):
            error = self._beat()
            if error is None:
                answered = time.monotonic()
                continue
            gone = isinstance(error.__cause__, (ConnectionRefusedError, ConnectionResetError, BrokenPipeError))
            if gone or not isinstance(error, TransportError) \
                    or time.monotonic() - answered >= max(self.timeout, HEAD_SILENCE):
                self.error = error  # the head's process is gone, or it has answered nothing for that long
                return

    def _beat(self) -> BaseException | None:
        """Send one heartbeat; what kept the head from answering it (None: it answered)."""
        try:
            self.head.send_tensor(pack(Beat(stage=self.stage, epoch=self.epoch(), url=self.url, work=self.work())))
        except ServerBusy:  # a full inbox: the head is there, and behind
            return None
        except Exception as error:
            return error
        return None

    def check(self) -> None:
        if self.error is not None:
            raise HeadGone(f"the head no longer takes heartbeats: {self.error}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.head.close()


def run_worker(join: str, host: str = "127.0.0.1", threads: int | None = None, worker_id: str | None = None,
               orphan_timeout: float | None = None) -> None:
    """Join the head at `join` (a transport URL such as tcp://host:port) as `worker_id` (the launcher's, or
    None), serve the stage it assigns, and return once it says `shutdown`. `threads`: torch threads (default:
    the head's choice). A head that is gone leaves the worker an orphan: it keeps its stage loaded and asks the
    head now at `join` (a successor at the same address) to take it back, for `orphan_timeout` seconds (default:
    the head's choice, `PipelineOptions.orphan_timeout`; over tcp), then returns."""
    token = os.environ.get(TOKEN_VARIABLE) or None
    scheme = join.partition("://")[0]
    tls = LinkTls.from_environment()
    with serve(f"{scheme}://{host}:0", token=token, **inbox_options(tls)) as inbox, \
            open_transport(join, **link_options(tls)) as head:
        _join(head, Join(url=inbox.url, pid=os.getpid(), worker=worker_id))
        answer = unpack(inbox.recv_tensor(timeout=ASSIGN_TIMEOUT))
        model = None
        if isinstance(answer, Standby):  # load the model now, and wait (beating) until a stage needs this worker
            torch.set_num_threads(threads if threads is not None else answer.threads)
            model = load_model(answer.model)
            head.send_tensor(pack(Warm(url=inbox.url)))
            answer = _wait_for_assignment(inbox, head)
        stage: Stage | None = None
        identity: tuple[PrefixIdentity, KVSpec] | None = None  # of the whole model, for its prompt prefixes
        held: Holdings | None = None  # an orphan's slots, for the head that takes it back
        while not isinstance(answer, Shutdown):
            if not isinstance(answer, Assign):
                raise TransportError(f"the head sent {answer.kind!r} where an assignment was due")
            assign = answer
            torch.set_num_threads(threads if threads is not None else assign.threads)  # the worker's own first
            layers = assign.links.layers
            if stage is None or stage.layers != layers:  # a rejoined worker keeps its stage loaded
                try:
                    whole = model if model is not None else load_model(assign.model)
                    if assign.prefix_cache:  # named before the stage drops the other layers' weights
                        identity = PrefixIdentity.of(whole, assign.prefix_chunk), kv_spec_of(whole)
                    stage = Stage(whole, layers)
                except Exception as error:  # whatever stops the stage from loading, the head must hear of it
                    head.send_tensor(failure_message(assign.stage, error, assign.epoch))
                    raise
                model = None  # the stage took it over
            try:
                _serve_stage(stage, assign, inbox, join, held, own_threads=threads is not None, identity=identity)
                return
            except HeadGone as gone:
                held = gone.held
                timeout = orphan_timeout if orphan_timeout is not None else assign.orphan_timeout
                if scheme not in REJOINABLE or timeout <= 0:
                    log.warning("%s: %s: stopping", assign.stage, gone)
                    return
                log.warning("%s: %s; asking the head at %s to take the stage back for up to %.0f s", assign.stage,
                            gone, join, timeout)
                rejoin = Rejoin(url=inbox.url, pid=os.getpid(), worker=worker_id, stage=assign.stage,
                                layers=list(stage.layers), model=assign.model, epoch=gone.epoch)
                taken = _rejoin(head, inbox, rejoin, timeout)
                if taken is None:
                    log.warning("%s: no head took the stage back within %.0f s: stopping", assign.stage, timeout)
                    return
                answer = taken  # the replicas it holds for a neighbour stay: the head takes them over, or drops them


def _serve_stage(stage: Stage, assign: Assign, inbox: Server, join: str, held: Holdings | None = None,
                 own_threads: bool = False, identity: tuple[PrefixIdentity, KVSpec] | None = None) -> None:
    """Be the stage `assign` describes until the head at `join` says `Shutdown` (HeadGone: the head is gone, with
    what the worker keeps for a successor), on links of its own (what was posted on a former head's is lost with
    it); `held`: the microbatches it kept under a former head, for this one to take over if it says so
    (`take_over`; else they are dropped, with the replicas held here for a neighbour). Its torch threads follow
    the cores the other processes leave idle (`ThreadShare`), up to `assign.most_threads`, unless the worker was
    given its own (`own_threads`). With `assign.prefix_cache`, it reads and keeps its layers' prompt prefixes in
    those tiers, under the whole model's `identity` (and KV geometry)."""
    role = Role(assign.role, assign.number, assign.stages, assign.stage)
    prefixes = PrefixReuse(*identity, list(assign.prefix_cache), stage.layers) \
        if identity is not None and assign.prefix_cache and identity[0].chunk == assign.prefix_chunk else None
    head = open_transport(join, **link_options(LinkTls.from_environment()))
    worker: StageWorker | None = None
    heartbeat: Heartbeat | None = None
    try:
        following, first, sender, replicator = open_links(assign.links, role)
        worker = StageWorker(stage, role, inbox, head, following, first, assign.eos, assign.pad, sender,
                             assign.swapping, None, replicator, assign.recovery, assign.epoch,
                             assign.links.replica_prefix, assign.batching, assign.max_prefill_tokens)
        if held is not None and assign.take_over:  # else dropped with it
            worker.slots, worker.caches = held.slots, held.caches
        elif not assign.take_over:  # a head that takes nothing over: what was replicated here for a neighbour
            for stream in {key.stream_id for key in inbox.store.keys(stream_id=None)}:
                inbox.store.delete(stream)
        serving = worker
        serving.tell_head(pack(Ready(stage=assign.stage, epoch=serving.epoch)))
        interval = assign.heartbeat
        serving.heartbeat = heartbeat = Heartbeat(join, role.name, interval, interval * assign.missed_beats,
                                              lambda: serving.epoch, inbox.url, lambda: stage.layers_run)
        if not own_threads and assign.most_threads > assign.threads:
            serving.thread_share = ThreadShare(assign.most_threads)
        serving.prefixes = prefixes
        serving.run()
    except HeadGone as gone:
        gone.epoch = worker.epoch if worker is not None else assign.epoch  # raised by recoveries
        if worker is not None:
            gone.held = Holdings(worker.slots, worker.caches)
        raise
    finally:
        if heartbeat is not None:
            heartbeat.close()
        if prefixes is not None:
            prefixes.close()  # chunks asked to be written land first
        # links to a head or neighbour that is gone may fail to close (what was posted on them is lost anyway):
        # that must not replace why the stage ended (a head gone leaves an orphan, not a failed worker)
        with contextlib.suppress(TransportError):
            if worker is not None:
                worker.close()
        with contextlib.suppress(TransportError):
            head.close()


def _rejoin(head: Transport, inbox: Server, rejoin: Rejoin, timeout: float) -> Assign | Shutdown | None:
    """An orphan's wait: send `rejoin` to the head's address every REJOIN_EVERY seconds until a head takes it
    (then wait for its answer: an assignment, or shutdown) or `timeout` seconds pass (None). What the inbox
    gets meanwhile from the old pipeline (steps its neighbours sent before they noticed) is dropped."""
    deadline = time.monotonic() + timeout
    with open_transport(head.url, timeout=REJOIN_EVERY * 4, **link_options(LinkTls.from_environment())) as link:
        return _rejoin_through(link, inbox, rejoin, deadline)


def _rejoin_through(link: Transport, inbox: Server, rejoin: Rejoin, deadline: float) -> Assign | Shutdown | None:
    while True:
        try:
            link.send_tensor(pack(rejoin))
            answer_by = time.monotonic() + ASSIGN_TIMEOUT  # taken: the head assigns once every stage is there
        except TransportError:
            answer_by = min(time.monotonic() + REJOIN_EVERY, deadline)
        while (remaining := answer_by - time.monotonic()) > 0:
            try:
                message = unpack(inbox.recv_tensor(timeout=remaining))
            except TransportError:  # a quiet inbox
                continue
            if isinstance(message, (Assign, Shutdown)):
                return message
            if isinstance(message, Fenced):
                return None
        if time.monotonic() >= deadline:
            return None


def _join(head: Transport, join: Join) -> None:
    """Send `join`, retrying while the head is not listening yet (workers may start before it)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while True:
        try:
            head.send_tensor(pack(join))
            return
        except TransportError:  # noqa: PERF203 - refused: the head is not listening yet, so try again
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _wait_for_assignment(inbox: Server, head: Transport) -> Message:
    """A standby's wait: the head's next message (an assignment, or shutdown); a head gone ends it."""
    while True:
        try:
            return unpack(inbox.recv_tensor(timeout=QUIET))
        except TransportError:  # noqa: PERF203 - a quiet inbox: is the head still there?
            head.send_tensor(pack(Beat(stage="standby")))


def main(argv: Sequence[str] | None = None) -> int:
    """Run a worker from its command line (as launchers start it); its exit status as `dejavu worker`'s: 0 once
    the head says `shutdown`, 2 on a `DejaVuError` (a head gone, a bad assignment). It ignores SIGINT and
    SIGTERM: its head stops it."""
    parser = argparse.ArgumentParser(prog="python -m dejavu_sdk.serving.processes.bootstrap",
                                     description="a stage worker: join a pipeline's head and serve the stage it "
                                     "assigns (the token comes from DEJAVU_TOKEN)")
    parser.add_argument("--join", required=True, help="the head's URL, tcp://host:port")
    parser.add_argument("--worker-id", help="the id its launcher gave it, sent to the head when it joins")
    parser.add_argument("--host", default="127.0.0.1", help="the address it listens on for its neighbours")
    parser.add_argument("--threads", type=int, help="torch threads for its stage (default: the head's choice)")
    parser.add_argument("--orphan-timeout", type=float, help="seconds it keeps its stage and asks a successor at "
                        "the head's address to take it back, once the head is gone (default: the head's choice)")
    args = parser.parse_args(argv)
    # a launched worker is its head's to stop (`shutdown`), and stops on its own once the head is gone: Ctrl-C at
    # the head's terminal, or a service manager's stop sent to every process of the service, reach the head,
    # which drains, rather than end the stages under it
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        run_worker(args.join, host=args.host, threads=args.threads, worker_id=args.worker_id,
                   orphan_timeout=args.orphan_timeout)
    except DejaVuError as error:
        print(f"dejavu: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
