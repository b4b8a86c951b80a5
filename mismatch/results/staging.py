"""A results dir built in a hidden sibling temp dir and published by rename at the end, so a
crash or a bad input never leaves a half-written results dir; an existing one is replaced only
on request (`--force`), and only when it is a results dir. What it publishes is recorded
(`published_files`: each file's rows and SHA-256, in summary.json) so a merge can check a shard's
files are the ones its run wrote (`check_published_files`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mismatch.errors import EnvironmentFault, ResultsError
from mismatch.results.summary_model import PublishedFile
from mismatch.results.names import ROLLOUTS_FILE, STAGE_IN_PLACE, SUMMARY_FILE, TOKENS_FILE, is_results_dir

# The machine, not the input: a full disk, a quota, a read-only file system.
_ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})  # EFBIG: a size limit


def check_out_dir(out: Path, *, force: bool) -> None:
    """Refuse early (before any replay) to overwrite what the user has."""
    _refuse_symlink(out)
    if out.exists() and not out.is_dir():
        raise ResultsError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ResultsError(f"{out}: already exists; pass --force to replace it")
    if force and out.is_dir() and any(out.iterdir()) and not is_results_dir(out):
        raise ResultsError(f"{out}: is not a mismatch results dir (no {SUMMARY_FILE}); "
                           "refusing to replace it even with --force")


def _refuse_symlink(out: Path) -> None:
    """A symlink as OUT is refused, dangling or not. Publishing renames a dir into place: over a
    link that replaces the link (the results never reach its target), and following it would put
    the results where the run's lock and work dir (beside the name given) do not guard them."""
    if not out.is_symlink():
        return
    target = Path(os.readlink(out))
    resolved = (out.parent / target).resolve()
    if not resolved.exists():
        raise ResultsError(f"{out}: is a symlink to {target}, which does not exist; give --out the "
                           "directory's own path (results are published by renaming a directory into place)")
    raise ResultsError(f"{out}: is a symlink to {target}; give --out {resolved} itself (results are "
                       "published by renaming a directory into place, which would replace the link)")


def file_fault(error: OSError, what: str) -> Exception:
    """What a command says when the file system refuses `what` (a path it reads or writes): the
    machine's fault (EnvironmentFault, exit 3) for a full disk, a quota or a read-only file
    system; the path's (ResultsError, exit 2) for anything else (a directory, no permission, an
    immutable file, /proc). One line either way, raised `from None` by the caller."""
    detail = error.strerror or str(error)
    where = f" ({error.filename})" if error.filename and str(error.filename) not in what else ""
    if error.errno in _ENVIRONMENT_ERRNOS:
        return EnvironmentFault(f"{what}: {detail}{where}")
    return ResultsError(f"{what}: cannot be written or read ({detail}{where})")


def _environment_fault(error: OSError, doing: str, out: Path) -> EnvironmentFault:
    where = f" ({error.filename})" if error.filename else ""
    return EnvironmentFault(f"{out}: {doing} failed: {error.strerror or error}{where}; the staged results "
                            "were removed; free space and rerun: the work dir resumes")


@contextmanager
def staged_dir(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `out` in one rename (file by file when
    `out` is a mount point), on error it vanishes. A full disk, a quota or a read-only file
    system (while it is filled or renamed) is an EnvironmentFault: the machine's, not the input's."""
    check_out_dir(out, force=force)
    doing = "creating the staged results dir"
    stage: Path | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        in_place = out.is_dir() and os.path.ismount(out)
        stage = Path(tempfile.mkdtemp(prefix=STAGE_IN_PLACE if in_place else f".{out.name}.tmp-",
                                      dir=out if in_place else out.parent))
        os.chmod(stage, 0o777 & ~_umask())  # mkdtemp makes 0700; the user expects a normal dir
        doing = "writing the staged results"
        yield stage
        doing = "renaming the staged results into place"
        _publish(stage, out, in_place=in_place)
    except OSError as error:
        if error.errno in _ENVIRONMENT_ERRNOS:
            raise _environment_fault(error, doing, out) from None
        raise
    finally:
        if stage is not None and stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def _publish(stage: Path, out: Path, *, in_place: bool) -> None:
    """The staged dir as `out`: moved in file by file on a mount point, else one rename (an
    existing `out` moved aside first, and put back if the rename fails)."""
    if in_place:
        _replace_contents(out, stage)
    elif out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "old")
        try:
            os.replace(stage, out)
        except OSError:
            os.replace(trash / "old", out)  # the previous results stay where they were
            trash.rmdir()
            raise
        shutil.rmtree(trash)
    else:
        os.replace(stage, out)


def _replace_contents(out: Path, stage: Path) -> None:
    """The staged files into `out` one by one (each an atomic rename; summary.json last, so a
    reader that sees it sees the rest), after the previous results (checked by check_out_dir)."""
    for old in out.iterdir():
        if old != stage:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    names = sorted(path.name for path in stage.iterdir())
    for name in sorted(names, key=lambda name: name == SUMMARY_FILE):
        os.replace(stage / name, out / name)
    stage.rmdir()


# Each row's prefix key (analysis/prefixes), row for row with tokens.parquet: published by a shard
# (count > 1) so that merge groups every shard's rows by prefix, as one run does.
PREFIX_KEYS_FILE = "prefix_keys.parquet"
# The files summary.json vouches for (what a merge reads of a shard); the report is rebuilt from them.
PUBLISHED_TABLES = (TOKENS_FILE, ROLLOUTS_FILE, PREFIX_KEYS_FILE)


def published_files(directory: Path) -> dict[str, dict[str, Any]]:
    """summary.json `shard.files`: each published table's row count and SHA-256, hashed in the
    staged dir once it is written (before the rename publishes it)."""
    import pyarrow.parquet as pq

    found = {}
    for name in PUBLISHED_TABLES:
        file = directory / name
        if file.is_file():
            found[name] = {"rows": pq.ParquetFile(file).metadata.num_rows, "sha256": file_sha256(file)}
    return found


def check_published_files(directory: Path, recorded: dict[str, PublishedFile] | None) -> None:
    """Each file `recorded` (summary.json `shard.files`) is in `directory` with that digest: a
    shard's files are the ones its run wrote (not another shard's, not cut short)."""
    if recorded is None or TOKENS_FILE not in recorded:
        raise ResultsError(f"{directory}/{SUMMARY_FILE}: records no digest of its files (written by an "
                           "older mismatch, or not by mismatch); rerun the shard to merge it")
    check_recorded_files(directory, recorded, hint="; rerun the shard")


def check_recorded_files(directory: Path, recorded: dict[str, PublishedFile], *, hint: str = "") -> None:
    """Each file of `recorded` (summary.json `shard.files`, or the part a reader needs) is in
    `directory` with its recorded digest; `hint` ends the message of a changed one."""
    for name, entry in recorded.items():
        file = directory / name
        if name not in PUBLISHED_TABLES:
            raise ResultsError(f"{directory}/{SUMMARY_FILE}: files.{name}: not a file a results dir publishes")
        if not file.is_file():
            raise ResultsError(f"{file}: missing ({directory}/{SUMMARY_FILE} records it)")
        if file_sha256(file) != entry.sha256:
            raise ResultsError(f"{file}: its content is not what {directory}/{SUMMARY_FILE} recorded (another "
                               f"run's file, or changed since){hint}")


def file_sha256(file: str | Path) -> str:
    """A file's SHA-256, streamed (hashlib reads it in 256 KiB pieces): the one content digest of
    the project (published files here, a run's inputs in identity). A digest `digest_ahead` began
    of the same file is taken when the file has not changed since it began."""
    path = os.path.abspath(file)
    ahead = _AHEAD.pop(path, None)
    if ahead is not None:
        (stamp, started), future = ahead
        try:
            digest = future.result()
            if _stamp(os.stat(file)) == stamp:
                _taken(path, stamp, started, digest)
                return digest
        except OSError:
            pass  # hashed again below, which says what is wrong with the file
    try:
        stamp, started = _stamp(os.stat(file)), time.time_ns()
    except OSError:
        stamp = None  # open() below words it
    with open(file, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if stamp is not None and _stamp(os.stat(file)) == stamp:
        _taken(path, stamp, started, digest)
    return digest


# Digests begun ahead of their use: absolute path -> ((the file's stat stamp, when it was taken), the digest to come).
_AHEAD: dict[str, tuple[tuple[tuple[int, ...], int], Future[str]]] = {}
# The whole-file digests this process took, by absolute path: (the stamp that held from before the
# hashing to after it, the digest); only stamps old enough to trust (RACY_NS).
_TAKEN: dict[str, tuple[tuple[int, ...], str]] = {}
# A file changed within this long before its hashing began may change again without its ctime
# moving (timestamps come from a coarse clock; some file systems keep seconds): its digest stands,
# but its stamp vouches for nothing, as git treats a "racily clean" index entry.
RACY_NS = 1_000_000_000


def digest_ahead(file: str | Path) -> None:
    """Begin file_sha256 of `file` on a thread of its own: hashlib lets go of the GIL while it
    hashes, so a command's first seconds (its imports, its checks: one core) and the digest of its
    inputs (the rollouts file: 0.13-0.19 s for benchmarks/audit_stored.py's 233 MB) overlap on two."""
    path = os.path.abspath(file)
    try:
        stamp, started = _stamp(os.stat(path)), time.time_ns()
    except OSError:
        return  # not there, or not readable: the command's own checks word that
    future: Future[str] = Future()

    def hash_file() -> None:
        try:
            with open(path, "rb") as handle:
                future.set_result(hashlib.file_digest(handle, "sha256").hexdigest())
        except BaseException as exc:  # noqa: BLE001 - handed to file_sha256, which hashes again
            future.set_exception(exc)

    threading.Thread(target=hash_file, name="mismatch-digest", daemon=True).start()
    _AHEAD[path] = ((stamp, started), future)


def unchanged_since_digest(file: str | Path, digest: str) -> bool:
    """Whether this process took `digest` of the whole of `file` and the file's stamp has not moved
    since: then its bytes are those it hashed, and need no hashing again (a rollouts file checked
    unchanged after a pass: 0.2 s for 233 MB). False when in doubt: the caller hashes."""
    taken = _TAKEN.get(os.path.abspath(file))
    if taken is None or taken[1] != digest:
        return False
    try:
        return _stamp(os.stat(file)) == taken[0]
    except OSError:
        return False


def stamp_vouches(mtime_ns: int, ctime_ns: int, started_ns: int) -> bool:
    """Whether a file's stamp, unmoved, vouches that its content is the one hashed from `started_ns`
    on: it last changed (mtime, ctime) more than RACY_NS before. The digests remembered here and the
    checkpoint digests identity caches across runs hold to this one rule."""
    return max(mtime_ns, ctime_ns) < started_ns - RACY_NS


def _taken(path: str, stamp: tuple[int, ...], started: int, digest: str) -> None:
    """Remember a whole-file digest whose stamp held while it was hashed, when that stamp is old
    enough to vouch for the content (stamp_vouches)."""
    _, mtime_ns, ctime_ns, *_ = stamp
    if stamp_vouches(mtime_ns, ctime_ns, started):
        _TAKEN[path] = (stamp, digest)
    else:
        _TAKEN.pop(path, None)


def _stamp(stat: os.stat_result) -> tuple[int, ...]:
    """What a change to a file moves (its ctime even when its mtime is put back)."""
    return stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file via temp + rename so readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the user expects a normal file
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
