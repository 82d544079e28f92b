"""A pipeline's spare workers: launched for a recovery, or kept warm (`standby`), to replace dead stages.

A spare is known by the id its launcher gave it (pids collide across machines). One that joins while no stage needs
it is told to load the model (`Standby`), and is kept in the pool once it says it has (`Warm`); a recovery takes
the oldest, and `top_up` launches more until `standby` of them are joined or on their way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import attrs

from ...backends import open_transport
from ...errors import TransportError
from ...transports.base import Transport
from ..options import PipelineOptions
from ..processes.launchers import WorkerHandle
from ..wire.link_tls import link_options, worker_environment
from ..wire.messages import Join, Standby, Warm, pack

log = logging.getLogger(__name__)


@attrs.frozen
class Spare:
    """A worker that joined while no stage needed it: its inbox, its launcher-given id (`pid N` for one started
    by hand) and its process id."""

    url: str
    worker: str
    pid: int


class SparePool:
    """The spare workers of one pipeline (`options`), which join its head at `url()`; `Fleet` is built on it."""

    def __init__(self, options: PipelineOptions, url: Callable[[], str]) -> None:
        self.options, self.layout, self.url = options, options.layout, url
        self.lock = threading.Lock()
        self.spares: dict[str, WorkerHandle] = {}  # launched workers not serving a stage, by launcher-given id
        self.pool: list[Spare] = []  # spares with the model loaded, oldest first
        self.warming: dict[str, Spare] = {}  # spares loading the model, by inbox
        self.closed = False

    @property
    def launch(self) -> bool:
        return self.options.launcher is not None

    def _launch(self) -> WorkerHandle:
        """A worker that joins this head, started by the launcher."""
        assert self.options.launcher is not None  # only launched pipelines start workers
        links = self.options.links
        return self.options.launcher.start(self.url(), links.token, worker_environment(links.tls))

    def _link(self, url: str) -> Transport:
        """A link to a worker's inbox, with the pipeline's token (and TLS)."""
        return open_transport(url, token=self.options.links.token, **link_options(self.options.links.tls))

    def _launch_spare(self) -> None:
        spare = self._launch()
        with self.lock:
            self.spares[spare.id] = spare

    def pool_spare(self, join: Join) -> None:
        """A worker joined while no stage needs it: it loads the model, and waits as a standby once `Warm`.
        One that cannot be reached is left out (a launched one is dropped with the next pruning)."""
        url = join.url
        try:
            with self._link(url) as link:
                link.send_tensor(pack(Standby(model=self.options.model, threads=self.options.threads)))
        except TransportError as error:
            log.warning("a spare worker at %s is unreachable: %s", url, error)
            return
        with self.lock:
            self.warming[url] = Spare(url, join.worker or f"pid {join.pid}", join.pid)

    def warm(self, warm: Warm) -> None:
        """A spare has loaded the model: it may replace a stage from now on."""
        with self.lock:
            if warm.url in self.warming:
                self.pool.append(self.warming.pop(warm.url))

    def prune_spares(self) -> None:
        """Forget spares whose launched process has ended (they would be counted, or taken, in vain)."""
        with self.lock:
            gone = {worker for worker, spare in self.spares.items() if not spare.alive()}
            for worker in gone:
                del self.spares[worker]
            self.pool = [spare for spare in self.pool if spare.worker not in gone]
            self.warming = {url: spare for url, spare in self.warming.items() if spare.worker not in gone}

    def launch_replacements(self, stages: list[int]) -> None:
        """Make sure workers will be there to replace `stages`: standbys, or processes launched now (launched
        pipelines); otherwise workers started elsewhere must join (`dejavu worker --join URL`)."""
        self.prune_spares()
        if self.launch:
            while len(self.spares) < len(stages):  # every spare is joined already, or on its way
                self._launch_spare()
            return
        with self.lock:
            missing = len(stages) - len(self.pool)
        if missing > 0:
            log.warning("%s gone: start %d worker(s) with `dejavu worker --join %s` to replace them",
                        ", ".join(self.layout.stages[index].name for index in stages), missing, self.url())

    def take_spare(self) -> Spare | None:
        """A spare worker that joined and loaded the model, now taken off the pool; None when none has."""
        self.prune_spares()
        with self.lock:
            return self.pool.pop(0) if self.pool else None

    def top_up(self) -> None:
        """Launch spare workers until `standby` of them are joined or on their way."""
        self.prune_spares()
        while self.launch and len(self.spares) < self.options.resilience.standby and not self.closed:
            self._launch_spare()

    def spare_pids(self) -> list[int]:
        """The processes of the spares ready to take a stage."""
        with self.lock:
            return [spare.pid for spare in self.pool]
