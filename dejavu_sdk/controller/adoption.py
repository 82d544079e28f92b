"""What a controller took over from its predecessor's journal (`Controller.adoption`, `adopted` in `/v1/status`)."""

from __future__ import annotations

from collections.abc import Callable

import attrs


@attrs.frozen
class Adoption:
    """What a controller took over from its predecessor's journal: the requests still running (`going_on`), those
    of them that went on from the caches their predecessor's stage workers still held, with the tokens the journal
    held of them (`taken_over`: not computed again), those with tokens that are computed again from their prompts
    (`recomputed`: how many the journal held; no worker could go on with them), the ended ones kept for clients to
    read (`kept`), and the stages whose worker (the predecessor's, with its stage loaded) rejoined (`rejoined`);
    and the seconds its start spent waiting for its predecessor's lease on the journal to lapse, reading the
    journal, getting the stage workers (rejoined, or started) and queuing the requests again (taking over the caches
    included)."""

    going_on: list[str] = attrs.field(factory=list)
    taken_over: dict[str, int] = attrs.field(factory=dict)
    recomputed: dict[str, int] = attrs.field(factory=dict)
    kept: list[str] = attrs.field(factory=list)
    rejoined: list[str] = attrs.field(factory=list)
    read_seconds: float = 0.0
    lease_seconds: float = 0.0
    workers_seconds: float = 0.0
    adopt_seconds: float = 0.0

    def readable(self, readable: Callable[[str], bool]) -> Adoption:
        """This adoption with the request ids `readable` says yes to alone (those of one client)."""
        return attrs.evolve(self, going_on=[name for name in self.going_on if readable(name)],
                            taken_over={name: count for name, count in self.taken_over.items() if readable(name)},
                            recomputed={name: count for name, count in self.recomputed.items() if readable(name)},
                            kept=[name for name in self.kept if readable(name)])
