"""What the controller counts, in Prometheus' text format (`GET /metrics`), one registry per controller."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..errors import DejaVuError

if TYPE_CHECKING:
    from .journal import Journal

#: Request latency buckets, seconds, from a millisecond (a short answer on a GPU) to long generations on a CPU.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40,
                   80, 160, 320, 640)
#: Time between tokens, seconds: a millisecond to a slow step on a CPU.
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                       0.4, 0.5, 0.75, 1, 2.5, 5, 10)


class ControllerMetrics:
    """Requests by outcome, choices by finish reason, prompt and generated tokens, end-to-end latency, time to
    first token, time between tokens, time waiting to start, choices running and waiting, stage failures and
    recoveries (as vLLM's server counts them); with a journal (`watch_journal`), its health and failed writes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dejavu_requests",
                                "Completion requests, by outcome (ok, bad_request, failed, cancelled, timed_out)",
                                ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter("dejavu_prompt_tokens", "Prompt tokens of served requests",
                                     registry=self.registry)
        self.cached_tokens = Counter("dejavu_prompt_tokens_cached", "Prompt tokens read from the prompt prefixes "
                                     "instead of computed", registry=self.registry)
        self.generated_tokens = Counter("dejavu_generated_tokens", "Tokens generated", registry=self.registry)
        self.latency = Histogram("dejavu_request_seconds", "Seconds from a request's arrival to its last token",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_token = Histogram("dejavu_time_to_first_token_seconds", "Seconds from a request's arrival to "
                                     "its first token", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("dejavu_inter_token_latency_seconds", "Seconds between a choice's tokens",
                                     buckets=INTER_TOKEN_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("dejavu_request_queue_time_seconds", "Seconds a choice waited to start",
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("dejavu_request_finished", "Choices that ended, by finish reason (stop, length)",
                                ["reason"], registry=self.registry)
        self.in_flight = Gauge("dejavu_requests_in_flight", "Choices being served (waiting or running)",
                               registry=self.registry)
        self.waiting = Gauge("dejavu_requests_waiting", "Choices waiting to start", registry=self.registry)
        self.failures = Counter("dejavu_stage_failures", "Stage failures detected", registry=self.registry)
        self.recoveries = Counter("dejavu_recoveries", "Recoveries completed", registry=self.registry)
        self.recovery_seconds = Histogram("dejavu_recovery_seconds", "Seconds from detecting a failure to serving "
                                          "again", buckets=LATENCY_BUCKETS, registry=self.registry)

    def watch_journal(self, journal: Journal) -> None:
        """Say whether the journal writes (`dejavu_journal_healthy`: 1, or 0 while it cannot) and count the writes
        of it that failed (`dejavu_journal_failed_writes_total`)."""
        healthy = Gauge("dejavu_journal_healthy", "1 while the journal writes, 0 while it cannot (or another "
                        "controller took it over)", registry=self.registry)
        healthy.set_function(lambda: 0.0 if journal.failure is not None else 1.0)
        failed = Counter("dejavu_journal_failed_writes", "Journal writes (records, lease renewals, snapshots) that "
                         "failed", registry=self.registry)
        journal.on_failed_write = failed.inc

    def watch_prefixes(self, stage_stats: Callable[[], dict[str, dict[str, Any]]]) -> None:
        """Each stage's prompt-prefix tiers at every scrape (`stage_stats()`: the pipeline's, asked of the stages;
        a scrape whose stages do not answer shows none of them): `dejavu_prefix_cache_*` by stage and tier."""
        self.registry.register(PrefixTiers(stage_stats))

    def recovered(self, seconds: float) -> None:
        self.recoveries.inc()
        self.recovery_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


#: The tier figures `dejavu_prefix_cache_*` shows, with their help: counters, then gauges.
PREFIX_COUNTERS = {"hits": "Chunks read from the tier", "misses": "Chunks the tier did not hold when asked",
                   "evictions": "Chunks the tier dropped for bytes", "corrupt": "Damaged chunks found (misses)",
                   "errors": "Reads that found the tier unreachable (misses)", "writes": "Chunks written to the tier"}
PREFIX_GAUGES = {"bytes": "Bytes of chunks the tier holds (this stage's view)", "chunks": "Chunks the tier holds"}


class PrefixTiers:
    """A collector of every stage's prompt-prefix tiers, asked at each scrape (`stage_stats`)."""

    def __init__(self, stage_stats: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self.stage_stats = stage_stats

    def describe(self) -> list[Any]:
        return []  # asked of the stages at each scrape, not at registration

    def collect(self) -> Iterator[Any]:
        try:
            stages = self.stage_stats()
        except DejaVuError:  # the stages did not all answer in time: this scrape shows none of them
            return
        labels = ["stage", "tier"]
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            name: CounterMetricFamily(f"dejavu_prefix_cache_{name}", text, labels=labels)
            for name, text in PREFIX_COUNTERS.items()}
        families.update((name, GaugeMetricFamily(f"dejavu_prefix_cache_{name}", text, labels=labels))
                        for name, text in PREFIX_GAUGES.items())
        for stage, figures in sorted(stages.items()):
            for tier in figures.get("prefix_tiers", []):
                for name, family in families.items():
                    family.add_metric([stage, str(tier["url"])], float(tier[name]))
        yield from families.values()


class RequestTimes:
    """One request's times, observed into `metrics`: from its arrival (`started`) to each choice's start, to its
    first token and to its end, and between each choice's tokens."""

    def __init__(self, metrics: ControllerMetrics) -> None:
        self.metrics, self.started = metrics, time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}  # each choice's last arrival

    def choice_started(self, when: float | None) -> None:
        """A choice left the waiting queue at `when` (`time.monotonic()`; None: unknown)."""
        if when is not None:
            self.metrics.queue_time.observe(max(0.0, when - self.started))

    def arrived(self, index: int, tokens: int) -> None:
        """Choice `index`'s next `tokens` arrived (tokens that arrive together share the time since its last)."""
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self.metrics.first_token.observe(now - self.started)
        if index in self.last_token:
            self.metrics.inter_token.observe((now - self.last_token[index]) / tokens)
        self.last_token[index] = now

    def ended(self) -> None:
        self.metrics.latency.observe(time.monotonic() - self.started)


__all__ = ["CONTENT_TYPE", "ControllerMetrics", "RequestTimes"]
