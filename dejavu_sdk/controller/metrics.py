"""What the controller counts, in Prometheus' text format (`GET /metrics`), one registry per controller."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Request latency buckets, seconds: from a few tokens on a GPU to long generations on a CPU.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class ControllerMetrics:
    """Requests by outcome, prompt and generated tokens, latency and time to first token, requests in flight,
    stage failures and recoveries."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dejavu_requests",
                                "Completion requests, by outcome (ok, bad_request, failed, cancelled)",
                                ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter("dejavu_prompt_tokens", "Prompt tokens of served requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("dejavu_generated_tokens", "Tokens generated", registry=self.registry)
        self.latency = Histogram("dejavu_request_seconds", "Seconds from a request's arrival to its last token",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_token = Histogram("dejavu_time_to_first_token_seconds", "Seconds from a request's arrival to "
                                     "its first token", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("dejavu_requests_in_flight", "Requests being served", registry=self.registry)
        self.failures = Counter("dejavu_stage_failures", "Stage failures detected", registry=self.registry)
        self.recoveries = Counter("dejavu_recoveries", "Recoveries completed", registry=self.registry)
        self.recovery_seconds = Histogram("dejavu_recovery_seconds", "Seconds from detecting a failure to serving "
                                          "again", buckets=LATENCY_BUCKETS, registry=self.registry)

    def recovered(self, seconds: float) -> None:
        self.recoveries.inc()
        self.recovery_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "ControllerMetrics"]
