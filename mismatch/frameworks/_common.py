"""What the framework modules share besides the protocol's types: the read release that serves a
version, the parsers of the settings --for NAME:KEY=VALUE takes, and YAML values as the
frameworks' loaders read them back."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
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


# A number as a config file spells it: digits, at most one dot, an optional exponent. Python's float()
# also takes "1_2" (12.0), "nan", "inf" and "1e999" (inf); none of them is a threshold a release takes
# as meant ("1_2" is verl's [1, 2] band), so each is refused here rather than read otherwise.
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def number(text: str, *, positive: bool = True) -> float:
    """A finite float spelt with digits, one dot and an exponent; positive unless `positive` is False
    (then non-negative). ValueError naming the text otherwise."""
    stripped = text.strip()
    if not _NUMBER.fullmatch(stripped):
        raise ValueError(f"{text!r} is not a number (digits, one dot, an exponent)")
    value = float(stripped)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is out of range")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{text!r} must be {'positive' if positive else 'non-negative'}")
    return value


def non_negative(text: str) -> float:
    return number(text, positive=False)


def optional_float(text: str) -> float | None:
    """A positive number, or null / none for no bound."""
    if text.strip().lower() in ("null", "none", ""):
        return None
    return number(text)


def one_of(*choices: str, optional: bool = False) -> Callable[[str], str | None]:
    """A parser that takes one of `choices` (and null / none when `optional`)."""
    def parse(text: str) -> str | None:
        if optional and text.strip().lower() in ("null", "none", ""):
            return None
        if text.strip() not in choices:
            raise ValueError(f"{text!r} is not one of: {', '.join(choices)}")
        return text.strip()
    return parse


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
