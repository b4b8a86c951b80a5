"""The registry: the one tuple of framework modules (each a `Framework`, protocol.py), the name ->
module map made from it, and `--for NAME[==VERSION][:KEY=VALUE,...]` resolved to a `Target`."""

from __future__ import annotations

from importlib import metadata

from mismatch.errors import MismatchError
from mismatch.frameworks import areal, openrlhf, prime_rl, slime, trl, verl
from mismatch.frameworks._common import nearest_release
from mismatch.frameworks.protocol import Framework, Target

# Every framework mismatch knows, in the order snippets and metrics list them: add a new module here.
REGISTERED: tuple[Framework, ...] = (verl, trl, slime, prime_rl, openrlhf, areal)
MODULES: dict[str, Framework] = {found.NAME: found for found in REGISTERED}
FRAMEWORKS = tuple(MODULES)


def module(name: str) -> Framework:
    found = MODULES.get(name)
    if found is None:
        raise MismatchError(f"unknown framework {name!r} (valid: {', '.join(FRAMEWORKS)})")
    return found


def installed_version(name: str) -> str | None:
    """The framework's version in this Python environment (its package metadata; nothing is
    imported), or None when it is not installed or publishes no package."""
    package = module(name).PACKAGE
    if package is None:
        return None
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def parse_target(text: str, *, detect: bool = True) -> Target:
    """`NAME[==VERSION][:KEY=VALUE,...]`: the framework, the release to target (the one installed
    here when `detect` and none is named, else the newest read), and the correction settings the
    user runs, under the framework's own names (each module's SETTINGS)."""
    head, _, options = text.partition(":")
    name, _, version = head.partition("==")
    found = module(name.strip())
    asked = version.strip() or (installed_version(found.NAME) if detect else None)
    try:
        release, note = nearest_release(found.RELEASES, asked)
    except ValueError as error:
        raise MismatchError(f"{text}: {error}") from None
    if asked is not None and not version and note:
        note = f"{found.NAME} {asked} is installed here; {note}"
    settings = _settings(found, options, text) if options else {}
    return Target(framework=found.NAME, release=release, settings=settings, asked=asked, note=note)


def _settings(found: Framework, options: str, text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in options.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in found.SETTINGS:
            valid = ", ".join(found.SETTINGS) or "none"
            raise MismatchError(f"{text}: {found.NAME} has no correction setting {key!r} "
                                f"(valid: {valid})")
        try:
            out[key] = found.SETTINGS[key](value.strip())
        except ValueError as error:
            raise MismatchError(f"{text}: {key}: {error}") from None
    try:  # the settings together, as the metrics will use them: a bad combination costs no replay
        found.metrics({**found.DEFAULTS, **out})
    except (ValueError, KeyError, TypeError) as error:
        raise MismatchError(f"{text}: {error}") from None
    return out


def default_target(name: str) -> Target:
    """The target a snippet in summary.json is written for: the release installed here, else the newest read."""
    return parse_target(name)
