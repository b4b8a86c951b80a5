"""What the dependencies print (vLLM, transformers, C++ warnings): quieted, then logged to a file.

The log lands in the results dir, or beside a failed run when an engine failed, never between
the progress bars.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer

from mismatch.cli.output import err_console
from mismatch.errors import EngineError, MismatchError


@contextmanager
def dependency_log(out: Path) -> Iterator[None]:
    """Everything the dependencies print goes to DIR/dependencies.log, not between the progress bars.

    File descriptor 2 itself is pointed at the log, so vLLM's engine-core process, C++ warnings
    (NUMA, Triton) and tqdm bars go there too; our own console keeps the real stderr. Python
    warnings and the "vllm" logger are routed to the same file. The log is written beside the
    results dir and moved into it once it is published (its path said once). A failed run keeps
    it as OUT.failed.log only when it holds something (an engine's own account of why it failed)
    and says where; a later successful run removes that file.
    """
    import logging

    from mismatch.results import DEPENDENCY_LOG

    out.parent.mkdir(parents=True, exist_ok=True)
    pending = out.parent / f".{out.name}.{os.getpid()}.log"
    failed_log = out.parent / f"{out.name}.failed.log"
    log_file = pending.open("ab")
    handler = logging.StreamHandler(open(log_file.fileno(), "w", closefd=False, buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("py.warnings", "vllm")]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    sys.stderr.flush()
    real_stderr = os.dup(2)
    # Console._file: None means "whatever sys.stderr is at each write" (what it goes back to).
    restore_file = err_console._file
    console_stream = None
    if _is_fd2(sys.stderr):  # the console writes to the real stderr, not to the log
        console_stream = open(real_stderr, "w", closefd=False, buffering=1)
        err_console.file = console_stream
    os.dup2(log_file.fileno(), 2)
    logging.captureWarnings(True)
    for logger in loggers:
        logger.handlers, logger.propagate = [handler], False
    published, keep = False, False
    try:
        yield
        published = out.is_dir()
    except BaseException as exc:
        # An engine that failed may have said why only in its own output; bad input has its line.
        keep = isinstance(exc, EngineError) or not isinstance(exc, (MismatchError, typer.Abort,
                                                                     KeyboardInterrupt))
        raise
    finally:
        logging.captureWarnings(False)
        for logger, (handlers, propagate) in zip(loggers, saved):
            logger.handlers, logger.propagate = handlers, propagate
        handler.flush()
        sys.stderr.flush()
        if console_stream is not None:
            console_stream.close()  # flushed; the descriptor itself is closed just below
        os.dup2(real_stderr, 2)
        os.close(real_stderr)
        err_console._file = restore_file
        log_file.close()
        _settle_log(pending, out, failed_log, published, keep, DEPENDENCY_LOG)


def _is_fd2(stream: Any) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # a test runner's buffer
        return False


def _last_error_line(log: Path) -> str | None:
    """The last `SomeError: text` line of a log that is not a pointer to another one (a root
    cause raised in an engine's worker process is re-raised as "see above" in the parent)."""
    import re

    pattern = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): \S")
    lines = log.read_text(errors="replace").splitlines()
    causes = [line for line in lines if pattern.match(line) and "root cause" not in line
              and "stack trace" not in line]
    return causes[-1][:400] if causes else None


def _settle_log(pending: Path, out: Path, failed_log: Path, published: bool, keep: bool,
                name: str) -> None:
    """The log into the published dir, kept beside a failed run as OUT.failed.log (`keep`: an
    engine failed), or removed."""
    size = pending.stat().st_size if pending.exists() else 0
    if published:
        failed_log.unlink(missing_ok=True)  # ours, from an earlier failed run of this command
    if size and published:
        import shutil

        shutil.move(pending, out / name)  # a rename, or a copy when OUT is a mount point
        say = f"dependency messages: {out / name}"
    elif size and keep:
        os.replace(pending, failed_log)
        say = f"the dependencies' own output of this failed run: {failed_log}"
        cause = _last_error_line(failed_log)
        if cause:
            say += f"; it ends with: {cause}"
    else:
        pending.unlink(missing_ok=True)
        return
    err_console.print(say, markup=False, highlight=False, soft_wrap=True)


def quiet_dependencies() -> None:
    """Our progress bars replace transformers' per-load bars and vLLM's INFO/WARNING chatter
    (dozens of lines per engine start) in the CLI; a value the user set wins.

    Environment, not `transformers.utils.logging.disable_progress_bar()`: transformers reads
    HF_HUB_DISABLE_PROGRESS_BARS when it is imported, and importing it here would cost every
    command (`--help` included) a second and a half."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM then logs through its "vllm" logger without a handler of its own (dependency_log gives
    # it one); it would otherwise write to stdout.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import logging

    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    if "transformers" in sys.modules:  # too late for the environment (a caller imported it first)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
