"""A stage worker's process: join the head, take a stage (or wait as a warm spare), load it, open its links,
beat, run it, and close.

Launchers start `python -m dejavu_sdk.serving.bootstrap --join URL --worker-id ID` (`main`); `dejavu worker
--join URL` on any machine calls `run_worker` too. The worker sends its id in `join` (`worker`: the
launcher's, which the head keys spares by, or None for a worker started by hand) with its process id (`pid`).
The head then sends `assign` (the stage: `StageWorker` runs it until `shutdown`), `standby` (load the model
now, answer `warm`, and wait for an `assign`) or `shutdown`. The token of the head's servers comes from
`DEJAVU_TOKEN`.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ..backends import open_transport, serve
from ..errors import DejaVuError, TransportError
from ..generation.stage import Stage
from ..models import load_model
from ..transports.access import TOKEN_VARIABLE
from ..transports.base import Server, Transport
from .link_tls import LinkTls, inbox_options, link_options
from .messages import Kind, Message, pack, unpack
from .worker import QUIET, StageWorker, failure_message
from .worker_state import HeadGone, Role, open_links

#: Seconds a worker waits for its assignment after joining.
ASSIGN_TIMEOUT = 120.0
#: Seconds a worker keeps trying to reach a head that is not listening yet.
JOIN_TIMEOUT = 120.0


class Heartbeat:
    """Posts `heartbeat` to the head every `interval` seconds from a thread of its own, however busy the stage
    is (a stopped or hung process sends none: the head counts it dead after a few missed), with the worker's
    epoch and inbox (a worker replaced meanwhile is told there to exit). A head that no longer takes them is kept
    as `error` for the worker's loop to raise."""

    def __init__(self, head: Transport, stage: str, interval: float, epoch: Callable[[], int] = lambda: 0,
                 url: str | None = None) -> None:
        self.head, self.stage, self.interval, self.epoch, self.url = head, stage, interval, epoch, url
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dejavu-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.head.post_tensor(pack(Message(Kind.HEARTBEAT, {"stage": self.stage, "epoch": self.epoch(),
                                                                     "url": self.url})))
        except Exception as error:  # the head is gone: the worker stops
            self.error = error

    def check(self) -> None:
        if self.error is not None:
            raise HeadGone(f"the head no longer takes heartbeats: {self.error}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def run_worker(join: str, host: str = "127.0.0.1", threads: int | None = None, worker_id: str | None = None) -> None:
    """Join the head at `join` (a transport URL such as tcp://host:port) as `worker_id` (the launcher's, or
    None), serve the stage it assigns, and return once it says `shutdown`. `threads`: torch threads (default:
    the head's choice)."""
    token = os.environ.get(TOKEN_VARIABLE) or None
    scheme = join.partition("://")[0]
    tls = LinkTls.from_environment()
    with serve(f"{scheme}://{host}:0", token=token, **inbox_options(tls)) as inbox, \
            open_transport(join, **link_options(tls)) as head:
        _join(head, Message(Kind.JOIN, {"url": inbox.url, "pid": os.getpid(), "worker": worker_id}))
        assign = unpack(inbox.recv_tensor(timeout=ASSIGN_TIMEOUT))
        model = None
        if assign.kind == Kind.STANDBY:  # load the model now, and wait (beating) until a stage needs this worker
            torch.set_num_threads(threads if threads is not None else assign.fields["threads"])
            model = load_model(assign.fields["model"])
            head.send_tensor(pack(Message(Kind.WARM, {"url": inbox.url})))
            assign = _wait_for_assignment(inbox, head)
        if assign.kind == Kind.SHUTDOWN:
            return
        if assign.kind != "assign":
            raise TransportError(f"the head sent {assign.kind!r} where an assignment was due")
        fields = assign.fields
        torch.set_num_threads(threads if threads is not None else fields["threads"])  # the worker's own choice first
        try:
            stage = Stage(model if model is not None else load_model(fields["model"]), tuple(fields["layers"]))
        except Exception as error:  # whatever stops the stage from loading, the head must hear of it
            head.send_tensor(failure_message(fields["stage"], error, int(fields.get("epoch", 0))))
            raise
        role = Role(fields["role"], fields["number"], fields["stages"], fields["stage"])
        following, first, sender, replicator = open_links(fields, role)
        worker = StageWorker(stage, role, inbox, head, following, first, fields["eos"], fields["pad"], sender,
                             bool(fields.get("swapping")), None, replicator, bool(fields.get("recovery")),
                             int(fields.get("epoch", 0)), fields.get("replica_prefix", ""),
                             fields.get("batching", "static"), fields.get("max_prefill_tokens"))
        heartbeat: Heartbeat | None = None
        try:
            head.send_tensor(pack(Message(Kind.READY, {"stage": fields["stage"], "epoch": worker.epoch})))
            worker.heartbeat = heartbeat = Heartbeat(head, role.name, float(fields["heartbeat"]), lambda: worker.epoch,
                                                     inbox.url)
            worker.run()
        finally:
            if heartbeat is not None:
                heartbeat.close()
            worker.close()


def _join(head: Transport, join: Message) -> None:
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
            head.send_tensor(pack(Message(Kind.HEARTBEAT, {"stage": "standby"})))


def main(argv: Sequence[str] | None = None) -> int:
    """Run a worker from its command line (as launchers start it); its exit status as `dejavu worker`'s: 0 once
    the head says `shutdown`, 2 on a `DejaVuError` (a head gone, a bad assignment), 130 on Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m dejavu_sdk.serving.bootstrap",
                                     description="a stage worker: join a pipeline's head and serve the stage it "
                                     "assigns (the token comes from DEJAVU_TOKEN)")
    parser.add_argument("--join", required=True, help="the head's URL, tcp://host:port")
    parser.add_argument("--worker-id", help="the id its launcher gave it, sent to the head when it joins")
    parser.add_argument("--host", default="127.0.0.1", help="the address it listens on for its neighbours")
    parser.add_argument("--threads", type=int, help="torch threads for its stage (default: the head's choice)")
    args = parser.parse_args(argv)
    try:
        run_worker(args.join, host=args.host, threads=args.threads, worker_id=args.worker_id)
    except DejaVuError as error:
        print(f"dejavu: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
