"""The public API is curated: `__all__` lists exactly the public names, and each resolves."""

from __future__ import annotations

import types

import pytest

import dejavu_sdk
import dejavu_sdk.stores
import dejavu_sdk.testing
import dejavu_sdk.transports


@pytest.mark.parametrize("module", [dejavu_sdk, dejavu_sdk.stores, dejavu_sdk.testing, dejavu_sdk.transports],
                         ids=lambda m: m.__name__)
def test_all_is_complete_and_resolves(module: types.ModuleType) -> None:
    public = {  # classes and functions that this package (or its submodules) defines
        name for name, value in vars(module).items()
        if not name.startswith("_") and isinstance(value, (type, types.FunctionType))
        and (value.__module__ == module.__name__ or value.__module__.startswith(module.__name__ + "."))
    }
    assert public <= set(module.__all__), f"public but not exported: {public - set(module.__all__)}"
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_errors_form_one_tree() -> None:
    suffixes = ("Error", "Unavailable", "NotFound", "Block", "Closed")
    errors = [getattr(dejavu_sdk, name) for name in dejavu_sdk.__all__ if name.endswith(suffixes)]
    assert all(issubclass(error, dejavu_sdk.DejaVuError) for error in errors)
    assert issubclass(dejavu_sdk.BlockNotFound, KeyError)
    assert issubclass(dejavu_sdk.ConfigError, ValueError)
    assert issubclass(dejavu_sdk.BackendUnavailable, ImportError)
