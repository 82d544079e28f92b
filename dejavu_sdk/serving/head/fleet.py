"""The pipeline's worker processes: launching them, their joining, stage assignment, heartbeats, and fencing by
epoch; the pool of spare workers that replace dead stages is `spares.SparePool`'s.

A worker joins with its inbox's address, its pid and the id its launcher gave it (`worker`; None for a worker
started by hand). Each stage remembers the epoch its worker was assigned in, so that whatever a replaced worker
still sends (a heartbeat, a failure) is ignored; a replaced process the pipeline launched is killed, and one
started elsewhere is told to exit when its heartbeat comes again (`fence_stale`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from ...errors import ConfigError, TransportError
from ...transports.base import CLIENT_TIMEOUT, Server, Transport
from ..options import PipelineOptions
from ..processes.launchers import JoinedWorker, WorkerHandle
from ..wire.messages import (
    AskRejoin,
    AskStats,
    Assign,
    Failed,
    Fenced,
    Heartbeat,
    Join,
    Links,
    Message,
    Ready,
    Rejoin,
    Shutdown,
    Stats,
    Warm,
    pack,
    unpack,
)
from .spares import Spare, SparePool

log = logging.getLogger(__name__)

#: Seconds the head waits for every worker to join and load its stage.
START_TIMEOUT = 300.0
#: Seconds between two tellings of one replaced worker to exit.
FENCE_EVERY = 1.0


class Fleet(SparePool):
    """The stage workers of one pipeline (`options`), reached through the head's inbox at `url()`, and its spares
    (`SparePool`)."""

    def __init__(self, options: PipelineOptions, url: Callable[[], str]) -> None:
        super().__init__(options, url)
        self.epoch = 0  # raised by each recovery: messages of older epochs are dropped
        self.processes: list[WorkerHandle] = []  # each stage's process (a worker that joined on its own: its id)
        self.links: list[Transport] = []  # to each stage's inbox
        self.urls: list[str] = []  # each stage's inbox
        self.beats: dict[str, float] = {}  # per stage name: when its last heartbeat (or `ready`) arrived
        self.work: dict[str, int] = {}  # per stage name: the layers its worker had run at its last heartbeat
        #: When a heartbeat last said that a stage had run layers since the one before (-inf: never).
        self.worked_at = float("-inf")
        self.assigned: dict[str, int] = {}  # per stage name: the epoch its worker was assigned in
        self._stats: dict[str, dict[str, Any]] = {}  # per stage: what its caches held, as it last said
        self.rejoined: list[str] = []  # stages whose worker (a former head's) took them back at the start
        #: Whether the head takes over what rejoined workers hold (`Pipeline.take_over`): else they drop it.
        self.taking_over = False
        self._asked: set[str] = set()  # inboxes of former heads' workers asked to rejoin
        self._fenced: dict[str, float] = {}  # inboxes of replaced workers told to exit, and when last
        self._stats_arrived = threading.Condition()

    # ---- starting ---------------------------------------------------------------------------------------
    def start(self, inbox: Server, eos: list[int], pad: int, recovery: bool, rejoin_wait: float = 0.0) -> None:
        """Launch a worker per stage (and the standbys), assign each worker its stage in the order they join
        the head's `inbox`, and return once every stage is loaded. Workers of a head that died at this address
        rejoin with their stage loaded (`rejoin`): the first `rejoin_wait` seconds are theirs, and workers are
        launched only for the stages none took back (`rejoined` names those taken back). The stages start in
        `epoch` (set beforehand: past a former head's) or past every rejoined worker's, whichever is later."""
        stages = len(self.layout.stages)
        members: dict[int, tuple[str, str | None, int]] = {}  # stage index: its worker's inbox, id and pid
        epochs: list[int] = []  # those the rejoined workers served in
        deadline = time.monotonic() + START_TIMEOUT

        def next_message(until: float, waiting_for: str) -> Message | None:
            self.check_processes()
            remaining = min(until, deadline) - time.monotonic()
            if remaining <= 0:
                if until < deadline:
                    return None
                raise TransportError(f"waited {START_TIMEOUT:.0f} s for {waiting_for}")
            with contextlib.suppress(TransportError):  # a quiet inbox
                return unpack(inbox.recv_tensor(timeout=min(1.0, remaining)))
            return None

        def on_join(join: Join) -> None:
            if join.worker in self.spares:
                self.pool_spare(join)
            else:
                members[min(set(range(stages)) - set(members))] = (join.url, join.worker, join.pid)

        def on_heartbeat(heartbeat: Heartbeat) -> None:
            if heartbeat.url is not None and all(heartbeat.url != member[0] for member in members.values()):
                self.ask_to_rejoin(heartbeat.url, heartbeat.stage)  # its link found this head by itself

        def on_rejoin(rejoin: Rejoin) -> None:
            if any(rejoin.url == member[0] for member in members.values()):
                return  # asked again: the answer to its first ask is on its way
            index = self._stage_taken_back(rejoin, set(members))
            if index is None:
                self.turn_away(rejoin)
            else:
                members[index] = (rejoin.url, rejoin.worker, rejoin.pid)
                epochs.append(rejoin.epoch)
                self.rejoined.append(self.layout.stages[index].name)

        def on_failure(failed: Failed) -> None:
            raise ConfigError(f"stage {failed.stage} could not start: {failed.error}")

        # what the head does with each message while workers join, and while they load their stages
        joining: dict[type[Message], Callable[[Any], None]] = {
            Join: on_join, Warm: self.warm, Heartbeat: on_heartbeat, Rejoin: on_rejoin}
        loading: dict[type[Message], Callable[[Any], None]] = {
            Failed: on_failure, Ready: lambda message: ready.add(message.stage), Join: self.pool_spare,
            Warm: self.warm, Rejoin: self.turn_away}

        def take(message: Message | None, handlers: dict[type[Message], Callable[[Any], None]]) -> None:
            handler = None if message is None else handlers.get(type(message))
            if handler is not None:
                handler(message)

        ready: set[str] = set()
        until = time.monotonic() + rejoin_wait
        while len(members) < stages and time.monotonic() < until:
            take(next_message(until, "rejoining workers"), joining)
        launched: list[WorkerHandle] = []
        if self.launch:
            launched = [self._launch() for _ in range(stages - len(members))]
            for _ in range(self.options.resilience.standby):
                self._launch_spare()
        while True:
            while len(members) < stages:
                take(next_message(deadline, "every stage worker to join"), joining)
            # a rejoined worker may have gone since it asked: its stage needs another
            gone = [index for index in members if self.layout.stages[index].name in self.rejoined
                    and not self._reachable(members[index][0])]
            if not gone:
                break
            for index in gone:
                log.warning("the former %s worker that rejoined is gone: another takes the stage",
                            self.layout.stages[index].name)
                del members[index]
                self.rejoined.remove(self.layout.stages[index].name)
            launched += [self._launch() for _ in gone] if self.launch else []
        # stages go in the order workers joined: each stage's process is the one that joined as it
        by_id = {process.id: process for process in launched}
        joined = [members[index] for index in range(stages)]
        self.processes = [by_id.pop(worker) if worker in by_id else JoinedWorker(pid, worker)
                          for _, worker, pid in joined]
        self.spares.update(by_id)  # launched, outrun by workers started elsewhere: they join as spares
        if epochs:  # whatever the old pipeline's stages still send each other is of an older epoch: dropped
            self.epoch = max(self.epoch, max(epochs) + 1)
        self.assigned = {stage.name: self.epoch for stage in self.layout.stages}
        self.urls = [url for url, _, _ in joined]
        self.links = [self._link(url) for url in self.urls]
        for index in range(stages):
            self.send(index, self.assignment(index, eos, pad, recovery))
        while len(ready) < stages:  # a standby may join meanwhile; a rejoin is turned away: every stage has a worker
            take(next_message(deadline, "every stage worker to load its stage"), loading)
        self.beats = {stage.name: time.monotonic() for stage in self.layout.stages}

    def _stage_taken_back(self, rejoin: Rejoin, taken: set[int]) -> int | None:
        """The stage a rejoining worker takes back: the one of its name, when it holds that stage's layers of this
        model and no other worker has it; else None."""
        for index, stage in enumerate(self.layout.stages):
            if stage.name == rejoin.stage:
                if index in taken or list(stage.layers) != list(rejoin.layers) or rejoin.model != self.options.model:
                    return None
                return index
        return None

    def _reachable(self, url: str) -> bool:
        """Whether a worker's inbox takes a message now (`stats`, which a worker waiting to rejoin ignores)."""
        try:
            with self._link(url) as link:
                link.send_tensor(pack(AskStats()))
        except TransportError:
            return False
        return True

    def ask_to_rejoin(self, url: str, stage: str) -> None:
        """Tell a former head's worker that beats here (its heartbeat's link reconnected to this head before it
        noticed its own was gone) to rejoin: once per inbox, from a thread."""
        with self.lock:
            if url in self._asked:
                return
            self._asked.add(url)

        def tell() -> None:
            try:
                with self._link(url) as link:
                    link.send_tensor(pack(AskRejoin(stage=stage)))
            except TransportError as error:
                log.info("could not ask the former %s worker at %s to rejoin: %s", stage, url, error)

        threading.Thread(target=tell, name="dejavu-ask-rejoin", daemon=True).start()

    def turn_away(self, rejoin: Rejoin) -> None:
        """Tell a worker that asks to rejoin while no stage needs it to stop (from a thread: the head's receiver
        never waits on a worker)."""
        url, stage = rejoin.url, rejoin.stage

        def tell() -> None:
            try:
                with self._link(url) as link:
                    link.send_tensor(pack(Shutdown()))
                log.info("a worker of a former head asked to rejoin as %s: no stage needs it, told to stop", stage)
            except TransportError as error:
                log.info("could not tell the former %s worker at %s to stop: %s", stage, url, error)

        threading.Thread(target=tell, name="dejavu-turn-away", daemon=True).start()

    def assignment(self, index: int, eos: list[int], pad: int, recovery: bool) -> Assign:
        """What worker `index` is told to be: the model, its stage and where it sits, and its links."""
        stage, options, watch = self.layout.stages[index], self.options, self.options.watch
        return Assign(model=options.model, stage=stage.name, role=stage.role, number=stage.number,
                      stages=self.layout.token_depth if stage.role == "token" else self.layout.prompt_depth,
                      links=self.links_of(index), epoch=self.epoch, threads=options.threads,
                      most_threads=options.defaults.most_threads, eos=eos, pad=pad,
                      swapping=options.memory.swapping, heartbeat=watch.heartbeat, missed_beats=watch.missed_beats,
                      orphan_timeout=watch.orphan_timeout, recovery=recovery, take_over=self.taking_over,
                      batching=options.batching, max_prefill_tokens=options.max_prefill_tokens,
                      prefix_cache=options.prefixes.tiers, prefix_chunk=options.prefixes.chunk)

    def links_of(self, index: int) -> Links:
        store, prefix = self.options.resilience.replica_store, self.options.resilience.replica_prefix
        links = self.layout.links(index, self.urls, None if store is None else store.url, prefix)
        return attrs.evolve(links, link_timeout=min(self.options.watch.timeout, CLIENT_TIMEOUT))  # never above a link's

    # ---- talking to the stages -------------------------------------------------------------------------
    def send(self, index: int, message: Message) -> None:
        """Send stage `index` a message and wait until its inbox has it."""
        self.links[index].send_tensor(pack(message))

    def url_of(self, index: int) -> str:
        return self.urls[index]

    def new_epoch(self) -> int:
        with self.lock:
            self.epoch += 1
            return self.epoch

    # ---- watching them -----------------------------------------------------------------------------------
    def beat(self, name: str, epoch: int, work: int | None = None) -> None:
        """A heartbeat: a standby's beats only show it is there; a replaced worker's are no one's. `work`: the
        layers the stage has run so far; when it grew, the pipeline is computing (`worked_at`)."""
        with self.lock:
            if name in self.beats and epoch >= self.assigned.get(name, 0):
                now = self.beats[name] = time.monotonic()
                if work is not None and work != self.work.get(name):
                    if name in self.work:
                        self.worked_at = now
                    self.work[name] = work

    def heard_from(self, index: int) -> None:
        with self.lock:
            name = self.layout.stages[index].name
            self.beats[name] = time.monotonic()
            self.work.pop(name, None)  # a new worker counts its layers from 0

    def silent(self, listened: Callable[[float], float]) -> list[tuple[float, str]]:
        """The stages that missed `missed_beats` heartbeats in a row, counting only the seconds `listened(last
        beat)` in which the head could have heard them: (last beat, name), oldest first."""
        limit = self.options.watch.heartbeat * self.options.watch.missed_beats
        with self.lock:
            return sorted((last, name) for name, last in self.beats.items() if listened(last) > limit)

    def replaced_since(self, stage: str, epoch: int) -> bool:
        """Whether `stage`'s worker was replaced after `epoch` (what its old worker says is no one's)."""
        return epoch < self.assigned.get(stage, 0)

    def serves(self, stage: str, url: str, epoch: int) -> bool:
        """Whether the worker with inbox `url`, in `epoch`, serves `stage` now (not a replaced one, nor one of a
        former head at this address)."""
        if self.replaced_since(stage, epoch):
            return False
        with self.lock:
            names = [candidate.name for candidate in self.layout.stages]
            return stage not in names or names.index(stage) >= len(self.urls) or self.urls[names.index(stage)] == url

    def exited(self) -> list[int]:
        """The stages whose launched process has exited."""
        if self.closed:
            return []
        return [index for index, process in enumerate(self.processes) if not process.alive()]

    def check_processes(self) -> None:
        for number in self.exited():
            raise TransportError(f"the process of stage {number} exited with "
                                 f"{self.processes[number].exit_status()}")

    def fence(self, index: int) -> None:
        """Make sure stage `index`'s launched process is gone (a stopped one would wake and speak out of turn)."""
        if index < len(self.processes) and self.processes[index].alive():
            self.processes[index].kill()

    def fence_stale(self, url: str, stage: str, epoch: int) -> None:
        """Tell the worker at `url`, which served `stage` until a recovery after `epoch` and still speaks, to exit
        (a stopped or cut-off worker started elsewhere, which cannot be killed from here). At most once a second
        per worker, from a thread of its own: the head's receiver never waits on it."""
        now = time.monotonic()
        with self.lock:
            if now - self._fenced.get(url, -FENCE_EVERY) < FENCE_EVERY:
                return
            self._fenced[url] = now
            current = self.epoch

        def tell() -> None:
            try:
                with self._link(url) as link:
                    link.send_tensor(pack(Fenced(stage=stage, epoch=current, was=epoch)))
                log.warning("%s's worker of epoch %d at %s spoke again: told to exit", stage, epoch, url)
            except TransportError as error:
                log.info("could not tell %s's replaced worker at %s to exit: %s", stage, url, error)

        threading.Thread(target=tell, name="dejavu-fence", daemon=True).start()

    def place(self, index: int, spare: Spare) -> None:
        """The `spare` will be stage `index`: its links and process are now the stage's (its assignment follows,
        once every replacement is placed)."""
        with self.lock:
            self.processes[index] = (self.spares.pop(spare.worker) if spare.worker in self.spares
                                     else JoinedWorker(spare.pid, spare.worker))  # by hand: heartbeats watch it
            self.assigned[self.layout.stages[index].name] = self.epoch
        self.links[index].close()
        self.urls[index] = spare.url
        self.links[index] = self._link(spare.url)

    def stage_status(self) -> list[dict[str, Any]]:
        """Each stage: its name, role and layers, its launched process (pid, alive) and its last heartbeat."""
        stages: list[dict[str, Any]] = [{"name": stage.name, "role": stage.role, "layers": list(stage.layers)}
                                        for stage in self.layout.stages]
        for stage, process in zip(stages, self.processes, strict=False):
            stage.update(pid=process.pid, worker=process.id, alive=process.alive())
        now = time.monotonic()
        with self.lock:
            for stage in stages:
                if stage["name"] in self.beats:
                    stage["last_heartbeat_seconds_ago"] = round(now - self.beats[stage["name"]], 3)
        return stages

    def collect_stats(self, timeout: float, failed: Callable[[], BaseException | None]) -> dict[str, dict[str, Any]]:
        """Ask every stage for its caches' figures and wait (up to `timeout`, or until `failed()` says the
        pipeline failed) for every answer, which the head's receiver hands to `stats_arrived`."""
        with self._stats_arrived:
            self._stats.clear()
        for index in range(len(self.layout.stages)):
            self.send(index, AskStats())
        deadline = time.monotonic() + timeout
        with self._stats_arrived:
            while len(self._stats) < len(self.layout.stages):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or failed() is not None:
                    raise TransportError(f"the stages did not all report within {timeout} s") from failed()
                self._stats_arrived.wait(remaining)
            return dict(self._stats)

    def stats_arrived(self, stats: Stats) -> None:
        with self._stats_arrived:
            self._stats[stats.stage] = dict(stats.figures)
            self._stats_arrived.notify_all()

    # ---- stopping ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell every worker to stop, and make sure every process the pipeline launched is gone."""
        self.closed = True
        for link in self.links:
            with contextlib.suppress(TransportError):  # a worker already gone needs no shutdown
                link.send_tensor(pack(Shutdown()))
            link.close()
        with self.lock:
            joined = {spare.worker: spare.url for spare in [*self.pool, *self.warming.values()]}
            stages, spares = list(self.processes), dict(self.spares)
        for url in joined.values():
            with contextlib.suppress(TransportError), self._link(url) as link:
                link.send_tensor(pack(Shutdown()))
        for worker, process in spares.items():
            if worker not in joined:
                process.kill()  # launched, not joined yet: nothing to tell it
            else:
                process.stop(timeout=10)
        for process in stages:
            process.stop(timeout=10)

