"""The controller: a pipeline's head as a service, with an OpenAI-compatible HTTP API (`Controller`,
`dejavu serve`). `Controller` is imported on first use: the command line reads `limits` without loading a server."""

from __future__ import annotations

from typing import Any

__all__ = ["Controller"]


def __getattr__(name: str) -> Any:
    if name == "Controller":
        from .controller import Controller

        return Controller
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
