"""The `dejavu` command line: `dejavu --help` lists the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._version import __version__
from .errors import ConfigError, DejaVuError
from .plan_cli import add_planning_commands


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return 0 if run_demo(args.store, args.new_tokens, args.kill_at, args.random_model) else 1


def _bench_stores(args: argparse.Namespace) -> int:
    from .bench.common import parse_size
    from .bench.stores import plot_store_bench, run_store_bench, store_bench_markdown

    sizes = [parse_size(size) for size in args.sizes.split(",")]
    targets = tuple(args.stores.split(","))
    results = run_store_bench(sizes, list(targets), repeats=args.repeats, volume=parse_size(args.volume),
                              directory=args.dir, progress=not args.quiet)
    print(store_bench_markdown(results, targets))
    write_outputs(args, results, lambda path: plot_store_bench(results, targets, path))
    return 0


def _bench_transports(args: argparse.Namespace) -> int:
    from .bench.common import parse_size
    from .bench.transports import available, plot_transport_bench, run_transport_bench, transport_bench_markdown

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
    from .bench.streaming import TARGETS, run_streaming_bench

    targets = tuple(args.stores.split(","))
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ConfigError(f"unknown bench target(s) {unknown}; choose from {', '.join(TARGETS)}")
    report = run_streaming_bench(targets, repeats=args.repeats, prompt_tokens=args.prompt_tokens,
                                 new_tokens=args.new_tokens, random_model=args.random_model, progress=not args.quiet)
    print(report.to_markdown(targets))
    write_outputs(args, report)
    return 0


def write_outputs(args: argparse.Namespace, results: Any, plot: Callable[[str], None] | None = None) -> None:
    """`--json`: every sample or outcome (`results.to_json()`); `--plot`: draw the figures into that file."""
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results.to_json(), file, indent=1)
    if plot is not None and args.plot:
        plot(args.plot)
        print(f"plot written to {args.plot}")


def _serve_store(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from .stores import open_store
    from .transports import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with open_store(args.store) as store, serve(args.listen, store) as server:
        print(f"serving {store.url} at {server.url}", flush=True)
        stop.wait()
        logging.info("stopping")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dejavu", description="KV-cache streaming for fast, fault-tolerant "
                                     "LLM serving.")
    parser.add_argument("--version", action="version", version=f"dejavu-sdk {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    demo = commands.add_parser("demo", help="kill a replicated generation mid-decode and resume it in a new process")
    demo.add_argument("--store", help="store URL (default: LMDB in a temporary directory)")
    demo.add_argument("--new-tokens", type=int, default=96)
    demo.add_argument("--kill-at", type=int, help="decode step to kill at (default: half way)")
    demo.add_argument("--random-model", action="store_true", help="use a small random model even if SmolLM2 "
                      "weights are installed")
    demo.set_defaults(run=_demo)

    serve_store = commands.add_parser("serve-store", help="hold a store in this process and serve it to peers "
                                      "(the remote CPU tier); stops on SIGTERM or Ctrl-C")
    serve_store.add_argument("--listen", required=True, help="tcp://host:port, ucx://host:port or nccl://host:port "
                             "(port 0: any free port; the URL is printed)")
    serve_store.add_argument("--store", default="memory://", help="the store to serve (default: memory://)")
    serve_store.set_defaults(run=_serve_store)

    bench = commands.add_parser("bench", help="measure the SDK beside ceilings from the same run")
    benches = bench.add_subparsers(title="benchmarks", metavar="BENCH", required=True)
    stores = benches.add_parser("stores", help="flush/fetch throughput of each store vs memcpy and plain files")
    stores.add_argument("--sizes", default="1MiB,64MiB", help="comma-separated block sizes (default: 1MiB,64MiB)")
    stores.add_argument("--stores", default="memory,lmdb,lmdb-nosync,file", help="comma-separated targets")
    stores.add_argument("--repeats", type=int, default=5)
    stores.add_argument("--volume", default="128MiB", help="bytes moved per measurement")
    stores.add_argument("--dir", help="scratch directory on the disk to measure (default: the temp dir)")
    _add_output_arguments(stores)
    stores.set_defaults(run=_bench_stores)

    transports = benches.add_parser("transports", help="flush/fetch throughput between two processes per "
                                    "transport vs a plain socket")
    transports.add_argument("--sizes", default="1MiB,64MiB", help="comma-separated block sizes")
    transports.add_argument("--transports", default="tcp,ucx,gloo,local", help="comma-separated transports")
    transports.add_argument("--repeats", type=int, default=5)
    transports.add_argument("--volume", default="256MiB", help="bytes moved per measurement")
    _add_output_arguments(transports)
    transports.set_defaults(run=_bench_transports)
    _add_streaming_bench(benches)
    add_planning_commands(commands)
    return parser


def _add_streaming_bench(benches: Any) -> None:
    streaming = benches.add_parser("streaming", help="decode latency with replication on vs off, buffered vs "
                                   "naive copies, layer-wise vs after-prefill prompt streaming")
    streaming.add_argument("--stores", default="memory,lmdb,lmdb-nosync,tcp",
                           help="comma-separated replicas to measure (lmdb syncs each commit, lmdb-nosync does not)")
    streaming.add_argument("--repeats", type=int, default=5)
    streaming.add_argument("--prompt-tokens", type=int, default=512)
    streaming.add_argument("--new-tokens", type=int, default=48)
    streaming.add_argument("--random-model", action="store_true", help="random weights even if SmolLM2 is installed")
    streaming.add_argument("--json", help="also write every sample to this JSON file")
    streaming.add_argument("--quiet", action="store_true", help="no progress bar")
    streaming.set_defaults(run=_bench_streaming)


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="also write every sample to this JSON file")
    parser.add_argument("--plot", help="also draw the figures into this PNG file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def main(argv: Sequence[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
