"""`mismatch trend`: the mismatch over a run's steps (mismatch.trend), printed, as JSON, or as a page."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from mismatch.cli.options import JsonFlag
from mismatch.cli.output import emit_json, out_console

if TYPE_CHECKING:
    from mismatch.present.trend import Trend


def trend(
    results: Annotated[list[Path], typer.Argument(
        metavar="RESULTS...", help="One audit's results dir per step (steps from step_N names, else the order given).")],
    pair: Annotated[str, typer.Option(help="The pair whose gap is followed (A/B).")] = "train/sampler",
    metric: Annotated[str, typer.Option(
        help="The metric change points are found in: a pair metric, or FRAMEWORK:NAME (verl:rollout_corr/kl).")] = "kl_k3",
    weights: Annotated[bool, typer.Option(
        "--weights", help="Also diff the checkpoints across each change (each step's summary names its checkpoint).")] = False,
    order: Annotated[str, typer.Option(
        "--order", help="names: steps from the dirs' names (ASCII digits ending each, e.g. step_12; every dir needs "
                        "one); given: the order the dirs are given in.")] = "names",
    report: Annotated[Optional[Path], typer.Option(
        "--report", help="Write the trend page (self-contained HTML) here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The mismatch across training steps: each metric per step with its 95% CI, the steps where it
    changes level or slope, and what changed there (strata, turns, layers, engines, weights)."""
    from mismatch.trend import analyze_steps, load_steps
    from mismatch.trend.steps import check_named

    if report is not None:  # before any step is read: a path the page cannot be written to
        check_report_path(report)
    steps = load_steps(results, order=order)
    found = analyze_steps(steps, pair=pair, metric=metric, weights=weights)  # an unknown metric is named here
    check_named(steps, pair, metric)
    from mismatch.present.trend import read_trend

    trend = read_trend(found)
    if report is not None:
        from mismatch.reports import build_trend_report
        from mismatch.results import file_fault

        try:
            build_trend_report(trend, report)
        except OSError as error:  # the disk filled, or the dir changed since the check
            raise file_fault(error, str(report)) from None
    if as_json:
        emit_json(found)
        return
    _print_trend(trend)
    if report is not None:
        out_console.print(f"report: {report}", markup=False, highlight=False)


def check_report_path(report: Path) -> None:
    """--report names a file in an existing, writable directory (not a directory itself)."""
    import tempfile

    from mismatch.errors import MismatchError

    if report.is_dir():
        raise MismatchError(f"--report {report}: is a directory; give the page's file name (e.g. {report / 'trend.html'})")
    parent = report.parent if str(report.parent) else Path(".")
    if not parent.is_dir():
        raise MismatchError(f"--report {report}: the directory {parent} does not exist")
    try:  # what the page's temp file + rename needs: a file made in that directory (root ignores os.access)
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as error:
        raise MismatchError(f"--report {report}: cannot be written ({error.strerror or error} in {parent})") from None


def _print_trend(trend: Trend) -> None:
    from mismatch.present.trend import terminal_lines

    for line in terminal_lines(trend):
        out_console.print(line, markup=False, highlight=False, soft_wrap=True)
