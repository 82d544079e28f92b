"""What the prefix bench sends and measures (`bench.prefix`, `bench.prefix_served`): a request's prompt (`Turn`) and
a workload's run (`Run`)."""

from __future__ import annotations

import attrs


@attrs.frozen
class Turn:
    """One request of a workload: its prompt's token ids."""

    ids: tuple[int, ...]


@attrs.frozen
class Run:
    """One workload run by one engine: each request's time to first token and cached positions, the whole run's
    seconds and new tokens."""

    first_token: tuple[float, ...]
    cached: tuple[int, ...]
    seconds: float
    tokens: int
