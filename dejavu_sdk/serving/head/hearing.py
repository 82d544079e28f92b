"""When the head listened: a stage's silence counts only the time the head could have heard it.

The head's receiver thread takes every worker's message, heartbeats included, and watches the stages between
messages. While it does not take them (a message's handling that ran long, such as a slow `on_token` callback;
the head's process starved of CPU on a loaded machine, waking late), heartbeats and progress reports wait in its
inbox: that silence is the head's, not the stage's, and must not count a stage dead or stuck. `Hearing` keeps
the spans in which the head did not listen, and `listened(since, now)` counts only the rest."""

from __future__ import annotations

import collections

#: Spans shorter than this are not kept: taking and handling one message costs about that.
SHORTEST_PAUSE = 0.02
#: Seconds of past spans kept: longer than any heartbeat limit or progress timeout looks back.
KEPT_FOR = 600.0


class Hearing:
    """The head's pauses in listening, on its receiver thread (`deaf` when it stops taking messages, `listening`
    when it takes them again)."""

    def __init__(self) -> None:
        self._pauses: collections.deque[tuple[float, float]] = collections.deque()
        self._deaf_since: float | None = None

    def deaf(self, at: float) -> None:
        """The head stopped taking messages at `at` (monotonic seconds)."""
        self._deaf_since = at

    def listening(self, at: float) -> None:
        """The head takes messages again from `at`."""
        if self._deaf_since is not None and at - self._deaf_since >= SHORTEST_PAUSE:
            self._pauses.append((self._deaf_since, at))
            while self._pauses and self._pauses[0][1] < at - KEPT_FOR:
                self._pauses.popleft()
        self._deaf_since = None

    def listened(self, since: float, now: float) -> float:
        """Seconds between `since` and `now` in which the head listened (a pause still going on counts as one)."""
        pauses = list(self._pauses) + ([] if self._deaf_since is None else [(self._deaf_since, now)])
        deaf = sum(max(0.0, min(end, now) - max(start, since)) for start, end in pauses)
        return now - since - deaf
