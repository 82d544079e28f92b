"""The groups of a pipeline's options that `PipelineOptions` holds, each a frozen record: `Links` (how the head
and the stages reach each other), `Watch` (when a stage counts as dead or stuck), `Resilience` (what a dead stage
costs), `Prefixes` (the tiers prompt prefixes are read from and kept in), each with its own check, and `Memory`
(the KV caches' device budget and swapping, which `PipelineOptions.check` decides: it needs the model).

Each `check` takes the keywords of its group as `Pipeline` takes them (keyword-only; what it depends on
besides comes first), and raises a `ConfigError` that says
what to change; `PipelineOptions.check` hands each group its keywords.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections.abc import Sequence
from typing import Any

import attrs

from ..backends import open_store
from ..errors import ConfigError
from ..prefix.keys import CHUNK_POSITIONS, check_chunk
from ..prefix.tiers import tier_url
from ..store import Store
from ..swapping import SwapChoice
from ..transports.access import TOKEN_VARIABLE
from .wire.link_tls import LinkTls

#: The transports a pipeline's links can use.
TRANSPORTS = ("tcp", "gloo", "nccl", "ucx")
#: The ways a pipeline may recover from a dead stage.
RECOVERY = ("replicas", "recompute")
#: The transports whose links reconnect to a stage's replacement (each link its own connection, or its own
#: two-rank gloo group); NCCL's communicators are not torn down and rebuilt around a hung peer yet.
RECOVERABLE_TRANSPORTS = ("tcp", "gloo", "ucx")
#: Seconds a worker whose head is gone waits for a successor to take its stage back (`orphan_timeout`).
ORPHAN_TIMEOUT = 60.0
#: Seconds a microbatch may go without a token while no stage computes before its stage counts as stuck.
PROGRESS_TIMEOUT = 60.0


@attrs.frozen
class Links:
    """How the head and its stages reach each other: the `transport`, where the head listens (`host`, `port`),
    the links' shared secret (`token`) and their TLS (`tls`, tcp only)."""

    transport: str = "tcp"
    host: str = "127.0.0.1"
    port: int = 0
    token: str = ""
    tls: LinkTls | None = None

    @classmethod
    def check(cls, launch: Any, *, transport: str = "tcp", host: str = "127.0.0.1", port: int = 0,
              token: str | None = None, link_tls_cert: str | None = None, link_tls_key: str | None = None,
              link_tls_ca: str | None = None) -> Links:
        """The links of a pipeline that launches its workers (`launch`) or lets them join from elsewhere."""
        if transport not in TRANSPORTS:
            raise ConfigError(f"transport={transport!r}: pipelines run over {', '.join(TRANSPORTS)}")
        tls = LinkTls.of(link_tls_cert, link_tls_key, link_tls_ca, transport)
        if not launch and not (token or os.environ.get(TOKEN_VARIABLE)):
            raise ConfigError(f"launch=False: workers started elsewhere must present the head's token; set "
                              f"{TOKEN_VARIABLE} to a shared secret here and for every `dejavu worker`")
        return cls(transport, host, port, token or os.environ.get(TOKEN_VARIABLE) or secrets.token_hex(16), tls)


@attrs.frozen
class Prefixes:
    """Prompt prefixes from the KV tiers (`dejavu_sdk.prefix`): the `tiers`' store URLs, fastest first (each stage
    process opens them for its own layers' chunks, so a `memory://` tier is each stage's memory), and the positions
    of a chunk (`chunk`). No tiers: prompts are computed whole."""

    tiers: tuple[str, ...] = ()
    chunk: int = CHUNK_POSITIONS

    @classmethod
    def check(cls, *, prefix_cache: str | Sequence[str] | None = None,
              prefix_chunk: int = CHUNK_POSITIONS) -> Prefixes:
        chunk = check_chunk(prefix_chunk)
        if prefix_cache is None:
            return cls((), chunk)
        urls = [prefix_cache] if isinstance(prefix_cache, str) else prefix_cache
        if not isinstance(urls, (list, tuple)) or not urls or not all(isinstance(url, str) for url in urls):
            raise ConfigError(f"prefix_cache={prefix_cache!r}: a pipeline's prefix tiers are store URLs, one or a "
                              "list fastest first (each stage process opens its own)")
        for url in urls:
            tier_url(url)
        return cls(tuple(urls), chunk)


@attrs.frozen
class Watch:
    """When a stage counts as dead or stuck, and how long waits may take: `timeout` (any one wait for a worker),
    `heartbeat` and `missed_beats` (a worker silent that long), `progress_timeout` (a microbatch without a token
    while no stage computes) and `orphan_timeout` (a worker whose head is gone keeps its stage that long)."""

    timeout: float = 60.0
    heartbeat: float = 1.0
    missed_beats: int = 3
    progress_timeout: float = PROGRESS_TIMEOUT
    orphan_timeout: float = ORPHAN_TIMEOUT

    @classmethod
    def check(cls, *, timeout: float = 60.0, heartbeat: float = 1.0, missed_beats: int = 3,
              progress_timeout: float = PROGRESS_TIMEOUT, orphan_timeout: float = ORPHAN_TIMEOUT) -> Watch:
        _seconds(timeout, "timeout")
        _seconds(heartbeat, "heartbeat", most=60)
        positive_integer(missed_beats, "missed_beats")
        _seconds(orphan_timeout, "orphan_timeout", zero=True)
        _seconds(progress_timeout, "progress_timeout")
        if progress_timeout <= heartbeat:
            raise ConfigError(f"progress_timeout={progress_timeout!r} must be longer than a heartbeat "
                              f"({heartbeat!r} s): heartbeats say whether a stage computes")
        return cls(float(timeout), float(heartbeat), missed_beats, float(progress_timeout), float(orphan_timeout))


@attrs.frozen
class Resilience:
    """What a dead stage costs: how the pipeline recovers (`recovery`: None, "replicas" or "recompute"), the
    store that keeps the replicas instead of the next decoding stage (`replica_store`), what the names of its
    replica streams start with (`replica_prefix`), and how many spare workers wait with the model loaded
    (`standby`)."""

    recovery: str | None = None
    replica_store: Store | None = None
    replica_prefix: str = ""
    standby: int = 0

    @classmethod
    def check(cls, transport: str, pipelines: list[list[tuple[int, int]]], launch: Any, *,
              recovery: str | None = None, replica_store: str | None = None, replica_prefix: str | None = None,
              standby: int = 0) -> Resilience:
        """The resilience of a pipeline laid out as `pipelines` over `transport` links, that launches its workers
        (`launch`) or not."""
        chosen = check_recovery(recovery, transport, pipelines, replica_store is not None)
        if isinstance(standby, bool) or not isinstance(standby, int) or standby < 0:
            raise ConfigError(f"standby must be a number of spare workers (0 or more), got {standby!r}")
        if standby and (chosen is None or not launch):
            raise ConfigError("standby workers replace dead stages: give recovery=, and let the pipeline launch them")
        prefix = _prefix(replica_prefix)
        return cls(chosen, open_replica_store(replica_store, chosen), prefix, standby)


@attrs.frozen
class Memory:
    """The KV caches' device memory: each stage's budget (`kv_budget`, bytes; None: no cap), whether the decoding
    stages swap (`swapping`; `swap_choice` says why when it was "auto"), and the bytes a token's KV takes on the
    widest decoding stage (`kv_bytes_per_token`)."""

    kv_budget: int | None
    swapping: bool
    swap_choice: SwapChoice | None
    kv_bytes_per_token: int


def check_recovery(recovery: Any, transport: str, pipelines: list[list[tuple[int, int]]],
                   replica_store: bool = False) -> str | None:
    """`recovery` if this pipeline can recover that way ("auto": the best way it can); ConfigError otherwise."""
    if recovery is None:
        if replica_store:
            raise ConfigError("replica_store keeps replicas to recover from: give recovery='replicas' too")
        return None
    if recovery not in (*RECOVERY, "auto"):
        raise ConfigError(f"recovery={recovery!r}: use {', '.join(map(repr, RECOVERY))} or 'auto', or None to fail "
                          "the requests in flight when a stage dies")
    refusal = None if transport in RECOVERABLE_TRANSPORTS else (
        f"recovery needs links that reconnect to a replacement ({', '.join(RECOVERABLE_TRANSPORTS)}); "
        f"{transport} links do not yet")
    ring = None if len(pipelines[-1]) >= 2 or replica_store else (
        "recovery='replicas' keeps each decoding stage's replica on the next one: it needs two decoding stages or "
        "more (or use recovery='recompute')")
    if recovery == "auto":
        if refusal:
            return None
        return "recompute" if ring and not replica_store else "replicas"
    if recovery == "recompute" and replica_store:
        raise ConfigError("replica_store keeps replicas to recover from, which recovery='recompute' never reads")
    for reason in (refusal, ring if recovery == "replicas" else None):
        if reason:
            raise ConfigError(reason)
    return str(recovery)


def open_replica_store(url: str | None, recovery: str | None) -> Store | None:
    """The store every stage replicates into, checked: other processes must see what one puts there."""
    if url is None:
        return None
    if recovery != "replicas":
        raise ConfigError("replica_store keeps replicas to recover from: it needs recovery='replicas'")
    store = open_store(url)
    if not store.shared:
        store.close()
        raise ConfigError(f"replica_store={url!r}: every stage process writes there and the head reads it, so it "
                          "must be a store other processes see (file:// on a shared file system, s3://, ...)")
    return store


def positive_integer(value: Any, name: str) -> None:
    """A ConfigError unless `value` is an integer of 1 or more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _seconds(value: Any, name: str, most: float | None = None, zero: bool = False) -> None:
    """A ConfigError unless `value` is a finite number of seconds above 0 (or 0 itself, `zero`), at most `most`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero) or (most and value > most):
        lowest = "0 or more" if zero else "positive"
        raise ConfigError(f"{name} must be a number of seconds in (0, {most}], got {value!r}" if most else
                          f"{name} must be a {lowest} number of seconds, got {value!r}")


def _prefix(replica_prefix: Any) -> str:
    """The replica streams' prefix: the one given (letters, digits and dashes), or a drawn one."""
    if replica_prefix is None:
        return f"p{secrets.token_hex(4)}-"
    if not isinstance(replica_prefix, str) or not re.fullmatch(r"[A-Za-z0-9-]{1,64}", replica_prefix):
        raise ConfigError(f"replica_prefix must be 1 to 64 letters, digits or dashes, got {replica_prefix!r}")
    return replica_prefix
