"""`dejavu serve-store`: hold a store in this process and serve it to peers until SIGTERM or Ctrl-C.

This is the remote CPU tier that `tcp://` and `ucx://` store URLs reach (and `nccl://` transports);
`dejavu_sdk.testing.peers` starts it in a child process for tests and benchmarks. The store and the server
come from the package's public `open_store` and `serve`.
"""

from __future__ import annotations

import argparse
from typing import Any


def _serve_store(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    import dejavu_sdk

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with dejavu_sdk.open_store(args.store) as store, dejavu_sdk.serve(args.listen, store) as server:
        print(f"serving {store.url} at {server.url}", flush=True)
        stop.wait()
        logging.info("stopping")
    return 0


def add_serving_commands(commands: Any) -> None:
    """Register `serve-store` on the `dejavu` command's subparsers."""
    serve_store = commands.add_parser("serve-store", help="hold a store in this process and serve it to peers "
                                      "(the remote CPU tier); stops on SIGTERM or Ctrl-C")
    serve_store.add_argument("--listen", required=True, help="tcp://host:port, ucx://host:port or nccl://host:port "
                             "(port 0: any free port; the URL is printed)")
    serve_store.add_argument("--store", default="memory://", help="the store to serve (default: memory://)")
    serve_store.set_defaults(run=_serve_store)
