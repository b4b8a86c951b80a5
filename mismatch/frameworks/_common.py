"""What the framework modules share besides the protocol's types: the read release that serves a
version, the parsers of the settings --for NAME:KEY=VALUE takes, and YAML values as the
frameworks' loaders read them back."""

from __future__ import annotations

from typing import Any

from mismatch.frameworks.protocol import Release


def _versioned(releases: tuple[Release, ...]) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        for release in releases:
            Version(release.version)
    except InvalidVersion:
        return False
    return True


def nearest_release(releases: tuple[Release, ...], version: str | None) -> tuple[Release, str]:
    """The release whose keys serve `version`: the newest read release not newer than it (keys hold
    from a release until one we read changes them), else the oldest; a note when `version` is not a
    release we read. None: the newest."""
    from packaging.version import InvalidVersion, Version

    newest = releases[-1]
    if version is None:
        return newest, ""
    if not _versioned(releases):  # commits: a prefix of one names it
        named = [r for r in releases if r.version.startswith(version) or version.startswith(r.version)]
        return (named[0], "") if named else (newest, f"{version} is not a commit mismatch has read: the keys "
                                                     f"below are {newest.version}'s ({newest.read_from})")
    try:
        asked = Version(version)
    except InvalidVersion:
        raise ValueError(f"{version!r} is not a version") from None
    read = sorted(releases, key=lambda r: Version(r.version))
    exact = [r for r in read if Version(r.version) == asked]
    if exact:
        return exact[0], ""
    older = [r for r in read if Version(r.version) < asked]
    chosen = older[-1] if older else read[0]
    where = ("newer than any release mismatch has read" if chosen is read[-1] and older
             else "older than any release mismatch has read" if not older else "not a release mismatch has read")
    return chosen, (f"{version} is {where} ({', '.join(r.version for r in read)}): "
                    f"the keys below are {chosen.version}'s, the nearest")


# --- settings given on the command line (--for NAME:KEY=VALUE), parsed ---

def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


def optional_float(text: str) -> float | None:
    """A float, or null / none for no bound."""
    if text.strip().lower() in ("null", "none", ""):
        return None
    return float(text)


def optional_str(text: str) -> str | None:
    return None if text.strip().lower() in ("null", "none", "") else text.strip()


def yaml_scalar(value: Any) -> str:
    """A YAML value as the frameworks' loaders read it back: null, true/false, a float's repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str) and not value.isidentifier():  # "0.5_5.0" must stay a string
        return f'"{value}"'
    return str(value)
