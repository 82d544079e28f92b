"""Request traces for the simulator and the planner: real output lengths and arrival times.

The package ships a sample of the Azure LLM inference trace 2023 (conversation service; CC-BY-4.0, see
`dejavu_sdk/data/README.md` for the attribution). Any CSV with the same columns
(`TIMESTAMP,ContextTokens,GeneratedTokens`) can be loaded instead, such as the full trace.
"""

from __future__ import annotations

import csv
import datetime
import importlib.resources
import os

import attrs
import numpy as np

from .errors import ConfigError

BUILTIN = "azure-llm-2023-conv-every10th.csv"
ATTRIBUTION = ("Azure LLM inference trace 2023 (conversation), Microsoft Azure, Azure/AzurePublicDataset; "
               "Patel et al., Splitwise, ISCA 2024; CC-BY-4.0")


@attrs.frozen
class Trace:
    """Requests in arrival order: seconds since the first, prompt tokens and generated tokens."""

    arrivals: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    name: str  # the file's name
    attribution: str  # whom the data comes from, and its license, for anything that shows it

    def __len__(self) -> int:
        return len(self.arrivals)

    def sample_output_lengths(self, count: int, seed: int = 0, clip: tuple[int, int] = (2, 1000)) -> tuple[int, ...]:
        """`count` output lengths drawn with replacement, clipped to `clip` as the paper clips LMSys-Chat."""
        drawn = np.random.default_rng(seed).choice(self.output_tokens, size=count, replace=True)
        return tuple(int(x) for x in np.clip(drawn, *clip))


def load_trace(path: str | None = None) -> Trace:
    """The shipped sample, or a CSV at `path` with columns TIMESTAMP, ContextTokens, GeneratedTokens."""
    try:
        if path is None:
            text = importlib.resources.files("dejavu_sdk.data").joinpath(BUILTIN).read_text(encoding="utf-8")
        else:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
    except OSError as error:
        raise ConfigError(f"cannot read the trace {path!r}: {error}") from None
    source = path or BUILTIN
    try:
        rows = list(csv.DictReader(text.splitlines()))
        stamps = [datetime.datetime.fromisoformat(row["TIMESTAMP"][:26]) for row in rows]
        prompt = np.array([int(row["ContextTokens"]) for row in rows])
        output = np.array([int(row["GeneratedTokens"]) for row in rows])
    except (KeyError, ValueError, TypeError) as error:
        raise ConfigError(f"{source} is not a trace with columns TIMESTAMP, ContextTokens, GeneratedTokens "
                          f"({error})") from None
    if not rows:
        raise ConfigError(f"{source} holds no requests")
    seconds = np.array([(stamp - stamps[0]).total_seconds() for stamp in stamps])
    order = np.argsort(seconds, kind="stable")
    name = os.path.basename(source)
    return Trace(seconds[order], prompt[order], output[order], name, "" if path else ATTRIBUTION)
