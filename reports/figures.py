"""Plotly figure specs as plain dicts (data + layout), drawn in the page by the embedded plotly.js.

Built from the aggregates only; plotly's Python package is used for nothing but its JS bundle, so
the figures stay small JSON and their colors and order are data-driven (one trace per pair).
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, TypedDict

from mismatch.reports.aggregate import BREAKDOWN_METRICS, Breakdown, Histogram
from mismatch.present.numbers import num
from mismatch.results.section_records import LayerLocalization, LayerRow, ModuleError
from mismatch.results.summary_model import present

FONT = "-apple-system, BlinkMacSystemFont, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
PAIR_PALETTE = ("#d9480f", "#6741d9", "#0c8599", "#2f9e44", "#c2255c", "#1971c2", "#e67700")
LEVEL_COLORS = {"exact": "#2b8a3e", "negligible": "#40c057", "small": "#f59f00", "large": "#e03131",
                "unknown": "#868e96"}
DEFAULT_METRIC = "log_ratio_abs_mean"


class Axis(TypedDict, total=False):
    """A plotly axis, the attributes these figures set (plotly.js layout.xaxis / yaxis)."""

    title: dict[str, object]
    gridcolor: str
    zerolinecolor: str
    linecolor: str
    automargin: bool
    type: str
    range: list[float]
    rangemode: str
    tick0: float
    dtick: float


class Layout(TypedDict, total=False):
    """A plotly layout, the attributes these figures set (plotly takes it as the dict it is)."""

    title: dict[str, object]
    height: int
    margin: dict[str, int]
    font: dict[str, object]
    paper_bgcolor: str
    plot_bgcolor: str
    hoverlabel: dict[str, object]
    showlegend: bool
    legend: dict[str, object]
    bargap: float
    barmode: str
    annotations: list[dict[str, object]]
    shapes: list[dict[str, object]]
    updatemenus: list[dict[str, object]]
    xaxis: Axis
    yaxis: Axis


class Figure(TypedDict):
    """A plotly figure as the page draws it: its traces (each plotly's own trace attributes) and layout."""

    data: list[dict[str, object]]
    layout: Layout


def plotly_text(value: Any) -> str:
    """Plotly renders labels, names and titles as pseudo-HTML: text from the data goes in escaped."""
    return escape(str(value), quote=False)


def pair_colors(pairs: list[str]) -> dict[str, str]:
    return {pair: PAIR_PALETTE[i % len(PAIR_PALETTE)] for i, pair in enumerate(pairs)}


def base_layout(*, height: int = 300, **extra: Any) -> Layout:
    layout: Layout = {"height": height, "margin": {"l": 64, "r": 16, "t": 16, "b": 52},
              "font": {"family": FONT, "size": 12, "color": "#343a40"},
              "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "#ffffff",
              "hoverlabel": {"font": {"family": FONT}}, "showlegend": False}
    layout.update(extra)
    return layout


def _axis(title: str, **extra: Any) -> Axis:
    return {"title": {"text": title, "standoff": 6}, "gridcolor": "#eef0f2", "zerolinecolor": "#ced4da",
            "linecolor": "#ced4da", "automargin": True, **extra}


def log_ratio_axis_title(pair: str) -> str:
    a, _, b = (plotly_text(part) for part in pair.partition("/"))
    return f"log π<sub>{a}</sub> − log π<sub>{b}</sub>"


def histogram_figure(pair: str, hist: Histogram, *, color: str, max_count: int) -> Figure:
    """Counts on a log axis (the tail is the story), one shared y-range across the pairs' panels."""
    edges = hist["edges"]
    centers = [(lo + hi) / 2 for lo, hi in zip(edges[:-1], edges[1:])]
    counts = [c if c > 0 else None for c in hist["counts"]]  # a log axis has no 0
    limit = hist["limit"]
    trace = {"type": "bar", "x": centers, "y": counts, "width": edges[1] - edges[0],
             "marker": {"color": color, "line": {"width": 0}}, "name": plotly_text(pair),
             "customdata": [[lo, hi] for lo, hi in zip(edges[:-1], edges[1:])],
             "hovertemplate": "log-ratio %{customdata[0]:.3g} to %{customdata[1]:.3g}<br>"
                              "%{y:,} tokens<extra></extra>"}
    annotations = []
    # Tokens beyond the shared range sit in the edge bins; say how many and how far, in each corner.
    for count, x, anchor, text in ((hist["n_below"], -limit, "left", f"◀ {hist['n_below']:,} < −{limit:g}"),
                                   (hist["n_above"], limit, "right", f"{hist['n_above']:,} > +{limit:g} ▶")):
        if count:
            extreme = hist["min"] if anchor == "left" else hist["max"]
            if extreme is not None:
                text += f" ({'min' if anchor == 'left' else 'max'} {num(extreme, 3)})"
            annotations.append({"x": x, "y": 1, "xref": "x", "yref": "paper", "text": text,
                                "showarrow": False, "xanchor": anchor, "yanchor": "bottom",
                                "font": {"size": 10.5, "color": "#c92a2a"}})
    top = math.log10(max(max_count, 1)) + 0.25
    layout = base_layout(
        height=260, bargap=0, annotations=annotations, margin={"l": 56, "r": 12, "t": 22, "b": 48},
        xaxis=_axis(log_ratio_axis_title(pair), range=[-limit * 1.02, limit * 1.02]),
        yaxis=_axis("tokens (log scale)", type="log", range=[-0.1, top], dtick=1),
        shapes=[{"type": "line", "x0": 0, "x1": 0, "y0": 0, "y1": 1, "yref": "paper",
                 "line": {"color": "#adb5bd", "width": 1, "dash": "dot"}}])
    return {"data": [trace], "layout": layout}


def breakdown_figure(block: Breakdown, *, colors: dict[str, str], categorical: bool,
                     bars: bool = False) -> Figure:
    """One trace per pair; a dropdown switches the statistic (same names as summary.json)."""
    series = block["series"]
    labels = [plotly_text(label) for label in block["labels"]]
    x = labels if categorical else block["x"]
    traces = []
    for n, (pair, values) in enumerate(series.items()):
        trace = {"type": "bar" if bars else "scatter", "name": plotly_text(pair), "x": x,
                 "y": values[DEFAULT_METRIC], "customdata": values["n_tokens"], "text": labels,
                 "marker": {"color": colors.get(pair, "#495057")},
                 # Names reach hover text via %{fullData.name}, never pasted into the template.
                 "hovertemplate": "<b>%{fullData.name}</b><br>%{text}<br>%{y:.4g}<br>%{customdata:,} tokens"
                                  "<extra></extra>"}
        if bars:
            trace["textposition"] = "none"  # `text` is for hover only
        else:
            # Dashes and marker shapes keep pairs with identical values (a bitwise-equal side) visible.
            trace.update(mode="lines+markers", connectgaps=False,
                         line={"width": 2, "dash": ("solid", "dash", "dot")[n % 3]},
                         marker={"color": colors.get(pair, "#495057"), "size": 7,
                                 "symbol": ("circle", "square", "diamond")[n % 3]})
        traces.append(trace)
    buttons = [{"label": label, "method": "update",
                "args": [{"y": [values[name] for values in series.values()]},
                         {"yaxis.title.text": label}]} for name, label in BREAKDOWN_METRICS.items()]
    x_axis = _axis(plotly_text(block["x_title"]), type="category" if categorical else "linear")
    if not categorical and block.get("integer_ticks"):
        x_axis.update(tick0=0, dtick=max(1, math.ceil(len(x) / 16)))
    # One HTML legend per section names the pairs' colors; a plotly legend would fight the menu.
    layout = base_layout(
        height=320, barmode="group", margin={"l": 64, "r": 16, "t": 44, "b": 56},
        xaxis=x_axis,
        yaxis=_axis(BREAKDOWN_METRICS[DEFAULT_METRIC], rangemode="tozero"),
        updatemenus=[{"type": "dropdown", "buttons": buttons, "x": 0, "xanchor": "left", "y": 1.02,
                      "yanchor": "bottom", "showactive": True, "bgcolor": "#f8f9fa",
                      "bordercolor": "#ced4da", "font": {"size": 12}}])
    return {"data": traces, "layout": layout}


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _layer_series(row: LayerRow) -> str:
    """One line per hooked point: "residual", "attn", "norm: input_layernorm" (two norms per layer)."""
    block, module = present(row.block), present(row.module)
    if block is None:
        return str(module or "value")
    if module is None or module in (block, "output") or block == "residual":
        return str(block)
    return f"{block}: {module}"


def layer_figure(layers: LayerLocalization) -> Figure | None:
    """by_layer's rel_error along depth, one line per sub-block, the jump layer marked."""
    rows = layers.by_layer or []
    if not any(_numeric(r.rel_error) for r in rows):
        return None
    groups: dict[str, list[LayerRow]] = {}
    for r in rows:
        groups.setdefault(_layer_series(r), []).append(r)
    traces = []
    for i, (name, members) in enumerate(groups.items()):
        traces.append({"type": "scatter", "mode": "lines+markers", "name": plotly_text(name),
                       "x": [present(m.layer) for m in members],
                       "y": [m.rel_error if _numeric(m.rel_error) else None for m in members],
                       "marker": {"color": PAIR_PALETTE[i % len(PAIR_PALETTE)]},
                       "hovertemplate": "<b>%{fullData.name}</b><br>%{x}<br>%{y:.4g}<extra></extra>"})
    positive = all(v is None or v > 0 for t in traces for v in t["y"])
    shapes = []
    if _numeric(layers.jump_layer):
        shapes.append({"type": "line", "x0": layers.jump_layer, "x1": layers.jump_layer, "y0": 0,
                       "y1": 1, "yref": "paper", "line": {"color": "#e03131", "width": 2, "dash": "dash"}})
    x_values = [x for t in traces for x in t["x"]]
    x_axis = _axis("layer")
    if x_values and all(isinstance(x, int) for x in x_values):
        x_axis.update(tick0=0, dtick=max(1, math.ceil(len(set(x_values)) / 16)))  # layers are integers
    layout = base_layout(height=320, showlegend=len(traces) > 1, shapes=shapes,
                         legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"}, xaxis=x_axis,
                         yaxis=_axis("rel_error" + (" (log scale)" if positive else ""),
                                     type="log" if positive else "linear"))
    return {"data": traces, "layout": layout}


def ranked_bar_figure(modules: list[ModuleError], *, limit: int = 15) -> Figure | None:
    """by_module's top entries (most introduced error first) as horizontal bars of their rel_error."""
    rows = modules[:limit]
    if not rows:
        return None
    labels = [plotly_text(present(r.name)) for r in rows][::-1]
    values = [r.rel_error if _numeric(r.rel_error) else None for r in rows][::-1]
    trace = {"type": "bar", "orientation": "h", "x": values, "y": labels, "marker": {"color": "#6741d9"},
             "hovertemplate": "%{y}<br>%{x:.4g}<extra></extra>"}
    layout = base_layout(height=max(200, 26 * len(rows) + 70), margin={"l": 16, "r": 16, "t": 10, "b": 48},
                         xaxis=_axis("rel_error"), yaxis={"automargin": True, "type": "category"})
    return {"data": [trace], "layout": layout}
