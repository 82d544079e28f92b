"""The controller: a pipeline's head as a service, with an OpenAI-compatible HTTP API (`Controller`,
`dejavu serve`)."""

from .controller import Controller

__all__ = ["Controller"]
