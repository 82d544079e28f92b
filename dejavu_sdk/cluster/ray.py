"""Serving on a Ray cluster: stage workers as Ray actors, and the controller as one too (extra `ray`).

    import ray, dejavu_sdk as dv
    from dejavu_sdk.cluster.ray import RayWorkers, serve_on_ray

    ray.init()                                                        # or ray.init(address="auto")
    with dv.Pipeline("smollm2", prompt_stages=1, token_stages=2, recovery="replicas",
                     launch=RayWorkers(num_gpus=1)) as pipe:          # each stage worker is a Ray actor
        pipe.generate(prompts)
    served = serve_on_ray("smollm2", prompt_stages=1, token_stages=2) # the controller as a Ray actor too
    openai.OpenAI(base_url=served.url + "/v1", api_key=served.token)

Ray places each worker where its resources are (`num_cpus`, `num_gpus`, `resources`, any other actor
option); the worker listens on its node's address. When a stage dies (its actor killed, its node lost,
its process stopped), the pipeline's recovery asks the launcher for a replacement, a new actor, and
resumes from the replicas. Stage actors are not restarted by Ray itself: the pipeline decides. The controller's
actor is, where `serve_on_ray(..., max_restarts=N, journal=URL)` asks for it: Ray starts it again from its
constructor's arguments, on the same address, token and journal, and it goes on with the journal's requests for
their clients to resume (docs/cluster.md).
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import BackendUnavailable, ConfigError
from ..transports.access import TOKEN_VARIABLE

try:
    import ray
except ImportError as error:  # the extra is not installed
    raise BackendUnavailable("dejavu_sdk.cluster.ray needs Ray: pip install 'dejavu-sdk[ray]'") from error

#: Seconds to wait for an actor to start (Ray may have to start a worker process, or a node).
START_TIMEOUT = 300.0


class _StageWorkerActor:
    """A Ray actor that runs one stage worker (`bootstrap.run_worker`); `serve` returns when the worker ends."""

    def pid(self) -> int:
        return os.getpid()

    def serve(self, join: str, token: str, host: str | None, worker_id: str, environment: dict[str, str]) -> None:
        from ..serving.processes.bootstrap import run_worker

        os.environ.update({**environment, TOKEN_VARIABLE: token})
        run_worker(join, host=host or ray.util.get_node_ip_address(), worker_id=worker_id)


class RayWorkerHandle:
    """A stage worker running in a Ray actor; `id` is the one `RayWorkers` gave it (pids collide across nodes)."""

    def __init__(self, actor: Any, id: str, pid: int, serving: Any) -> None:
        self.actor, self.id, self.pid, self._serving = actor, id, pid, serving

    def alive(self) -> bool:
        done, _ = ray.wait([self._serving], timeout=0)
        return not done

    def exit_status(self) -> str:
        try:
            ray.get(self._serving, timeout=0)
        except Exception as error:
            return f"its Ray actor ended: {type(error).__name__}: {str(error).splitlines()[0]}"
        return "its Ray actor returned"

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)
        ray.wait([self._serving], timeout=START_TIMEOUT)

    def stop(self, timeout: float) -> None:
        ray.wait([self._serving], timeout=timeout)
        self.kill()  # the actor outlives its worker: end it, and give back what it holds


class RayWorkers:
    """A `Launcher` that starts each stage worker as a Ray actor, with the actor `options` given (`num_cpus`,
    `num_gpus`, `resources`, `runtime_env`, ...; by default it asks for no CPU, so that idle spares do not keep
    stages from being placed). `host`: the address workers listen on (default: their node's)."""

    outlives_head = False  # an actor's actors end with it (Ray's ownership): none waits for a successor

    def __init__(self, host: str | None = None, **options: Any) -> None:
        if not ray.is_initialized():
            raise ConfigError("RayWorkers needs a running Ray: call ray.init() (or ray.init(address=...)) first")
        self.host = host
        self.options = {"num_cpus": 0, "max_concurrency": 2, **options}  # serve blocks; pid answers meanwhile
        self._actor_class = ray.remote(_StageWorkerActor)

    def start(self, join: str, token: str, environment: Mapping[str, str]) -> RayWorkerHandle:
        actor: Any = self._actor_class.options(**self.options).remote()  # an actor handle: its methods are remote
        try:
            pid = int(ray.get(actor.pid.remote(), timeout=START_TIMEOUT))
        except BaseException:  # not placed in time (no node with the resources), or interrupted: do not leak it
            ray.kill(actor, no_restart=True)
            raise
        worker_id = uuid.uuid4().hex
        return RayWorkerHandle(actor, worker_id, pid, actor.serve.remote(join, token, self.host, worker_id,
                                                                             dict(environment)))


class _ControllerActor:
    """A Ray actor hosting a `Controller` whose stage workers are Ray actors too, started by its constructor: an
    actor Ray restarts starts its controller again, from the same arguments."""

    def __init__(self, model: str, options: dict[str, Any], worker_options: dict[str, Any]) -> None:
        from ..controller import Controller

        options = dict(options)
        host = options.pop("host", None) or ray.util.get_node_ip_address()
        workers = RayWorkers(**{"host": host if host in ("127.0.0.1", "::1", "localhost") else None,
                                **worker_options})
        self._controller = Controller(model, host=host, worker_host=host, launch=workers, **options).start()

    def address(self) -> tuple[str, str]:
        return self._controller.url, self._controller.token

    def status(self) -> dict[str, Any]:
        return self._controller.status()

    def close(self) -> None:
        if self._controller is not None:
            self._controller.close()


@attrs.frozen
class RayServed:
    """A controller serving on Ray: its API at `url` (`url + "/v1"` for OpenAI clients), its `token`, and the
    actor that hosts it (`status()`, `close()`)."""

    url: str
    token: str
    actor: Any

    def status(self) -> dict[str, Any]:
        return dict(ray.get(self.actor.status.remote()))

    def close(self) -> None:
        ray.get(self.actor.close.remote())
        ray.kill(self.actor, no_restart=True)


def serve_on_ray(model: str, *, controller_options: dict[str, Any] | None = None,
                 worker_options: dict[str, Any] | None = None, max_restarts: int = 0, **options: Any) -> RayServed:
    """Start a `Controller` for `model` in a Ray actor (with `controller_options`, e.g. `resources`), its stage
    workers as Ray actors (with `worker_options`); `options` go to the `Controller` (layout, `port` (default
    8000), `token`, `recovery`, `standby`, `journal`, ...). `max_restarts`: how often Ray starts the controller's
    actor again after it died; each incarnation serves at the same address with the same tokens and goes on from
    the journal (so it needs `journal=` and a fixed `port`)."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise ConfigError(f"max_restarts must be a count of restarts (-1: without end), got {max_restarts!r}")
    if max_restarts:
        if not options.get("journal"):
            raise ConfigError("a restarted controller goes on from its journal: give journal= with max_restarts")
        if options.get("port", 8000) == 0:
            raise ConfigError("a restarted controller must answer where its clients reconnect: give a port, not 0")
        # every incarnation takes the same tokens: clients and workers keep theirs
        options.setdefault("token", secrets.token_urlsafe(24))
        options.setdefault("worker_token", secrets.token_urlsafe(24))
    actor: Any = ray.remote(_ControllerActor).options(
        num_cpus=0, max_restarts=max_restarts, max_task_retries=-1 if max_restarts else 0,
        **(controller_options or {})).remote(model, options, worker_options or {})
    url, token = ray.get(actor.address.remote(), timeout=START_TIMEOUT)
    return RayServed(url, token, actor)
