"""Report helpers: byte sizes to and from text, and Markdown tables.

The planner's sweeps (`dejavu_sdk.sweep`) print their makespan and cost tables with `markdown_table`; the
benchmarks (`dejavu_sdk.bench`) label block sizes with `format_size` and print their tables the same way; the
`dejavu bench` commands read `--sizes` and `--volume` with `parse_size`. The helpers live here, apart from both,
so that planning does not depend on the benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ConfigError


def parse_size(text: str) -> int:
    """Bytes in '64MiB', '1 MiB', '512KiB' or '4096'; ConfigError (a ValueError) for anything else."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    cleaned = text.strip().lower().replace(" ", "")
    try:
        for unit, factor in units.items():
            if cleaned.endswith(unit):
                return int(float(cleaned[: -len(unit)]) * factor)
        return int(cleaned)
    except ValueError:
        raise ConfigError(f"{text!r} is not a size: write bytes (4096) or a number with KiB, MiB or GiB") from None


def format_size(nbytes: int) -> str:
    """'64 MiB' for a whole number of GiB, MiB or KiB, else '<n> B'."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table: the header, a separator, then one line per row (cells written with `str`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
