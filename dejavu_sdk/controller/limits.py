"""What one client may ask of the controller's API: its limits and their defaults (importing this loads no
server)."""

from __future__ import annotations

import attrs

from ..errors import ConfigError

#: Defaults: choices waiting to start; choices in one request; seconds a request may wait to start; body bytes (a
#: prompt of a few hundred thousand token ids); seconds an ended request is kept for a client to read again.
MAX_WAITING, MAX_PROMPTS, QUEUE_TIMEOUT, MAX_BODY_BYTES, KEEP_FINISHED = 1024, 128, 600.0, 4 << 20, 60.0
#: The most ended requests kept at once (in memory, and in the journal), whatever `keep_finished` says: what a
#: burst of requests keeps is bounded.
MAX_KEPT = 10_000
#: What a controller does while its journal cannot write (`journal_failure`): hold tokens back and take no new
#: request ("stop"), or serve on without it ("serve"); and the seconds the journal's lease lasts unless renewed.
JOURNAL_FAILURES, JOURNAL_LEASE = ("stop", "serve"), 3.0


@attrs.frozen
class ApiLimits:
    """What one client may ask of the server: `max_waiting` choices waiting to start (429 past it),
    `max_prompts` choices in one request (prompts times n; 400), `queue_timeout` seconds a request may wait to
    start (503 after), `max_body_bytes` a request body (413), `keep_finished` seconds an ended request stays
    readable (`GET /v1/requests/<id>`, its stream resumed)."""

    max_waiting: int = MAX_WAITING
    max_prompts: int = MAX_PROMPTS
    queue_timeout: float = QUEUE_TIMEOUT
    max_body_bytes: int = MAX_BODY_BYTES
    keep_finished: float = KEEP_FINISHED

    def __attrs_post_init__(self) -> None:
        for name in ("max_waiting", "max_prompts", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.queue_timeout, (int, float)) or not self.queue_timeout > 0:
            raise ConfigError(f"queue_timeout must be a positive number of seconds, got {self.queue_timeout!r}")
        if isinstance(self.keep_finished, bool) or not isinstance(self.keep_finished, (int, float)) \
                or not 0 <= self.keep_finished < float("inf"):
            raise ConfigError(f"keep_finished must be seconds from 0 on, got {self.keep_finished!r}")
