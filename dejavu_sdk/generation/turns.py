"""Whose turn it is: the waiting requests a microbatch or slot takes, in turns between the submissions they came
in, so that one large submission (a request's 128 choices, a list of 2000 prompts) cannot hold the others back.

A submission's share is the rows it holds in flight. Turns go first to the submissions that hold the fewest (one
that holds none goes before one whose rows fill a slot, however long the latter has waited), then to the oldest;
each turn takes one request, round after round. Submissions may be barred from a microbatch (a slot opened beside
the others for submissions held back takes no row of those that hold rows elsewhere).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batching import Request


def shares_of(held: Iterable[Request]) -> Counter[int]:
    """The rows each submission holds in flight, from the requests of those rows."""
    return Counter(request.group for request in held)


def take_microbatch(waiting: deque[Request], size: int, fits: Callable[[list[Request]], bool] | None = None,
                    shares: Mapping[int, int] | None = None, barred: Collection[int] = ()) -> list[Request]:
    """Up to `size` waiting requests, taking turns between the submissions they came in: one from each, the
    submission that holds the fewest rows in flight (`shares`, by `Request.group`; none by default) first and the
    one of the oldest request first among equals, then a second from each, and so on, in arrival order within
    each (rows of any decoding share a microbatch); the `barred` submissions take none. With `fits`, only as
    many as fit (none when the first alone does not). The others keep their places; cancelled requests leave
    the queue."""
    held = shares or {}
    submissions: dict[int, list[Request]] = {}
    for request in waiting:
        if not request.future.cancelled():
            submissions.setdefault(request.group, []).append(request)
    order = sorted(submissions, key=lambda group: held.get(group, 0))  # stable: the oldest first among equals
    queues = [iter(submissions[group]) for group in order if group not in barred]
    taken: list[Request] = []
    while queues and len(taken) < size:
        for turn in list(queues):
            following = next(turn, None)
            if following is None:
                queues.remove(turn)
            elif len(taken) < size:
                taken.append(following)
    while fits is not None and taken and not fits(taken):
        taken.pop()
    now = time.monotonic()
    for request in taken:
        request.started = now if request.started is None else request.started
    chosen = {id(request) for request in taken}
    kept = [request for request in waiting if id(request) not in chosen and not request.future.cancelled()]
    waiting.clear()
    waiting.extend(kept)
    return taken
