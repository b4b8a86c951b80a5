"""A results dir built in a hidden sibling temp dir and published by rename at the end, so a
crash or a bad input never leaves a half-written results dir; an existing one is replaced only
on request (`--force`), and only when it is a results dir.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mismatch.errors import ResultsError
from mismatch.results.names import STAGE_IN_PLACE, SUMMARY_FILE, is_results_dir


def check_out_dir(out: Path, *, force: bool) -> None:
    """Refuse early (before any replay) to overwrite what the user has."""
    if out.exists() and not out.is_dir():
        raise ResultsError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ResultsError(f"{out}: already exists; pass --force to replace it")
    if force and out.is_dir() and any(out.iterdir()) and not is_results_dir(out):
        raise ResultsError(f"{out}: is not a mismatch results dir (no {SUMMARY_FILE}); "
                           "refusing to replace it even with --force")


@contextmanager
def staged_dir(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `out` in one rename (file by file when
    `out` is a mount point), on error it vanishes."""
    check_out_dir(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    in_place = out.is_dir() and os.path.ismount(out)
    stage = Path(tempfile.mkdtemp(prefix=STAGE_IN_PLACE if in_place else f".{out.name}.tmp-",
                                  dir=out if in_place else out.parent))
    os.chmod(stage, 0o777 & ~_umask())  # mkdtemp makes 0700; the user expects a normal dir
    try:
        yield stage
        if in_place:
            _replace_contents(out, stage)
        elif out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "old")
            os.replace(stage, out)
            shutil.rmtree(trash)
        else:
            os.replace(stage, out)
    finally:
        if stage.exists():
            shutil.rmtree(stage)


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
