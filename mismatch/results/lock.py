"""One run at a time into a results dir: a lock file beside OUT, held from the first check to
the publish, and whatever killed runs of that OUT left, settled under it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mismatch.errors import ResultsError
from mismatch.results.names import STAGE_IN_PLACE


@contextmanager
def results_lock(out: Path | None) -> Iterator[None]:
    """Hold OUT for one run from its first check to its publish (a no-op without OUT).

    A second run into the same OUT (or its work dir) exits 2 naming the first's pid and host,
    instead of mixing its blocks into the first's. Under the lock, whatever a killed run of this
    OUT left is ours to settle: a `--force` replace killed between its two renames is rolled
    back, and hidden stage, trash and temp files are removed.
    """
    if out is None:
        yield
        return
    import fcntl
    import socket

    out = Path(out)
    _writable_parent(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    while True:
        handle = lock_path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ResultsError(f"{out}: another mismatch run is writing it ({holder}); wait for it "
                               "to finish or choose another --out") from None
        # The file we locked may have been removed by the run that held it a moment ago.
        if lock_path.exists() and os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        _settle_leftovers(out)
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        handle.close()


def _writable_parent(out: Path) -> None:
    """Refuse an OUT whose directory cannot be written, before any work (not at the first block)."""
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ResultsError(f"{out}: cannot write in {existing} (permission denied or read-only)")
    if out.is_dir() and os.path.ismount(out) and not os.access(out, os.W_OK | os.X_OK):
        raise ResultsError(f"{out}: a mount point that cannot be written")


def _settle_leftovers(out: Path) -> None:
    """What killed runs of OUT left beside or inside it (called with OUT's lock held)."""
    parent = out.parent
    trashes = sorted(parent.glob(f".{glob_escape(out.name)}.old-*"))
    if not out.exists():
        for trash in trashes:  # killed between "old out -> trash" and "stage -> out": roll back
            if (trash / "old").is_dir():
                os.replace(trash / "old", out)
                break
    for leftover in [*trashes, *parent.glob(f".{glob_escape(out.name)}.tmp-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    for log in parent.glob(f".{glob_escape(out.name)}.*.log"):  # the CLI's pending dependency logs
        pid = log.name.removeprefix(f".{out.name}.").removesuffix(".log")
        if pid.isdigit() and not _alive(int(pid)):
            log.unlink(missing_ok=True)
    if out.is_dir():
        for leftover in [*out.glob(".index.html.tmp-*"), *out.glob(f"{STAGE_IN_PLACE}*")]:
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)
