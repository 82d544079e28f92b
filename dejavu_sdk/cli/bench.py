"""`dejavu bench stores|...|recovery|long-prompt|prefix|http`: run a benchmark from `dejavu_sdk.bench` and report it.

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
    from ..bench.pingpong import PINGPONG, run_pingpong
    from ..bench.transports import (
        TransportReport,
        available,
        plot_transport_bench,
        run_transport_bench,
        transport_bench_markdown,
    )

    targets, notes = available(args.transports.split(","))
    for note in notes:
        print(note)
    sizes = [parse_size(size) for size in args.sizes.split(",") if size]
    results = run_transport_bench(sizes, targets, repeats=args.repeats, volume=parse_size(args.volume),
                                  progress=not args.quiet) if sizes else None
    if results is not None:
        print(transport_bench_markdown(results, targets))
    small = [parse_size(size) for size in args.pingpong_sizes.split(",") if size]
    schemes = [target for target in targets if target in PINGPONG]
    pingpong = run_pingpong(small, schemes, repeats=args.repeats, rounds=args.pingpong_rounds,
                            progress=not args.quiet) if small and schemes else None
    if pingpong is not None:
        print(pingpong.to_markdown())
    report = TransportReport(results, pingpong)
    write_outputs(args, report, (lambda path: plot_transport_bench(results, targets, path)) if results else None)
    return 0


def _bench_streaming(args: argparse.Namespace) -> int:
    from ..bench.streaming import TARGETS, plot_long_generation, run_streaming_bench
    from ..bench.whole_call import plot_whole_calls

    targets = tuple(args.stores.split(","))
    unknown = sorted(set((*targets, args.long_store)) - set(TARGETS))
    if unknown:
        raise ConfigError(f"unknown bench target(s) {unknown}; choose from {', '.join(TARGETS)}")
    for option in ("repeats", "new_tokens", "small_tokens", "long_tokens", "long_repeats", "whole_pairs"):
        if getattr(args, option) < (1 if option in ("repeats", "new_tokens", "long_repeats") else 0):
            raise ConfigError(f"--{option.replace('_', '-')} must be a positive integer"
                              f"{'' if option in ('repeats', 'new_tokens', 'long_repeats') else ' or 0 to skip'}")
    if args.whole_only and not args.whole_pairs:
        raise ConfigError("--whole-only runs the whole calls alone: give --whole-pairs 1 or more")
    report = run_streaming_bench(targets, repeats=args.repeats, prompt_tokens=args.prompt_tokens,
                                 new_tokens=args.new_tokens, random_model=args.random_model,
                                 small_tokens=args.small_tokens, long_tokens=args.long_tokens,
                                 long_repeats=args.long_repeats, long_store=args.long_store,
                                 whole_pairs=args.whole_pairs, whole_only=args.whole_only, progress=not args.quiet)
    print(report.to_markdown(targets))
    whole = report.whole
    if args.whole_only and whole is not None:
        write_outputs(args, report, lambda path: plot_whole_calls(whole, path))
    else:
        write_outputs(args, report, (lambda path: plot_long_generation(report, path)) if report.long_steps else None)
    return 0


def _bench_serving(args: argparse.Namespace) -> int:
    import math

    from ..bench.serving import check_choices, plot_serving_bench, run_serving_bench

    variants = tuple(variant.strip() for variant in args.variants.split(",") if variant.strip())
    names = tuple(name.strip() for name in args.workloads.split(",") if name.strip())
    check_choices(variants, names)
    try:
        rates = tuple(math.inf if rate.strip() in ("inf", "all") else float(rate) for rate in args.rates.split(","))
    except ValueError:
        raise ConfigError(f"--rates takes requests per second separated by commas, or 'all', got {args.rates!r}") \
            from None
    if any(not rate > 0 for rate in rates):
        raise ConfigError("every rate must be positive")
    for option in ("requests", "microbatch", "repeats", "max_prefill_tokens"):
        if getattr(args, option) < 1:
            raise ConfigError(f"--{option.replace('_', '-')} must be a positive integer")
    report = run_serving_bench(args.model, requests=args.requests, microbatch=args.microbatch,
                               rates=sorted(rates), repeats=args.repeats, gain=_lengths(args.gain, "--gain"),
                               loss=_lengths(args.loss, "--loss"), openai=_lengths(args.openai, "--openai"),
                               variants=variants, names=names, max_prefill_tokens=args.max_prefill_tokens,
                               transport=args.transport, progress=not args.quiet)
    print(report.to_markdown())
    write_outputs(args, report, lambda path: plot_serving_bench(report, path))
    return 0


def _bench_swapping(args: argparse.Namespace) -> int:
    from ..bench.swapping import plot_swapping_bench, run_swapping_bench

    try:
        prompts = tuple(int(length) for length in args.prompt_tokens.split(","))
    except ValueError:
        raise ConfigError(f"--prompt-tokens takes lengths separated by commas, got {args.prompt_tokens!r}") from None
    for option, value in (("prompt-tokens", min(prompts)), ("new-tokens", args.new_tokens),
                          ("microbatch", args.microbatch), ("repeats", args.repeats)):
        if value < 1:
            raise ConfigError(f"--{option} must be positive")
    if args.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device is cpu or cuda, got {args.device!r}")
    report = run_swapping_bench(args.model, device=args.device, microbatch=args.microbatch, depth=args.depth,
                                prompt_lengths=prompts, new_tokens=args.new_tokens, repeats=args.repeats,
                                progress=not args.quiet)
    print(report.to_markdown())
    write_outputs(args, report, lambda path: plot_swapping_bench(report, path))
    return 0


def _bench_recovery(args: argparse.Namespace) -> int:
    from ..bench.recovery import plot_recovery_bench, run_recovery_bench

    for option, value in (("prompt-tokens", args.prompt_tokens), ("new-tokens", args.new_tokens),
                          ("microbatch", args.microbatch), ("repeats", args.repeats),
                          ("prompt-stages", args.prompt_stages), ("stages", args.stages)):
        if value < 1:
            raise ConfigError(f"--{option} must be positive")
    if args.kill == "controller":
        from ..bench.recovery_controller import run_controller_recovery_bench

        if args.plot:
            raise ConfigError("--kill controller draws no figure: its parts are a table")
        killed = run_controller_recovery_bench(args.model, rows=args.microbatch, prompt_tokens=args.prompt_tokens,
                                               new_tokens=args.new_tokens, kill_step=args.kill_step,
                                               repeats=args.repeats, stages=args.stages, progress=not args.quiet)
        print(killed.to_markdown())
        write_outputs(args, killed)
        return 0
    report = run_recovery_bench(args.model, prompt_stages=args.prompt_stages, token_stages=args.token_stages,
                                microbatch=args.microbatch, prompt_tokens=args.prompt_tokens,
                                new_tokens=args.new_tokens, kill_step=args.kill_step, repeats=args.repeats,
                                progress=not args.quiet)
    print(report.to_markdown())
    write_outputs(args, report, lambda path: plot_recovery_bench(report, path))
    return 0


def _bench_long_prompt(args: argparse.Namespace) -> int:
    from ..bench.long_prompt import plot_long_prompt_bench, run_long_prompt_bench

    layouts = [layout.strip() for layout in args.layouts.split(",") if layout.strip()]
    report = run_long_prompt_bench(args.model, layouts=layouts, prompt_tokens=args.prompt_tokens,
                                   short_tokens=args.short_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
                                   threads=args.threads, batching=args.batching, progress=not args.quiet)
    print(report.to_markdown())
    write_outputs(args, report, lambda path: plot_long_prompt_bench(report, path))
    return 0


def _bench_prefix(args: argparse.Namespace) -> int:
    from ..bench.prefix import plot_prefix_bench, run_prefix_bench

    workloads = [workload.strip() for workload in args.workloads.split(",") if workload.strip()]
    report = run_prefix_bench(args.model, args.model, workloads=workloads, repeats=args.repeats,
                              new_tokens=args.new_tokens, message_tokens=args.message_tokens,
                              context_tokens=args.context_tokens, conversations=args.conversations,
                              system_tokens=args.system_tokens, question_tokens=args.question_tokens,
                              requests=args.requests, chunk=args.chunk, long_hit=args.long_hit,
                              serve_stages=args.serve, progress=not args.quiet)
    print(report.to_markdown())
    write_outputs(args, report, lambda path: plot_prefix_bench(report, path))
    return 0


def _bench_http(args: argparse.Namespace) -> int:
    import shlex

    from ..bench.http import plot_http_bench, run_http_bench

    model = args.model
    if model == "smollm2":  # the float32 directory of the bundled weights, which both servers load
        from ..models import default_cache_dir, load_smollm2

        if not (default_cache_dir() / "config.json").is_file():
            load_smollm2()  # writes the directory, once
        model = str(default_cache_dir())
    streams = [int(count) for count in args.streams.split(",") if count.strip()]
    report = run_http_bench(model, streams=streams, repeats=args.repeats, rounds=args.rounds,
                            max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                            dejavu_args=shlex.split(args.dejavu_args), busy=args.busy, client=args.client,
                            rate=args.rate, rate_requests=args.rate_requests, progress=None if args.quiet else print)
    print(report.to_markdown())
    write_outputs(args, report, lambda path: plot_http_bench(report, path))
    return 0


def _lengths(text: str, option: str) -> tuple[int, int]:
    try:
        prompt, new = (int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{option} takes median prompt tokens and median new tokens, like 256,32; got {text!r}") \
            from None
    if prompt < 1 or new < 1:
        raise ConfigError(f"{option}: both lengths must be positive, got {text!r}")
    return prompt, new


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
    transports.add_argument("--pingpong-sizes", default="4KiB,16KiB,64KiB",
                            help="tensor sizes of the round trips beside a plain socket (empty: none; an empty "
                                 "--sizes runs only these)")
    transports.add_argument("--pingpong-rounds", type=int, default=200, help="round trips per measurement")
    add_output_arguments(transports)
    transports.set_defaults(run=_bench_transports)

    streaming = benches.add_parser("streaming", help="decode latency with replication on vs off, buffered vs "
                                   "naive copies, layer-wise vs after-prefill prompt streaming, whole calls")
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
    streaming.add_argument("--whole-pairs", type=int, default=7,
                           help="(e): alternating pairs of whole generate calls, replicated and plain, per model and "
                                "store (0 to skip)")
    streaming.add_argument("--whole-only", action="store_true", help="run (e), the whole calls, alone")
    add_output_arguments(streaming, figures="the long generation's step times and overhead (with --whole-only: "
                         "the whole calls' ratios)")
    streaming.set_defaults(run=_bench_streaming)

    serving = benches.add_parser("serving", help="a model served by Hugging Face (static and continuous "
                                 "batching) and by pipelines (one stage, mixed and disaggregated; static or "
                                 "continuous batching) on requests from a trace")
    serving.add_argument("--model", default="smollm2", help="smollm2, a local model directory, or module:function")
    serving.add_argument("--requests", type=int, default=12, help="requests per workload, from the trace")
    serving.add_argument("--microbatch", type=int, default=4, help="rows per microbatch of a two-stage pipeline; "
                         "every variant keeps at most twice as many rows in flight (one-stage and disaggregated "
                         "continuous pipelines in one slot)")
    serving.add_argument("--rates", default="0.5,all", help="arrival rates in requests/s, comma-separated; 'all': "
                         "every request at once (the saturated throughput the planner predicts)")
    serving.add_argument("--repeats", type=int, default=3)
    serving.add_argument("--workloads", default="gain,loss,openai", help="comma-separated, of gain, loss, openai")
    serving.add_argument("--gain", default="256,32", help="median prompt and new tokens of the workload where the "
                         "planner predicts disaggregation ahead")
    serving.add_argument("--loss", default="64,64", help="median prompt and new tokens of the workload where it "
                         "predicts disaggregation behind")
    serving.add_argument("--openai", default="128,64", help="median prompt and new tokens of the sampled workload "
                         "(an OpenAI client's defaults: temperature 1, top_p 1, a seed per request)")
    serving.add_argument("--variants", default="continuous,one-stage-continuous,mixed-continuous,"
                         "disaggregated-continuous,disaggregated-static", help="comma-separated, of static, "
                         "continuous (Hugging Face), one-stage-static, one-stage-continuous, mixed-static, "
                         "mixed-continuous, disaggregated-static, disaggregated-continuous (pipelines), controller, "
                         "controller-journal (one-stage-continuous behind dv.Controller, streamed over HTTP, without "
                         "and with a journal: their ratio is the journal's cost)")
    serving.add_argument("--max-prefill-tokens", type=int, default=256, help="prompt positions a pipeline "
                         "prefills per step beside decoding")
    serving.add_argument("--transport", default="tcp", help="the pipelines' transport")
    add_output_arguments(serving, figures="tokens/s, the ratio to Hugging Face continuous batching and p99 latency "
                         "against the arrival rate")
    serving.set_defaults(run=_bench_serving)

    swapping = benches.add_parser("swapping", help="microbatches of 2B rows swapped to host memory against B rows "
                                  "without swapping, in the same device budget for KV")
    swapping.add_argument("--model", default="smollm2", help="smollm2, a local model directory, or module:function")
    swapping.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU: the case swapping is for)")
    swapping.add_argument("--microbatch", type=int, default=4, help="B: rows per microbatch without swapping")
    swapping.add_argument("--depth", type=int, default=4, help="the device budget, in B-row microbatch caches")
    swapping.add_argument("--prompt-tokens", default="64,256", help="prompt lengths, comma-separated")
    swapping.add_argument("--new-tokens", type=int, default=32)
    swapping.add_argument("--repeats", type=int, default=3)
    add_output_arguments(swapping, figures="tokens/s with and without swapping, and the measured and predicted ratio")
    swapping.set_defaults(run=_bench_swapping)

    recovery = benches.add_parser("recovery", help="a microbatch's latency with a token stage killed mid-generation: "
                                  "recovered from replicas against recomputed, beside failure-free runs")
    recovery.add_argument("--model", default="smollm2", help="smollm2, a local model directory, or module:function")
    recovery.add_argument("--prompt-stages", type=int, default=1)
    recovery.add_argument("--token-stages", type=int, default=2, help="at least 2: each keeps the next one's replicas")
    recovery.add_argument("--microbatch", type=int, default=4, help="requests in the microbatch")
    recovery.add_argument("--prompt-tokens", type=int, default=128)
    recovery.add_argument("--new-tokens", type=int, default=128)
    recovery.add_argument("--kill-step", type=int, help="the decode step at which the last token stage is killed "
                          "(default: half of --new-tokens)")
    recovery.add_argument("--repeats", type=int, default=3)
    recovery.add_argument("--kill", choices=["stage", "controller"], default="stage", help="stage: the last token "
                          "stage of two pipelines (replicas against recompute); controller: `dejavu serve --journal` "
                          "itself, a new one started on its journal while its clients reconnect (the stage "
                          "options do not apply; --stages does)")
    recovery.add_argument("--stages", type=int, default=1, help="--kill controller: the stages of `dejavu serve` (1: "
                          "static microbatches; 2 or more: continuous batching, recovering from replicas)")
    add_output_arguments(recovery, figures="latencies with and without a failure, and the time from kill to serving")
    recovery.set_defaults(run=_bench_recovery)

    long_prompt = benches.add_parser("long-prompt", help="a short request's time to first token sent while a long "
                                     "prompt prefills, against alone, per layout")
    long_prompt.add_argument("--model", default="smollm2", help="smollm2, a local model directory, or module:function")
    long_prompt.add_argument("--layouts", default="one-stage,mixed,disaggregated", help="comma-separated, of "
                             "one-stage, mixed (2 stages), disaggregated (1 prompt + 1 token stage)")
    long_prompt.add_argument("--prompt-tokens", type=int, default=8000, help="the long prompt's length (with "
                             "--new-tokens, within the model's context)")
    long_prompt.add_argument("--short-tokens", type=int, default=16, help="the short request's prompt length")
    long_prompt.add_argument("--new-tokens", type=int, default=4, help="tokens each request generates")
    long_prompt.add_argument("--repeats", type=int, default=3)
    long_prompt.add_argument("--threads", type=int, help="torch threads per stage process (default: the pipelines' "
                             "own, this machine's cores shared between a pipeline's stages)")
    long_prompt.add_argument("--batching", default="continuous", choices=["continuous", "static"],
                             help="the pipelines' batching (either prefills a prompt 256 positions a step)")
    add_output_arguments(long_prompt, figures="the prefill and the short request's time to first token beside it "
                         "and alone, and their ratio, per layout")
    long_prompt.set_defaults(run=_bench_long_prompt)

    prefix = benches.add_parser("prefix", help="DejaVuEngine (or dejavu serve) with and without a prefix cache on "
                                "a multi-turn chat from the Azure trace, a shared system prompt and prompts sharing "
                                "nothing; and each tier's cost to read a chunk")
    prefix.add_argument("--model", default="smollm2", help="smollm2, a local model directory, or module:function")
    prefix.add_argument("--workloads", default="chat,system,unique", help="comma-separated, of chat, system, unique")
    prefix.add_argument("--repeats", type=int, default=3)
    prefix.add_argument("--new-tokens", type=int, default=8, help="tokens each request generates")
    prefix.add_argument("--message-tokens", type=int, default=600, help="chat: a new message's tokens at most (the "
                        "trace row's prompt tokens)")
    prefix.add_argument("--context-tokens", type=int, default=2600, help="chat: a conversation ends before its prompt "
                        "passes this many tokens")
    prefix.add_argument("--conversations", type=int, default=2, help="chat: conversations")
    prefix.add_argument("--system-tokens", type=int, default=1024, help="system and unique: the shared system "
                        "prompt's tokens (unique: each prompt's own)")
    prefix.add_argument("--question-tokens", type=int, default=32, help="system and unique: each question's tokens")
    prefix.add_argument("--requests", type=int, default=4, help="system and unique: requests")
    prefix.add_argument("--chunk", type=int, default=256, help="positions a cached chunk holds")
    prefix.add_argument("--serve", type=int, metavar="STAGES", help="send the requests to `dejavu serve` in that "
                        "many mixed stages, started without and with --prefix-cache (default: DejaVuEngine)")
    prefix.add_argument("--long-hit", type=int, default=2000, help="chat: the turns reported apart read at least "
                        "this many cached positions")
    add_output_arguments(prefix, figures="each request's time to first token without and with the cache")
    prefix.set_defaults(run=_bench_prefix)

    http = benches.add_parser("http", help="dejavu serve beside transformers serve --continuous-batching on the same "
                              "weights, each driven over HTTP by streaming clients, alternating per repeat")
    http.add_argument("--model", default="smollm2", help="a Hugging Face model directory both servers load "
                      "(default: the bundled SmolLM2-135M, in float32)")
    http.add_argument("--client", choices=("guidellm", "builtin"), default="guidellm",
                      help="what drives the servers: guidellm (pip install 'dejavu-sdk[bench]'), or streaming "
                      "clients of this package's own (concurrent loads only)")
    http.add_argument("--streams", default="1,8,32", help="comma-separated loads: clients streaming at once")
    http.add_argument("--rounds", type=int, default=2, help="requests each client sends, one after another")
    http.add_argument("--rate", type=float, default=None, help="a Poisson load's requests a second (default, with "
                      "guidellm: the mean arrival rate of the shipped Azure conversation trace; 0: none)")
    http.add_argument("--rate-requests", type=int, default=32, help="requests the Poisson load sends")
    http.add_argument("--max-tokens", type=int, default=64, help="new tokens a request asks for")
    http.add_argument("--prompt-tokens", type=int, default=128, help="tokens of each prompt")
    http.add_argument("--repeats", type=int, default=3)
    http.add_argument("--busy", action="store_true", help="keep a process spinning on one core meanwhile")
    http.add_argument("--dejavu-args", default="", help="more options for dejavu serve (default: none: its "
                      "defaults are what is measured)")
    add_output_arguments(http, figures="each server's tokens/s per load and repeat, and the ratio")
    http.set_defaults(run=_bench_http)
