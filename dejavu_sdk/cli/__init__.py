"""The `dejavu` command line: `dejavu --help` lists the subcommands.

`build_parser` has each command group register its subcommands (`demo`, `serving`, `bench`, `planning`); `main`
runs the one chosen and turns a `DejaVuError` into a one-line message. The console script `dejavu` and
`python -m dejavu_sdk.cli` both call `main`. The command line is the top layer: nothing else in the package
imports from it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._version import __version__
from ..errors import DejaVuError
from .bench import add_bench_commands
from .demo import add_demo_commands
from .planning import add_planning_commands
from .serving import add_serving_commands

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The `dejavu` parser with every subcommand; each sets `run`, the function that carries it out."""
    parser = argparse.ArgumentParser(prog="dejavu", description="KV-cache streaming for fast, fault-tolerant "
                                     "LLM serving.")
    parser.add_argument("--version", action="version", version=f"dejavu-sdk {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    add_demo_commands(commands)
    add_serving_commands(commands)
    add_bench_commands(commands)
    add_planning_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in `argv` (default: `sys.argv[1:]`) and return its exit status.

    0 on success; 2 with the help printed when no command is given, or with `dejavu: error: ...` on stderr when
    the input is bad (any `DejaVuError`); 130 on Ctrl-C.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except DejaVuError as error:
        print(f"dejavu: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
