"""The output options the benchmark and simulation commands share: `--json`, `--plot` and `--quiet`.

`add_output_arguments` registers them on a subcommand's parser; the command then prints its tables and calls
`write_outputs` to save its results as JSON and draw its figure when asked.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def add_output_arguments(parser: argparse.ArgumentParser, *, samples: str = "every sample",
                         figures: str | None = "the figures") -> None:
    """`--json FILE` to write `samples`, `--plot FILE` to draw `figures` (none when `figures` is None), `--quiet`."""
    parser.add_argument("--json", help=f"also write {samples} to this JSON file")
    if figures is not None:
        parser.add_argument("--plot", help=f"also draw {figures} into this PNG file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def write_outputs(args: argparse.Namespace, results: Any, plot: Callable[[str], None] | None = None) -> None:
    """`--json`: every sample or outcome (`results.to_json()`); `--plot`: draw the figures into that file."""
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results.to_json(), file, indent=1)
    if plot is not None and args.plot:
        plot(args.plot)
        print(f"plot written to {args.plot}")
