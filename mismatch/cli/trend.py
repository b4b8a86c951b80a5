"""`mismatch trend`: the mismatch over a run's steps (mismatch.trend), printed, as JSON, or as a page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from mismatch.cli.options import JsonFlag
from mismatch.cli.output import emit_json, out_console


def trend(
    results: Annotated[list[Path], typer.Argument(
        metavar="RESULTS...", help="One audit's results dir per step (steps from step_N names, else the order given).")],
    pair: Annotated[str, typer.Option(help="The pair whose gap is followed (A/B).")] = "train/sampler",
    metric: Annotated[str, typer.Option(
        help="The metric change points are found in: a pair metric, or FRAMEWORK:NAME (verl:rollout_corr/kl).")] = "kl_k3",
    weights: Annotated[bool, typer.Option(
        "--weights", help="Also diff the checkpoints across each change (each step's summary names its checkpoint).")] = False,
    report: Annotated[Optional[Path], typer.Option(
        "--report", help="Write the trend page (self-contained HTML) here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The mismatch across training steps: each metric per step with its 95% CI, the steps where it
    changes level or slope, and what changed there (strata, turns, layers, engines, weights)."""
    from mismatch.trend import analyze_trend

    found = analyze_trend(results, pair=pair, metric=metric, weights=weights)
    if report is not None:
        from mismatch.reports.trend import build_trend_report

        build_trend_report(found, report)
    if as_json:
        emit_json(found)
        return
    _print_trend(found)
    if report is not None:
        out_console.print(f"report: {report}", markup=False, highlight=False)


def _print_trend(found: dict[str, Any]) -> None:
    from mismatch.reports.trend import terminal_lines

    for line in terminal_lines(found):
        out_console.print(line, markup=False, highlight=False, soft_wrap=True)
