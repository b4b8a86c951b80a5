"""One run at a time into a results dir: a lock file beside OUT, held from the first check to
the publish, and whatever killed runs of that OUT left, settled under it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from mismatch.errors import ResultsError
from mismatch.results.names import STAGE_IN_PLACE

# The descriptors of the results locks this process holds. An flock belongs to the open file, so
# a forked child (a rollouts reader, an analysis worker, an engine's process) that kept its copy
# would hold OUT for as long as it lived, after its parent had died: each fork drops them.
_HELD: set[int] = set()


def _drop_held_locks() -> None:
    """In a forked child: its copies of the lock descriptors point at /dev/null instead, which
    lets go of the lock file without unlocking it for the parent (LOCK_UN would) and keeps the
    descriptor numbers valid for the file objects that own them."""
    if _HELD:
        null = os.open(os.devnull, os.O_RDONLY)
        for fd in _HELD:
            os.dup2(null, fd)
        os.close(null)
        _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_held_locks)


@contextmanager
def results_lock(out: Path | None) -> Iterator[None]:
    """Hold OUT for one run from its first check to its publish (a no-op without OUT).

    A second run into the same OUT (or its work dir) exits 2 naming the first's pid and host,
    instead of mixing its blocks into the first's; a lock whose holder is gone (its pid dead, or
    another process's now) is taken over. Under the lock, whatever a killed run of this OUT left
    is ours to settle: a `--force` replace killed between its two renames is rolled back, and
    hidden stage, trash and temp files are removed.
    """
    if out is None:
        yield
        return
    out = Path(out)
    _writable_parent(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    handle = _acquire(out, lock_path)
    _HELD.add(handle.fileno())
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(_holder_text(os.getpid()))
        handle.flush()
        _settle_leftovers(out)
        yield
    finally:
        _HELD.discard(handle.fileno())
        lock_path.unlink(missing_ok=True)
        handle.close()


def _acquire(out: Path, lock_path: Path) -> IO[str]:
    """The lock file, open and locked by this process; refused while a live run holds it."""
    import fcntl

    while True:
        handle = lock_path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read()
            inode = os.fstat(handle.fileno()).st_ino
            handle.close()
            if _holder_is_gone(holder):  # locked only by what it forked before this fix, or by a pid reused
                _remove_stale(lock_path, inode)
                continue
            named = holder.strip().splitlines()[0] if holder.strip() else "another process"
            raise ResultsError(f"{out}: another mismatch run is writing it ({named}); wait for it "
                               "to finish or choose another --out") from None
        # The file we locked may have been removed by the run that held it a moment ago.
        if lock_path.exists() and os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
            return handle
        handle.close()


def _holder_text(pid: int) -> str:
    """What the lock file says of its holder: the pid and host the refusal names, and the pid's
    start time, which tells that process from a later one given the same pid."""
    import socket

    started = _start_time(pid)
    return f"pid {pid} on {socket.gethostname()}\n" + (f"started {started}\n" if started else "")


def _holder_is_gone(holder: str) -> bool:
    """Whether the run a lock file names is certainly not running: on this host, and its pid dead
    or now another process. Anything else (another host, a file being written) keeps the lock."""
    import socket

    lines = holder.split("\n")
    words = lines[0].split()
    if len(words) != 4 or words[0] != "pid" or not words[1].isdigit() or words[2:] != ["on", socket.gethostname()]:
        return False
    pid = int(words[1])
    if not _alive(pid):
        return True
    started = lines[1].removeprefix("started ") if len(lines) > 1 and lines[1].startswith("started ") else None
    now = _start_time(pid)
    return started is not None and now is not None and started != now


def _remove_stale(lock_path: Path, inode: int) -> None:
    """Remove a lock file whose holder is gone, if it is still that file: under a lock on the
    directory, so that of two runs taking it over at once the second cannot remove the file the
    first has just made and locked."""
    import fcntl

    directory = os.open(lock_path.parent, os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        try:
            if os.stat(lock_path).st_ino == inode:
                lock_path.unlink()
        except FileNotFoundError:
            pass
    finally:
        os.close(directory)


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
    """Whether `pid` is a running process (a zombie, killed but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    stat = _proc_stat(pid)
    return stat is None or stat[0] != "Z"


def _start_time(pid: int) -> str | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22); None off Linux."""
    stat = _proc_stat(pid)
    return stat[19] if stat is not None and len(stat) > 19 else None


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on: the command name before it may hold spaces."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)
