"""What the terminal shows while a command works: replay progress bars and phase spinners.

Both go to stderr and stay off with --json.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from mismatch.cli.output import err_console


@contextmanager
def replay_progress(enabled: bool) -> Iterator[Any]:
    """A rich progress bar per replay, on stderr so --json output stays clean.

    Started at the first replay, so an input error found before any replay prints only its line.
    """
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("tokens"), TimeRemainingColumn())
    progress = Progress(*columns, console=err_console)

    loading: set[Any] = set()

    def factory(label: str, total: int | None):
        if total is None:  # a phase without a count (an engine starting), shown while it runs
            if not progress.live.is_started:  # nothing on screen yet: a failing first load stays one line
                return lambda done: None
            task = progress.add_task(label, total=None)
            loading.add(task)
            return lambda done: (progress.remove_task(task), loading.discard(task))
        progress.start()
        task = progress.add_task(label, total=total)
        return lambda done: progress.advance(task, done)

    try:
        yield factory
    finally:
        for task in list(loading):  # a load that failed: its error line says the rest
            progress.remove_task(task)
        if progress.live.is_started:
            progress.stop()


@contextmanager
def working(label: str, enabled: bool) -> Iterator[None]:
    """A spinner with its label on stderr while a phase without a token count runs (not with --json)."""
    if not enabled:
        yield
        return
    with err_console.status(label + " …"):
        yield
