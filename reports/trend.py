"""The trend report: one self-contained HTML page over a training run's steps, in the results
report's style (its CSS, plotly's basic bundle inlined, a strict CSP, data through one JSON block).

First screen: a headline card (what changed, at which step, why, with the test behind it). Then a
timeline per metric with its 95% CIs, every change point and jump marked on each; the changes, each
once (a change point, else a jump, and the recorded configuration changes beside); the growth split
by strata as a table; the steps with a link to each step's own report.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mismatch.reports.build import atomic_write, render_page
from mismatch.reports.figures import Figure
from mismatch.present.numbers import num, pct
from mismatch.present.trend import Trend, mix_share, recorded_only
from mismatch.reports.html import Html, el, join

TIMELINES = ("kl_k3", "log_ratio_abs_mean", "chi2_token", "ratio_q001", "ratio_q999", "ess")
_COLOR, _MARK, _JUMP = "#1f77b4", "#d62728", "#e67700"
_NAV = (("headline", "Headline"), ("timelines", "Timelines"), ("changes", "Changes"), ("strata", "Strata"),
        ("steps", "Steps"))


def build_trend_report(trend: Trend, out: Path) -> Path:
    """Write the trend page of `trend` (mismatch.trend.analyze_trend's result, read_trend) to `out`."""
    out = Path(out)
    figures = {f"trend-{metric}": timeline(trend, metric)
               for metric in dict.fromkeys([trend.metric, *TIMELINES]) if metric in trend.series}
    top = el("header", el("div", el("span", "mismatch", class_="brand"), el("span", "trend", class_="brand-sub"),
                          class_="brand-box"),
             el("nav", [el("a", label, href=f"#{anchor}") for anchor, label in _NAV]), class_="top")
    body = join(top, el("main", headline_card(trend), _charts(figures), _changes(trend), _growth(trend),
                        _steps_table(trend, out.parent)))
    atomic_write(out, render_page(body, {"figures": figures, "worst": None, "colors": {}},
                                  f"mismatch trend: {trend.pair}"))
    return out


def headline_card(trend: Trend) -> Html:
    """The report's banner, for a run: a pill, what changed at which step, why, and the numbers."""
    metric = trend.metric
    if trend.changes:
        change = trend.changes[0]
        status, pill, step = "fix", "CHANGED", change.step
        title = f"{metric} changed at step {step}: {change.kind}"
        why = change.causes
        tiles = [("step", str(step)), ("level before", num(change.before.level)),
                 ("level after", num(change.after.level)), ("p-value", num(change.p_value, 2))]
        test = ("the step's 95% CI leaves the level before" if change.separated
                else "a bend: the test of one line against two is the evidence")
    elif trend.jumps:
        jump = trend.jumps[0]
        status, pill, step = "correct", "JUMPED", jump.step
        title = f"{metric} jumped at step {step}"
        why = jump.causes
        tiles = [("step", str(step)), ("before", num(jump.before)), ("after", num(jump.after)),
                 ("p-value", num(jump.p_value, 2))]
        test = "the two steps' difference passes a z-test from their CIs"
    else:
        status, pill = "healthy", "NO CHANGE"
        title = f"no change in {metric} over {trend.num_steps} steps"
        why = [f"{c.causes[0]} (step {c.step}, p = {num(c.p_value, 2)}: no significant move)"
               for c in trend.configuration_changes][:3]
        values = [row.value for row in trend.series[metric]]
        tiles = [("steps", str(trend.num_steps)), ("first", num(values[0])), ("last", num(values[-1]))]
        test = "no change point passes the test; no two steps differ past their CIs"
    details = [el("p", el("strong", "why: "), "; ".join(why), class_="banner-detail") if why else None,
               el("p", el("strong", "test: "), test, " (", trend.method["change_points"], ")",
                  class_="banner-detail")]
    return el("section",
              el("div", el("span", pill, class_="pill"),
                 el("h1", title, " — ", trend.pair, id="verdict-headline"), class_="banner-head"),
              details,
              el("div", [el("div", el("div", value, class_="tile-value", style=f"--chars: {len(value)}"),
                            el("div", label, class_="tile-label"), class_="tile") for label, value in tiles],
                 class_="tiles"),
              id="headline", class_=f"banner status-{status}")


def timeline(trend: Trend, metric: str) -> Figure:
    """One metric over the steps with its CIs; each change point (red) and jump (orange) marked."""
    rows = trend.series[metric]
    steps = [row.step for row in rows]
    has_ci = any(row.ci_low is not None for row in rows)
    trace: dict[str, object] = {"type": "scatter", "mode": "lines+markers", "x": steps,
                                "y": [row.value for row in rows], "name": metric, "line": {"color": _COLOR}}
    if has_ci:
        trace["error_y"] = {"type": "data", "symmetric": False, "color": _COLOR,
                            "array": [None if r.ci_high is None else r.ci_high - r.value for r in rows],
                            "arrayminus": [None if r.ci_low is None else r.value - r.ci_low for r in rows]}
    marked = [(step, f"change point: step {step}", _MARK) for step in trend.change_points]
    marked += [(jump.step, f"jump: step {jump.step}", _JUMP) for jump in trend.jumps]
    marks = [{"type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
              "line": {"color": color, "dash": "dash"}} for step, _, color in marked]
    notes = [{"x": step, "yref": "paper", "y": 1, "text": text, "showarrow": False,
              "font": {"color": color}, "yanchor": "bottom"} for step, text, color in marked]
    return {"data": [trace], "layout": {"title": {"text": f"{metric}{' (95% CI over rollouts)' if has_ci else ''}"},
                                        "xaxis": {"title": {"text": "step"}}, "shapes": marks, "annotations": notes,
                                        "margin": {"t": 56, "r": 16, "l": 56}, "height": 300, "showlegend": False}}


def _panel(anchor: str, title: str, *content: Any) -> Html:
    return el("section", el("h2", title), *content, id=anchor, class_="panel")


def _charts(figures: dict[str, Figure]) -> Html:
    return _panel("timelines", "Timelines", [el("div", class_="chart", data_fig=fig_id) for fig_id in figures])


def _changes(trend: Trend) -> Html:
    """Every change once: the change points, the jumps that are none, then what was recorded changing."""
    head = el("thead", el("tr", el("th", "step"), el("th", "what"), el("th", "before → after"), el("th", "p-value"),
                          el("th", "why")))
    rows = []
    for change in trend.changes:
        rows.append(el("tr", el("td", str(change.step)), el("td", f"change point ({change.kind})"),
                       el("td", f"{num(change.before.level)} → {num(change.after.level)}"),
                       el("td", num(change.p_value, 2)), el("td", "; ".join(change.causes))))
    for jump in trend.jumps:
        rows.append(el("tr", el("td", str(jump.step)), el("td", f"jump from step {jump.from_step}"),
                       el("td", f"{num(jump.before)} → {num(jump.after)}"), el("td", num(jump.p_value, 2)),
                       el("td", "; ".join(jump.causes))))
    for recorded in recorded_only(trend):  # at a change or a jump, its configuration is among that row's causes
        rows.append(el("tr", el("td", str(recorded.step)), el("td", "recorded, no significant move"),
                       el("td", f"{num(recorded.before)} → {num(recorded.after)}"),
                       el("td", num(recorded.p_value, 2)), el("td", "; ".join(recorded.causes))))
    if not rows:
        return _panel("changes", "Changes", el("p", "None. ", trend.method["change_points"], "."))
    return _panel("changes", "Changes", el("table", head, el("tbody", rows), class_="data"))


def _growth(trend: Trend) -> Html:
    """The whole run's growth of k3 split by strata (mismatch.trend.attribution), one row a dimension."""
    growth = trend.growth
    if growth is None:
        return Html("")
    head = el("thead", el("tr", el("th", "dimension"), el("th", "k3 before → after"), el("th", "from the mix"),
                          el("th", "where it grew most"), el("th", "their gap grew"), el("th", "the rest's grew"),
                          el("th", "their tokens")))
    rows = []
    for dimension, split in growth.strata.items():
        if split.unavailable is not None:
            rows.append(el("tr", el("td", dimension), el("td", split.unavailable, colspan="6")))
            continue
        hot = split.hot
        rows.append(el("tr", el("td", dimension + (" (explains it)" if dimension in growth.explained_by else "")),
                       el("td", f"{num(split.gap_before)} → {num(split.gap_after)}"), el("td", mix_share(split)),
                       el("td", hot.where if hot is not None else "–"),
                       el("td", f"{num(hot.factor, 3)}×" if hot is not None else "–"),
                       el("td", f"{num(hot.rest_factor, 3)}×" if hot is not None else "–"),
                       el("td", pct(hot.token_share) if hot is not None else "–")))
    title = f"Growth of k3, steps {growth.before[0]}–{growth.before[-1]} → {growth.after[0]}–{growth.after[-1]}, by strata"
    return _panel("strata", title, el("div", el("table", head, el("tbody", rows), class_="data"), class_="scroll"))


def _steps_table(trend: Trend, here: Path) -> Html:
    metric = trend.metric
    values = {row.step: row for row in trend.series[metric]}
    rows = []
    for step in trend.steps:
        link = el("a", "report", href=os.path.relpath(step.report, here)) if step.report else "–"
        row = values[step.step]
        ci = f"{num(row.ci_low)} – {num(row.ci_high)}" if row.ci_low is not None else "–"
        rows.append(el("tr", el("td", str(step.step)), el("td", num(row.value)), el("td", ci),
                       el("td", step.headline), el("td", link)))
    head = el("thead", el("tr", el("th", "step"), el("th", metric), el("th", "95% CI"), el("th", "the step's headline"),
                          el("th", "")))
    return _panel("steps", "Steps", el("table", head, el("tbody", rows), class_="data"))
