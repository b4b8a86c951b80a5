"""The rollouts file pinned for one run: its size and digest as the run's inputs took them at the
start (summary.json `inputs`), every read held to that size, the digest checked after each pass.

A live `mismatch record` file grows while it is audited: the run audits the lines it had. A file
rewritten under a run would mix two contents in one token table: refused, nothing published.
The check hashes the pinned bytes again, unless this process hashed the whole file to the pinned
digest and the file's stat stamp (size, mtime, ctime, inode) has held since, as git trusts an
index entry's (results.staging.unchanged_since_digest; a stamp too fresh to vouch is never trusted).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mismatch.errors import RolloutError
from mismatch.results.staging import unchanged_since_digest

T = TypeVar("T")
_CHUNK = 1 << 20


def prefix_digest(path: str | os.PathLike[str], size: int) -> str:
    """SHA-256 of the file's first `size` bytes (of the whole file when it has no more: the
    digest identity.file_digest takes of it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        left = size
        while left > 0 and (chunk := handle.read(min(left, _CHUNK))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


@dataclass(kw_only=True, slots=True, frozen=True)
class Pinned:
    """The rollouts file as a run found it: its size, and the SHA-256 of those bytes."""

    size: int
    digest: str

    @classmethod
    def of_inputs(cls, rollouts: dict[str, Any] | None) -> Pinned | None:
        """The pin `identity.run_inputs` recorded (its "rollouts": {"size", "digest"}), if any."""
        if not isinstance(rollouts, dict) or not {"size", "digest"} <= rollouts.keys():
            return None
        return cls(size=int(rollouts["size"]), digest=str(rollouts["digest"]))

    @classmethod
    def take(cls, path: str | os.PathLike[str]) -> Pinned | None:
        """The file as it is now (None when it is not a file: the reader names that)."""
        if not Path(path).is_file():
            return None
        size = Path(path).stat().st_size
        return cls(size=size, digest=prefix_digest(path, size))

    def check(self, path: str | os.PathLike[str]) -> None:
        """RolloutError unless the file's first `size` bytes are still the pinned ones (bytes
        appended after them are another run's)."""
        if unchanged_since_digest(path, self.digest):
            return  # this process hashed the whole file (those bytes: the same digest), and its stamp has not moved since
        try:
            now = prefix_digest(path, self.size)
        except OSError as exc:
            now = f"unreadable: {exc.strerror or exc}"
        if now != self.digest:
            raise RolloutError(f"changed during the run (digest {self.digest[:16]} of its first {self.size} bytes "
                               f"at the start, {now[:16]} now); nothing published; rerun (--force discards the "
                               "blocks replayed before the change)", file=os.fspath(path))


def pinned_pass(path: str | os.PathLike[str], pinned: Pinned | None, items: Callable[[], Iterable[T]]) -> Iterator[T]:
    """One pass over what `items()` reads of the file, checked against the pin once it is done. A
    bad line met while the file changed is reported as the change (it is not the input's fault)."""
    try:
        yield from items()
    except RolloutError:
        if pinned is not None:
            pinned.check(path)
        raise
    if pinned is not None:
        pinned.check(path)
