"""`dejavu demo`: registers the command; the demo itself is `dejavu_sdk.demo`, imported only when it runs."""

from __future__ import annotations

import argparse
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    if args.cluster:
        from ..demo_cluster import run_cluster_demo

        return 0 if run_cluster_demo(args.new_tokens, args.kill_at) else 1
    from ..demo import run_demo

    return 0 if run_demo(args.store, args.new_tokens, args.kill_at, args.random_model, args.sample) else 1


def add_demo_commands(commands: Any) -> None:
    """Register `demo` on the `dejavu` command's subparsers."""
    demo = commands.add_parser("demo", help="kill a replicated generation mid-decode and resume it in a new process")
    demo.add_argument("--store", help="store URL (default: LMDB in a temporary directory)")
    demo.add_argument("--new-tokens", type=int, default=96)
    demo.add_argument("--kill-at", type=int, help="decode step to kill at (default: half way)")
    demo.add_argument("--random-model", action="store_true", help="use a small random model even if SmolLM2 "
                      "weights are installed")
    demo.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-p 0.9, seed 7) "
                      "instead of decoding greedily: the resumed text is identical all the same")
    demo.add_argument("--cluster", action="store_true", help="instead: a controller serving SmolLM2 with one prompt "
                      "and two token stages; a token stage is killed mid-answer and recovered from its replica "
                      "(--kill-at: after that many tokens of the first answer)")
    demo.set_defaults(run=_demo)
