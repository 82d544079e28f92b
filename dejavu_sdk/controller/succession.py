"""What a controller takes over from its predecessor on the same journal: the address its stage workers rejoin
(`former_port`) and requests standing in for the ended rows of a microbatch it goes on with (`stand_in`); what it
says it took over is `adoption.Adoption`."""

from __future__ import annotations

import logging
import socket
import urllib.parse
from typing import Any

import torch

from ..errors import ConfigError
from ..generation.batching import Request
from ..generation.decoding import Decoding
from .journal import JournalState

log = logging.getLogger(__name__)


def stand_in(found: JournalState, tag: Any) -> Request | None:
    """A request like journaled choice `tag` ([request id, choice]), for a row of a microbatch taken over whose
    choice ended; None if the journal (what the successor `found` in it) no longer holds it."""
    journaled = found.requests.get(str(tag[0]))
    if journaled is None or not 0 <= int(tag[1]) < len(journaled.admitted["choices"]):
        return None
    choice = journaled.request().choices[int(tag[1])]
    try:
        return Request(torch.tensor(choice.prompt, dtype=torch.long), choice.max_tokens, Decoding.of(**choice.decoding))
    except ConfigError:
        return None


def former_port(url: str, host: str) -> int:
    """The port of a predecessor's worker address `url`, to listen on again when it is free and on `host`; else 0
    (any free port: its workers, which could not reach it, stop after their orphan timeout)."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname != host.strip("[]") or parts.port is None:
        return 0
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host.strip("[]"), parts.port))
    except OSError as error:
        log.warning("the former controller's worker address %s is taken (%s): its workers cannot rejoin", url, error)
        return 0
    return parts.port
