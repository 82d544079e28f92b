"""`dejavu serve-store`: hold a store in this process and serve it to peers until SIGTERM or Ctrl-C.

This is the remote CPU tier that `tcp://` and `ucx://` store URLs reach (and `nccl://` transports);
`dejavu_sdk.testing.peers` starts it in a child process for tests and benchmarks. The store and the server
come from the package's public `open_store` and `serve`. Peers need a token when the server has any
(`--token-file`, or `DEJAVU_TOKEN`); listening beyond loopback without one is refused unless `--insecure`.
Nobody reads a store server's inbox, so it refuses tensors.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import os
import sys
from typing import Any

from ..controller import limits


def _serve_store(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    import dejavu_sdk

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    options = {**_access_options(args), **_limit_options(args)}
    _give_back_large_buffers()
    with dejavu_sdk.open_store(args.store) as store, \
            dejavu_sdk.serve(args.listen, store, accept_tensors=False, **options) as server:
        print(f"serving {store.url} at {server.url}", flush=True)
        stop.wait()
        logging.info("stopping")
    return 0


def _give_back_large_buffers() -> None:
    """With glibc, give every buffer of 256 KiB or more a mapping of its own, returned to the system when it is
    freed: glibc raises that threshold as large buffers come and go (a server's copies for its readers), then
    keeps what they freed, so a server whose readers have left would keep their memory."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # another C library
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 256 << 10)


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    """What a store server holds at most, whoever connects (docs/transports.md, "Limits")."""
    from dejavu_sdk.report import parse_size
    from dejavu_sdk.transports import base

    parser.add_argument("--max-inflight-bytes", type=parse_size, default=base.MAX_INFLIGHT_BYTES, help="memory for "
                        "records on their way in or out (copies out of LMDB, records being received), all connections "
                        "together: 4096, 512KiB, 64MiB, 1GiB (default 256MiB); a transfer waits for room up to 10 s "
                        "(at most --timeout), then gets ServerBusy")
    parser.add_argument("--max-connections", type=int, default=base.MAX_CONNECTIONS, help="authenticated "
                        f"connections at once; one more gets ServerBusy (default {base.MAX_CONNECTIONS})")
    parser.add_argument("--max-unauthenticated", type=int, default=base.MAX_UNAUTHENTICATED, help="tcp: connections "
                        "that have not said HELLO yet, held apart from --max-connections; when full, the oldest is "
                        f"dropped (default {base.MAX_UNAUTHENTICATED})")
    parser.add_argument("--hello-timeout", type=float, default=base.HELLO_TIMEOUT, help="seconds a connection has "
                        f"to say HELLO, TLS handshake included (default {base.HELLO_TIMEOUT:g})")
    parser.add_argument("--workers", type=int, default=base.WORKERS, help="tcp: threads that answer requests, "
                        f"whatever the number of connections (default {base.WORKERS})")
    parser.add_argument("--timeout", type=float, default=base.SERVER_TIMEOUT, help="seconds a request has to "
                        "arrive whole from its first byte, and a reply to be read, else the connection is dropped "
                        f"(default {base.SERVER_TIMEOUT:g})")
    parser.add_argument("--idle-timeout", type=float, default=base.IDLE_TIMEOUT, help="seconds a connection may "
                        f"send no request before it is closed (default {base.IDLE_TIMEOUT:g})")


def _limit_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {"max_inflight_bytes": args.max_inflight_bytes, "max_connections": args.max_connections,
               "timeout": args.timeout, "idle_timeout": args.idle_timeout, "hello_timeout": args.hello_timeout}
    if args.listen.startswith("tcp://"):
        options.update(max_unauthenticated=args.max_unauthenticated, workers=args.workers)
    return options


def _access_options(args: argparse.Namespace) -> dict[str, Any]:
    """The server's token and TLS options; refuses an open server beyond loopback unless `--insecure`."""
    from dejavu_sdk.errors import ConfigError
    from dejavu_sdk.transports.access import TOKEN_VARIABLE, read_token_file
    from dejavu_sdk.urls import network_address, parse_url

    tokens = read_token_file(args.token_file) if args.token_file else None
    token = (os.environ.get(TOKEN_VARIABLE) or None) if tokens is None else None
    host, _ = network_address(parse_url(args.listen))
    if tokens is None and token is None and not _is_loopback(host) and not args.insecure:
        raise ConfigError(f"{args.listen} is reachable from other machines, and without a token anyone who "
                          "reaches it can read, overwrite and delete every stream: give --token-file (or "
                          f"{TOKEN_VARIABLE}) and, across networks you do not trust, --tls-cert/--tls-key; "
                          "or pass --insecure")
    options: dict[str, Any] = {"token": token, "tokens": tokens}
    if args.tls_cert or args.tls_key:
        options.update(tls_cert=args.tls_cert, tls_key=args.tls_key)
    return options


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _controller_arguments(parser: Any) -> None:
    """The options `serve` and `controller` share: the model and its layout, the API, tokens, recovery."""
    parser.add_argument("--model", required=True, help="smollm2, a local Hugging Face directory, or module:function")
    parser.add_argument("--stages", type=int, default=1, help="stages of one mixed pipeline (default 1)")
    parser.add_argument("--prompt-stages", type=int, help="disaggregated: stages of the prompt pipeline")
    parser.add_argument("--token-stages", type=int, help="disaggregated: stages of the token pipeline")
    parser.add_argument("--microbatch", type=int, help="rows each slot holds (default: chosen from this "
                        "machine's cores and memory and the model's KV size; shown at start and in /v1/status)")
    parser.add_argument("--threads", type=int, help="torch threads of each stage process, fixed (default: this "
                        "machine's cores shared between the stages, following the cores other processes leave idle)")
    parser.add_argument("--transport", default="tcp", help="how stages move activations and KV (tcp, gloo, nccl, "
                        "ucx)")
    parser.add_argument("--listen", default="127.0.0.1:8000", help="host:port of the HTTP API (port 0: any free "
                        "port; the URL is printed)")
    parser.add_argument("--token-file", help="tokens clients present, one per line (a request is read back and "
                        "resumed with the token that made it alone); default: DEJAVU_TOKEN, else a random token "
                        "printed at start")
    parser.add_argument("--worker-token-file", help="a file whose first token secures the stage workers' links "
                        "(and lets `dejavu worker --controller` ask where to join); it must differ from every client "
                        "token; default: DEJAVU_WORKER_TOKEN, else a random one (enough for workers started here)")
    parser.add_argument("--insecure", action="store_true", help="listen beyond loopback with a printed random token")
    parser.add_argument("--recovery", choices=["auto", "replicas", "recompute", "none"], default="auto",
                        help="when a stage dies: replace it and resume from the replicas the decoding stages keep of "
                        "each other (replicas; needs two token stages or more), start the requests in flight over "
                        "(recompute), or fail them (none); auto: the first of these the layout allows")
    parser.add_argument("--replica-store", help="with recovery from replicas: a store every worker reaches "
                        "(file:// on a shared file system, s3://...) that keeps the replicas instead of the next "
                        "token stage, so that they outlive any stage")
    parser.add_argument("--worker-listen", default="127.0.0.1:0", help="host:port where stage workers join "
                        "(default: loopback, any free port)")
    parser.add_argument("--ignore-eos", action="store_true", help="every request generates its max_tokens, past "
                        "end-of-sequence tokens (benchmarks)")
    parser.add_argument("--batching", choices=["continuous", "static"], help="continuous: rows leave a microbatch "
                        "as they end and waiting requests join it between steps (the default); static: a "
                        "microbatch runs until its last row ends")
    parser.add_argument("--swapping", choices=["auto", "on", "off"], default="auto", help="keep the decoding "
                        "stages' KV caches in host memory with two on the device, brought in while the previous "
                        "microbatch computes (on), or all on the device (off); auto: swap when the microbatches in "
                        "flight would not fit the device otherwise and the copies keep up")
    parser.add_argument("--max-prefill-tokens", type=int, default=256, help="prompt positions a step prefills: a "
                        "long prompt runs in chunks, beside decoding rows (default 256)")
    parser.add_argument("--prefix-cache", nargs="+", metavar="URL", help="tiers, fastest first, where every "
                        "stage keeps each prompt's KV in chunks keyed by their tokens (memory://?max_bytes=2GiB, "
                        "lmdb://PATH, file://PATH, s3://BUCKET/PATH, a tcp:// store server): a prompt starts from the "
                        "chunks every stage holds; each client token's are its own (a body's cache_salt names "
                        "another); usage.prompt_tokens_details.cached_tokens says how many a request read")
    parser.add_argument("--prefix-chunk", type=int, default=256, help="positions of a prefix chunk (default 256; "
                        "--max-prefill-tokens must be the same)")
    parser.add_argument("--served-model-name", nargs="+", help="the names clients use for the model (default: "
                        "--model); /v1/models lists each")
    parser.add_argument("--max-waiting", type=int, default=limits.MAX_WAITING, help="choices waiting to start "
                        f"at most; past it a request gets a 429 (default {limits.MAX_WAITING})")
    parser.add_argument("--max-prompts", type=int, default=limits.MAX_PROMPTS, help="choices (prompts times n) "
                        f"in one request at most, else a 400 (default {limits.MAX_PROMPTS})")
    parser.add_argument("--tls-cert", help="PEM certificate chain: the API answers HTTPS only")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    _link_tls_arguments(parser)
    parser.add_argument("--journal", help="a store URL that outlives this process (lmdb://, file://, s3://, a tcp:// "
                        "store server): every admitted request and every streamed token is recorded there; a "
                        "controller started on the journal of one that died goes on with its requests")
    parser.add_argument("--keep-finished", type=float, default=limits.KEEP_FINISHED, help="seconds an ended "
                        "request stays readable at /v1/requests/<id> and its stream resumable (default "
                        f"{limits.KEEP_FINISHED:.0f}; at most {limits.MAX_KEPT:,} ended requests are kept)")
    _journal_arguments(parser)
    parser.add_argument("--orphan-timeout", type=float, help="seconds a stage worker whose controller is gone "
                        "keeps its stage loaded and asks the worker address to take it back (a controller started on "
                        "the same --journal rejoins it), before it stops (default: dv.Pipeline's orphan_timeout, "
                        "60; 0: at once)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGTERM: seconds the requests in "
                        "flight have to finish (new ones get 503) before the workers stop (default 30)")
    parser.add_argument("--progress-timeout", type=float, default=60.0, help="seconds a microbatch may go "
                        "without a token while no stage computes before its stage counts as stuck and is recovered "
                        "(default 60); a stage busy with a long prompt says so in its heartbeats")
    parser.add_argument("--queue-timeout", type=float, default=limits.QUEUE_TIMEOUT, help="seconds a request may "
                        f"wait to start, then a 503 (default {limits.QUEUE_TIMEOUT:.0f})")


def _journal_arguments(parser: argparse.ArgumentParser) -> None:
    """What the controller does when its journal fails, is held by another, or lost its records."""
    parser.add_argument("--journal-failure", choices=limits.JOURNAL_FAILURES, default="stop", help="while "
                        "journal writes fail (tried again every second): stop (the default): new requests get 503 "
                        "journal_failed, /health too, and no token the journal does not hold is sent (a stream "
                        "waiting 30 s for it ends with an error); serve: serve on without it, /health 200 degraded")
    parser.add_argument("--journal-lease", type=float, default=limits.JOURNAL_LEASE, help="seconds the journal's lease "
                        "lasts unless renewed (every quarter of it): one controller writes a journal at a time, and "
                        "a successor waits up to this long for a dead one's lease to lapse (default "
                        f"{limits.JOURNAL_LEASE:g})")
    parser.add_argument("--take-over-journal", action="store_true", help="take the journal's lease at once, even "
                        "if another controller renews it (use only when that one is gone for good)")
    parser.add_argument("--journal-reset", action="store_true", help="start the journal empty, discarding what "
                        "it holds: needed where it lost its records (an LMDB data.mdb of 0 bytes, records without "
                        "their head), which is otherwise refused")


def _link_tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link-tls-cert", help="PEM certificate the pipeline's inboxes (the head's, each stage "
                        "worker's) serve: TLS on every link between them (tcp; all three --link-tls-* together)")
    parser.add_argument("--link-tls-key", help="PEM private key of --link-tls-cert")
    parser.add_argument("--link-tls-ca", help="PEM certificate authority the links verify their peers against "
                        "(--link-tls-cert itself when it signs itself)")


def add_serving_commands(commands: Any) -> None:
    """Register `serve-store`, `serve`, `controller` and `worker` on the `dejavu` command's subparsers."""
    serve_store = commands.add_parser("serve-store", help="hold a store in this process and serve it to peers "
                                      "(the remote CPU tier); stops on SIGTERM or Ctrl-C")
    serve_store.add_argument("--listen", required=True, help="tcp://host:port, ucx://host:port or nccl://host:port "
                             "(port 0: any free port; the URL is printed)")
    serve_store.add_argument("--store", default="memory://", help="the store to serve (default: memory://)")
    serve_store.add_argument("--token-file", help="tokens peers must present, one per line: TOKEN (every stream) "
                             "or TOKEN PREFIX (only stream ids starting with PREFIX); default: the single token "
                             "in DEJAVU_TOKEN, if set")
    serve_store.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS (tcp:// only)")
    serve_store.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve_store.add_argument("--insecure", action="store_true", help="listen beyond loopback without a token")
    _limit_arguments(serve_store)
    serve_store.set_defaults(run=_serve_store)

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API, with its stage "
                                "workers on this machine; stops on SIGTERM or Ctrl-C")
    _controller_arguments(serve)
    serve.add_argument("--standby", type=int, default=0, help="spare workers kept with the model loaded, which "
                       "replace a dead stage at once (default 0: a new process starts when one is needed)")
    serve.add_argument("--remote-workers", action="store_true", help="start no stage worker here: each joins with "
                       "`dejavu worker --controller URL` on its own machine, in stage order (as `dejavu controller`)")
    serve.set_defaults(run=_serve)

    controller = commands.add_parser("controller", help="the controller alone: the OpenAI-compatible API, and the "
                                     "head that stage workers started anywhere join (`dejavu worker --controller "
                                     "URL`); stops on SIGTERM or Ctrl-C")
    _controller_arguments(controller)
    controller.set_defaults(run=_serve, remote_workers=True, standby=0)

    worker = commands.add_parser("worker", help="join a pipeline's head and serve the stage it assigns; stops when "
                                 "the head says so or is gone")
    where = worker.add_mutually_exclusive_group(required=True)
    where.add_argument("--controller", help="the controller's URL, http://host:port: the worker asks it where to "
                       "join (its token, the controller's worker token: --token, --token-file, else "
                       "DEJAVU_WORKER_TOKEN)")
    where.add_argument("--join", help="the head's URL, tcp://host:port (printed by the head; its token comes from "
                       "DEJAVU_TOKEN)")
    secret = worker.add_mutually_exclusive_group()
    secret.add_argument("--token", help="the controller's worker token (visible to other users of this machine in "
                        "the process list: prefer --token-file or DEJAVU_WORKER_TOKEN where that matters)")
    secret.add_argument("--token-file", help="a file whose first token is the controller's worker token (default: "
                        "DEJAVU_WORKER_TOKEN, else DEJAVU_TOKEN)")
    worker.add_argument("--host", default="127.0.0.1", help="the address this worker listens on for its neighbours "
                        "(default: loopback)")
    worker.add_argument("--threads", type=int, help="torch threads for this stage (default: the head's choice)")
    worker.add_argument("--worker-id", help="a name for this worker that is unique in the deployment (a "
                        "supervisor's or scheduler's id; process ids collide across machines), sent when it joins")
    worker.add_argument("--orphan-timeout", type=float, help="once its controller is gone: seconds it keeps its "
                        "stage loaded and asks the controller's worker address to take it back (a successor on the "
                        "same journal), before it stops (default: the controller's --orphan-timeout)")
    _link_tls_arguments(worker)
    worker.set_defaults(run=_worker)


def _serve(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    if not args.remote_workers:  # the workers' zygote imports while this process loads the model
        from dejavu_sdk.serving.processes.zygote import prestart

        prestart()
    import torch

    torch.set_num_threads(1)  # this process runs the head and the front door: the stage processes take the cores
    from dejavu_sdk.controller import Controller
    from dejavu_sdk.controller.controller import WORKER_TOKEN_VARIABLE
    from dejavu_sdk.errors import ConfigError
    from dejavu_sdk.transports.access import TOKEN_VARIABLE, read_token_file
    from dejavu_sdk.urls import split_host_port

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    host, port = split_host_port(args.listen)
    tokens = list(read_token_file(args.token_file)) if args.token_file else []
    if not tokens and not os.environ.get(TOKEN_VARIABLE) and not _is_loopback(host) and not args.insecure:
        raise ConfigError(f"{args.listen} is reachable from other machines: give --token-file (or {TOKEN_VARIABLE}) "
                          "so that clients need a token, or pass --insecure to use a random one printed here")
    layout: dict[str, Any] = {}
    if args.prompt_stages is not None or args.token_stages is not None:
        layout = {"prompt_stages": args.prompt_stages, "token_stages": args.token_stages}
    else:
        layout = {"stages": args.stages}
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    worker_host, worker_port = split_host_port(args.worker_listen)
    worker_tokens = list(read_token_file(args.worker_token_file)) if args.worker_token_file else []
    if args.worker_token_file and not worker_tokens:
        raise ConfigError(f"the token file {args.worker_token_file!r} holds no token")
    if args.remote_workers and not worker_tokens and not os.environ.get(WORKER_TOKEN_VARIABLE):
        raise ConfigError(f"--remote-workers: workers elsewhere present the workers' token: give --worker-token-file "
                          f"(or {WORKER_TOKEN_VARIABLE}) and the same to each `dejavu worker --controller`")
    with Controller(args.model, host=host, port=port, token=tokens[0] if tokens else None, tokens=tokens[1:],
                    worker_token=worker_tokens[0] if worker_tokens else None,
                    microbatch=args.microbatch, threads=args.threads, transport=args.transport, standby=args.standby,
                    recovery=None if args.recovery == "none" else args.recovery, worker_host=worker_host,
                    replica_store=args.replica_store, ignore_eos=args.ignore_eos, batching=args.batching,
                    swapping={"on": True, "off": False}.get(args.swapping, args.swapping),
                    max_prefill_tokens=args.max_prefill_tokens, served_model_name=args.served_model_name,
                    prefix_cache=args.prefix_cache, prefix_chunk=args.prefix_chunk,
                    max_waiting=args.max_waiting, max_prompts=args.max_prompts, queue_timeout=args.queue_timeout,
                    tls_cert=args.tls_cert, tls_key=args.tls_key, link_tls_cert=args.link_tls_cert,
                    link_tls_key=args.link_tls_key, link_tls_ca=args.link_tls_ca, journal=args.journal,
                    keep_finished=args.keep_finished, journal_failure=args.journal_failure,
                    journal_lease=args.journal_lease, take_over_journal=args.take_over_journal,
                    journal_reset=args.journal_reset, worker_port=worker_port,
                    progress_timeout=args.progress_timeout,
                    **({} if args.orphan_timeout is None else {"orphan_timeout": args.orphan_timeout}),
                    launch=not args.remote_workers, **layout) as controller:
        print(f"serving {args.model} at {controller.url}/v1 (OpenAI-compatible; Authorization: Bearer <token>)",
              flush=True)
        if not tokens and not os.environ.get(TOKEN_VARIABLE):
            print(f"token: {controller.token}", flush=True)
        status = controller.pipeline.status()
        print(f"{status['layout']} layout of {len(status['stages'])} stage(s), {status['batching']} batching, "
              f"recovery {status['recovery']}; {status['defaults']['why']}", flush=True)
        stop.wait()
        logging.info("draining: no new requests; up to %.0f s for those in flight", args.drain_timeout)
        if controller.drain(args.drain_timeout):
            logging.info("drained: every request finished; stopping the workers")
        else:
            logging.warning("the drain timeout passed with requests in flight: they fail as the workers stop")
    return 0


def _worker(args: argparse.Namespace) -> int:
    from dejavu_sdk.errors import ConfigError
    from dejavu_sdk.transports.access import TOKEN_VARIABLE, read_token_file

    from ..controller.controller import WORKER_TOKEN_VARIABLE
    from ..controller.workers import ask_where_to_join
    from ..serving.processes.bootstrap import run_worker
    from ..serving.wire.link_tls import LinkTls

    if args.token:
        os.environ[TOKEN_VARIABLE] = args.token  # the links to the head and the neighbours present it too
    elif args.token_file:
        tokens = list(read_token_file(args.token_file))
        if not tokens:
            raise ConfigError(f"the token file {args.token_file!r} holds no token")
        os.environ[TOKEN_VARIABLE] = tokens[0]
    elif os.environ.get(WORKER_TOKEN_VARIABLE):
        os.environ[TOKEN_VARIABLE] = os.environ[WORKER_TOKEN_VARIABLE]
    tls = LinkTls.of(args.link_tls_cert, args.link_tls_key, args.link_tls_ca)
    if tls is not None:  # every link the worker opens, and its inbox, take them from its environment
        os.environ.update(tls.environment())
    join = args.join or ask_where_to_join(args.controller, os.environ.get(TOKEN_VARIABLE))
    run_worker(join, host=args.host, threads=args.threads, worker_id=args.worker_id,
               orphan_timeout=args.orphan_timeout)
    return 0
