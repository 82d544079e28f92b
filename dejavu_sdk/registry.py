"""Lazy name -> backend registries: only the chosen backend's module is imported.

Each axis (stores, transports) has one `Registry` of built-in backends, named by URL scheme, with the
extra to install when a backend's dependency is missing; third-party packages add backends through an
entry-point group: `[project.entry-points."dejavu_sdk.stores"] myscheme = "mypkg.mod:MyRecords"` names a
`RecordStore`, and the `dejavu_sdk.transports` group names a `Transport`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

import attrs

from .errors import BackendUnavailable, ConfigError


@attrs.frozen
class Backend:
    """Where a backend class lives (`"module:Class"`) and which extra of dejavu-sdk provides its dependency."""

    target: str
    extra: str | None = None

    @property
    def install_hint(self) -> str | None:
        return f"pip install 'dejavu-sdk[{self.extra}]'" if self.extra else None


class Registry:
    """Resolves a scheme to a backend class, importing nothing until asked."""

    def __init__(self, kind: str, entry_point_group: str, builtins: dict[str, Backend]) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.builtins = builtins

    def _entry_points(self) -> dict[str, Backend]:
        found = importlib.metadata.entry_points(group=self.entry_point_group)
        return {entry.name: Backend(entry.value) for entry in found}

    def names(self) -> list[str]:
        """Every scheme this registry can resolve: built-ins and installed third-party backends."""
        return sorted({*self.builtins, *self._entry_points()})

    def find(self, scheme: str) -> Backend | None:
        return self.builtins.get(scheme) or self._entry_points().get(scheme)

    def load(self, scheme: str, backend: Backend, kind: type[Any]) -> type[Any]:
        """Import the class `backend` names, which must be a subclass of `kind`; BackendUnavailable with an
        install hint if a dependency is missing.

        `kind` is typed `type[Any]`, not `type[T]`, because it is usually an abstract base (RecordStore,
        Transport), which mypy refuses where `type[T]` is expected; callers annotate what they get back."""
        module_name, _, attribute = backend.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            missing = error.name or str(error)
            raise BackendUnavailable(
                f"the {scheme}:// {self.kind} needs the package {missing!r}, which is not installed",
                hint=backend.install_hint or f"pip install {missing}",
            ) from error
        found = getattr(module, attribute, None)
        if found is None:
            raise ConfigError(f"{self.kind} backend {backend.target!r} for {scheme}:// does not exist")
        if not (isinstance(found, type) and issubclass(found, kind)):
            raise ConfigError(f"{self.kind} backend {backend.target!r} for {scheme}:// is not a {kind.__name__}")
        return found


def call_with_options(factory: Callable[..., Any], what: str, options: dict[str, Any], *args: Any) -> Any:
    """Call `factory(*args, **options)`, rejecting options it would not use with a ConfigError naming them."""
    parameters = inspect.signature(factory).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        accepted = {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
        unused = sorted(set(options) - accepted)
        if unused:
            raise ConfigError(
                f"option(s) {', '.join(unused)} would not be used by {what}; "
                f"it accepts: {', '.join(sorted(accepted)) or 'no options'}"
            )
    return factory(*args, **options)
