"""What the terminal shows while a command works: a progress line for every stage that takes time
(an engine loading, the demo's build and sampling, each replay), and phase spinners.

All of it goes to stderr and stays off with --json. On a terminal: rich's live bars and spinners.
Anywhere else (a pipe, a CI log): plain lines, never cut to a width nor redrawn — a counted stage
one when it starts, one at each quarter of its count (at most one per PLAIN_EVERY_S seconds between
those) and one at its end; a phase without a count (an engine loading) one when it is done, with
its seconds, so a load that fails leaves only its one error line.

The factory contract (mismatch.replay.ProgressFactory): `factory(label, total)` returns `advance`;
total None is a phase without a count (an engine starting), closed by `advance(0)`; total 0 is a
note (one line, nothing to advance: "resumed 3 of 8 blocks"); else a count of `total` units, the
label naming them unless it is a replay (its unit: tokens scored).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from mismatch.cli.output import err_console

PLAIN_EVERY_S = 10.0  # between quarter marks, a plain progress line at most this often


def _unit(label: str) -> str:
    return "tokens scored" if label.startswith("replay ") else ""


@contextmanager
def replay_progress(enabled: bool) -> Iterator[Any]:
    """A progress factory for the command's stages (module docstring), or None when disabled."""
    if not enabled:
        yield None
        return
    if not err_console.is_terminal:
        yield _plain_factory
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[unit]}"), TimeRemainingColumn())
    progress = Progress(*columns, console=err_console)
    loading: set[Any] = set()
    shown: list[bool] = [False]  # whether anything but a phase that failed was ever drawn

    def factory(label: str, total: int | None) -> Callable[[int], None]:
        if total == 0:
            progress.console.print(label, markup=False, highlight=False, soft_wrap=True)
            return lambda done: None
        progress.start()
        if total is None:  # a phase without a count, shown while it runs
            task = progress.add_task(label + " …", total=None, unit="")
            loading.add(task)
            return lambda done: (progress.remove_task(task), loading.discard(task), shown.__setitem__(0, True))
        shown[0] = True
        task = progress.add_task(label, total=total, unit=_unit(label))
        return lambda done: progress.advance(task, done)

    try:
        yield factory
    finally:
        for task in list(loading):  # a load that failed: its error line says the rest
            progress.remove_task(task)
        if progress.live.is_started:
            # Nothing but a failed load on screen: leave no empty bar behind the one error line.
            progress.live.transient = not shown[0]
            progress.stop()


def _say(line: str) -> None:
    err_console.print(line, markup=False, highlight=False, soft_wrap=True)


def _plain_factory(label: str, total: int | None) -> Callable[[int], None]:
    """Plain lines for a log (module docstring)."""
    started = time.perf_counter()
    if total == 0:
        _say(label)
        return lambda done: None
    if total is None:  # said when done: a load that fails leaves its one error line alone
        return lambda done: _say(f"{label}: done in {time.perf_counter() - started:.1f} s")
    unit = _unit(label)
    state = {"done": 0, "quarter": 0, "said": started}
    _say(f"{label}: 0/{total} {unit}".rstrip())

    def advance(done: int) -> None:
        state["done"] += done
        now = time.perf_counter()
        quarter = 4 * state["done"] // total if total > 0 else 4
        if quarter > state["quarter"] or now - state["said"] >= PLAIN_EVERY_S:
            state["quarter"], state["said"] = max(quarter, state["quarter"]), now
            _say(f"{label}: {state['done']}/{total} {unit} ({state['done'] / total:.0%}, "
                 f"{now - started:.1f} s)".replace("  ", " "))

    return advance


@contextmanager
def working(label: str, enabled: bool) -> Iterator[None]:
    """A spinner with its label on stderr while a phase without a token count runs (not with
    --json); off a terminal, a line when it is done."""
    if not enabled:
        yield
        return
    if not err_console.is_terminal:
        done = _plain_factory(label, None)
        yield
        done(0)
        return
    with err_console.status(label + " …"):
        yield
