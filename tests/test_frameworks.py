"""Every registered framework module satisfies the `Framework` protocol (mismatch/frameworks/protocol.py):
its module-level names with their types, and its three functions with the protocol's signatures."""

from __future__ import annotations

import inspect
import typing
from types import ModuleType

import pytest

from mismatch.frameworks import registry
from mismatch.frameworks.protocol import Framework, Release

METHODS = ("express", "render", "metrics")


def _protocol_signature(name: str) -> inspect.Signature:
    """The protocol method's signature without `self`, its annotations resolved."""
    method = getattr(Framework, name)
    hints = typing.get_type_hints(method)
    params = [p.replace(annotation=hints[p.name]) for p in inspect.signature(method).parameters.values()
              if p.name != "self"]
    return inspect.Signature(params, return_annotation=hints["return"])


def _module_signature(module: ModuleType, name: str) -> inspect.Signature:
    function = getattr(module, name)
    hints = typing.get_type_hints(function)
    params = [p.replace(annotation=hints[p.name]) for p in inspect.signature(function).parameters.values()]
    return inspect.Signature(params, return_annotation=hints["return"])


def test_the_protocol_names_exactly_these_members() -> None:
    data = set(typing.get_type_hints(Framework))
    assert data == {"NAME", "PACKAGE", "RELEASES", "SETTINGS", "DEFAULTS"}
    assert all(callable(getattr(Framework, name)) for name in METHODS)


@pytest.mark.parametrize("module", registry.REGISTERED, ids=lambda m: m.NAME)
def test_each_registered_module_satisfies_the_protocol(module: ModuleType) -> None:
    assert isinstance(module.NAME, str) and module.NAME
    assert module.PACKAGE is None or isinstance(module.PACKAGE, str)
    assert isinstance(module.RELEASES, tuple) and module.RELEASES
    assert all(isinstance(release, Release) for release in module.RELEASES)
    assert isinstance(module.SETTINGS, dict) and all(callable(parse) for parse in module.SETTINGS.values())
    assert isinstance(module.DEFAULTS, dict)
    assert set(module.DEFAULTS) <= set(module.SETTINGS), "a default for a setting --for cannot take"
    for name in METHODS:
        assert _module_signature(module, name) == _protocol_signature(name), f"{module.NAME}.{name}"


def test_the_registry_is_one_tuple_and_the_names_come_from_it() -> None:
    assert registry.FRAMEWORKS == tuple(module.NAME for module in registry.REGISTERED)
    assert list(registry.MODULES.values()) == list(registry.REGISTERED)
    assert len(set(registry.FRAMEWORKS)) == len(registry.FRAMEWORKS)


def test_frameworks_import_nothing_of_advise() -> None:
    """frameworks/ sits below advise/ (ARCHITECTURE.md layers): its modules, TYPE_CHECKING blocks
    included, name no advise module."""
    from conftest import REPO

    for file in sorted((REPO / "mismatch" / "frameworks").glob("*.py")):
        assert "mismatch.advise" not in file.read_text(), file.name
