"""`dejavu bench stores|transports|streaming`: run a benchmark from `dejavu_sdk.bench` and report it.

Each prints its Markdown tables and, on request, writes every sample as JSON and draws its figure. The benchmark
modules (torch, models, matplotlib) are imported only when their command runs, so `dejavu --help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from ..report import parse_size
from .output import add_output_arguments, write_outputs


def _bench_stores(args: argparse.Namespace) -> int:
    from ..bench.stores import plot_store_bench, run_store_bench, store_bench_markdown

    sizes = [parse_size(size) for size in args.sizes.split(",")]
    targets = tuple(args.stores.split(","))
    results = run_store_bench(sizes, list(targets), repeats=args.repeats, volume=parse_size(args.volume),
                              directory=args.dir, progress=not args.quiet)
    print(store_bench_markdown(results, targets))
    write_outputs(args, results, lambda path: plot_store_bench(results, targets, path))
    return 0


def _bench_transports(args: argparse.Namespace) -> int:
    from ..bench.transports import available, plot_transport_bench, run_transport_bench, transport_bench_markdown

    targets, notes = available(args.transports.split(","))
    for note in notes:
        print(note)
    sizes = [parse_size(size) for size in args.sizes.split(",")]
    results = run_transport_bench(sizes, targets, repeats=args.repeats, volume=parse_size(args.volume),
                                  progress=not args.quiet)
    print(transport_bench_markdown(results, targets))
    write_outputs(args, results, lambda path: plot_transport_bench(results, targets, path))
    return 0


def _bench_streaming(args: argparse.Namespace) -> int:
    from ..bench.streaming import TARGETS, plot_long_generation, run_streaming_bench

    targets = tuple(args.stores.split(","))
    unknown = sorted(set((*targets, args.long_store)) - set(TARGETS))
    if unknown:
        raise ConfigError(f"unknown bench target(s) {unknown}; choose from {', '.join(TARGETS)}")
    for option in ("repeats", "new_tokens", "small_tokens", "long_tokens", "long_repeats"):
        if getattr(args, option) < (1 if option in ("repeats", "new_tokens", "long_repeats") else 0):
            raise ConfigError(f"--{option.replace('_', '-')} must be a positive integer"
                              f"{'' if option in ('repeats', 'new_tokens', 'long_repeats') else ' or 0 to skip'}")
    report = run_streaming_bench(targets, repeats=args.repeats, prompt_tokens=args.prompt_tokens,
                                 new_tokens=args.new_tokens, random_model=args.random_model,
                                 small_tokens=args.small_tokens, long_tokens=args.long_tokens,
                                 long_repeats=args.long_repeats, long_store=args.long_store, progress=not args.quiet)
    print(report.to_markdown(targets))
    write_outputs(args, report, (lambda path: plot_long_generation(report, path)) if report.long_steps else None)
    return 0


def add_bench_commands(commands: Any) -> None:
    """Register `bench` and its benchmarks on the `dejavu` command's subparsers."""
    bench = commands.add_parser("bench", help="measure the SDK beside ceilings from the same run")
    benches = bench.add_subparsers(title="benchmarks", metavar="BENCH", required=True)

    stores = benches.add_parser("stores", help="flush/fetch throughput of each store vs memcpy and plain files")
    stores.add_argument("--sizes", default="1MiB,64MiB", help="comma-separated block sizes (default: 1MiB,64MiB)")
    stores.add_argument("--stores", default="memory,lmdb,lmdb-nosync,file", help="comma-separated targets")
    stores.add_argument("--repeats", type=int, default=5)
    stores.add_argument("--volume", default="128MiB", help="bytes moved per measurement")
    stores.add_argument("--dir", help="scratch directory on the disk to measure (default: the temp dir)")
    add_output_arguments(stores)
    stores.set_defaults(run=_bench_stores)

    transports = benches.add_parser("transports", help="flush/fetch throughput between two processes per "
                                    "transport vs a plain socket")
    transports.add_argument("--sizes", default="1MiB,64MiB", help="comma-separated block sizes")
    transports.add_argument("--transports", default="tcp,tcp+token,tcp+tls,ucx,gloo,local",
                            help="comma-separated transports; tcp+token and tcp+tls are tcp with a token, and "
                                 "with TLS and a token")
    transports.add_argument("--repeats", type=int, default=5)
    transports.add_argument("--volume", default="256MiB", help="bytes moved per measurement")
    add_output_arguments(transports)
    transports.set_defaults(run=_bench_transports)

    streaming = benches.add_parser("streaming", help="decode latency with replication on vs off, buffered vs "
                                   "naive copies, layer-wise vs after-prefill prompt streaming")
    streaming.add_argument("--stores", default="memory,lmdb,lmdb-nosync,tcp",
                           help="comma-separated replicas to measure (lmdb syncs each commit, lmdb-nosync does not)")
    streaming.add_argument("--repeats", type=int, default=5)
    streaming.add_argument("--prompt-tokens", type=int, default=512)
    streaming.add_argument("--new-tokens", type=int, default=48)
    streaming.add_argument("--random-model", action="store_true", help="random weights even if SmolLM2 is installed")
    streaming.add_argument("--small-tokens", type=int, default=96,
                           help="new tokens per run of the small, ~10 ms-step model (0: skip it)")
    streaming.add_argument("--long-tokens", type=int, default=2000,
                           help="new tokens of the long generation, start vs end (0: skip it)")
    streaming.add_argument("--long-repeats", type=int, default=3)
    streaming.add_argument("--long-store", default="lmdb-nosync", help="the replica of the long generation")
    add_output_arguments(streaming, figures="the long generation's step times and overhead")
    streaming.set_defaults(run=_bench_streaming)
