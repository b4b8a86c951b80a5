"""The trend report: one self-contained HTML page (the results report's conventions: plotly's basic
bundle inlined, a strict CSP, data through one JSON block) over a training run's steps.

A timeline per metric with its 95% CIs and each change point marked, the change's attribution, the
per-step headline, and a link to each step's own report.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mismatch.reports.build import atomic_write, render_page
from mismatch.reports.html import Html, el, join, num, pct

TIMELINES = ("kl_k3", "log_ratio_abs_mean", "chi2_token", "ratio_q001", "ratio_q999", "ess")
_COLOR, _MARK = "#1f77b4", "#d62728"


def build_trend_report(found: dict[str, Any], out: Path) -> Path:
    """Write the trend page of `found` (mismatch.trend.analyze_trend's result) to `out`."""
    out = Path(out)
    figures = {f"trend-{metric}": timeline(found, metric)
               for metric in dict.fromkeys([found["metric"], *TIMELINES]) if metric in found["series"]}
    body = join(el("header", el("h1", "mismatch trend: ", found["pair"], " over ", str(found["num_steps"]), " steps"),
                   el("p", headline(found), class_="headline")),
                el("main", _charts(figures), _changes(found), _growth(found), _steps_table(found, out.parent)))
    atomic_write(out, render_page(body, {"figures": figures, "worst": None, "colors": {}},
                                  f"mismatch trend: {found['pair']}"))
    return out


def headline(found: dict[str, Any]) -> str:
    """The first line: where the metric changed and the first cause found, or that it did not."""
    metric, pair = found["metric"], found["pair"]
    if found["changes"]:
        change = found["changes"][0]
        return (f"{metric} of {pair} changed at step {change['step']} ({change['kind']}: "
                f"{num(change['before']['level'])} → {num(change['after']['level'])}, slope "
                f"{num(change['before']['slope_per_step'])} → {num(change['after']['slope_per_step'])} per step, "
                f"p = {num(change['p_value'], 2)}): {change['causes'][0]}")
    significant = [jump for jump in found["jumps"] if jump["significant"] or jump["configuration"]]
    if significant:
        jump = significant[0]
        return (f"{metric} of {pair} jumped at step {jump['step']} ({num(jump['before'])} → {num(jump['after'])}): "
                f"{jump['causes'][0]}")
    return f"no change in {metric} of {pair} over {found['num_steps']} steps (no change point passes the test)"


def timeline(found: dict[str, Any], metric: str) -> dict[str, Any]:
    rows = found["series"][metric]
    steps = [row["step"] for row in rows]
    has_ci = any(row["ci_low"] is not None for row in rows)
    trace: dict[str, Any] = {"type": "scatter", "mode": "lines+markers", "x": steps, "y": [row["value"] for row in rows],
                             "name": metric, "line": {"color": _COLOR}}
    if has_ci:
        trace["error_y"] = {"type": "data", "symmetric": False, "color": _COLOR,
                            "array": [None if r["ci_high"] is None else r["ci_high"] - r["value"] for r in rows],
                            "arrayminus": [None if r["ci_low"] is None else r["value"] - r["ci_low"] for r in rows]}
    marks = [{"type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
              "line": {"color": _MARK, "dash": "dash"}} for step in found["change_points"]]
    notes = [{"x": step, "yref": "paper", "y": 1, "text": f"change point: step {step}", "showarrow": False,
              "font": {"color": _MARK}, "yanchor": "bottom"} for step in found["change_points"]]
    return {"data": [trace], "layout": {"title": {"text": f"{metric}{' (95% CI over rollouts)' if has_ci else ''}"},
                                        "xaxis": {"title": {"text": "step"}}, "shapes": marks, "annotations": notes,
                                        "margin": {"t": 48, "r": 16}, "height": 300}}


def _charts(figures: dict[str, Any]) -> Html:
    return el("section", el("h2", "Timelines"), [el("div", class_="chart", data_fig=fig_id) for fig_id in figures])


def _changes(found: dict[str, Any]) -> Html:
    if not found["changes"] and not found["jumps"]:
        return el("section", el("h2", "Changes"), el("p", "None: ", found["method"]["change_points"]))
    items = []
    for change in found["changes"]:
        turns = ", ".join(f"turn {t['turn']} ({num(t['before'])} → {num(t['after'])})" for t in change["turns"])
        items.append(el("li", el("strong", f"step {change['step']}: {change['kind']}"), " — ",
                        "; ".join(change["causes"]), el("br"), "turns that grew most: ", turns or "–"))
    for jump in found["jumps"]:
        items.append(el("li", el("strong", f"step {jump['from_step']} → {jump['step']}"), " — ",
                        "; ".join(jump["causes"])))
    return el("section", el("h2", "Changes"), el("ul", items))


def _growth(found: dict[str, Any]) -> Html:
    growth = found.get("growth")
    if not growth:
        return Html("")
    rows = []
    for dimension, split in growth["strata"].items():
        if dimension == "explained_by":
            continue
        if "unavailable" in split:
            rows.append(el("tr", el("td", dimension), el("td", split["unavailable"], colspan="4")))
            continue
        hot = split.get("hot") or {}
        share = (lambda part: pct(part / split["growth"]) if split["growth"] else "–")
        rows.append(el("tr", el("td", dimension), el("td", num(split["growth"])), el("td", share(split["mix"])),
                       el("td", hot.get("where", "–")),
                       el("td", f"{pct(hot.get('growth_share'))} of the growth from {pct(hot.get('token_share'))} "
                                "of the tokens" if hot else "–")))
    return el("section", el("h2", f"Growth, steps {growth['before'][0]}… vs …{growth['after'][-1]}, by strata"),
              el("table", el("tr", el("th", "dimension"), el("th", "growth of k3"), el("th", "from the mix"),
                             el("th", "where it grew"), el("th", "concentration")), rows))


def _steps_table(found: dict[str, Any], here: Path) -> Html:
    metric = found["metric"]
    values = {row["step"]: row for row in found["series"][metric]}
    rows = []
    for step in found["steps"]:
        link = el("a", "report", href=os.path.relpath(step["report"], here)) if step["report"] else "–"
        row = values[step["step"]]
        rows.append(el("tr", el("td", str(step["step"])), el("td", num(row["value"])),
                       el("td", f"{num(row['ci_low'])} – {num(row['ci_high'])}"), el("td", step["headline"]), el("td", link)))
    return el("section", el("h2", "Steps"), el("table", el("tr", el("th", "step"), el("th", metric), el("th", "95% CI"),
                                                           el("th", "headline"), el("th", "")), rows))
