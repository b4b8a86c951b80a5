"""The report's building blocks: panels, chart placeholders, and any JSON
value as escaped markup (records as tables, objects as key/value lists).

Every section of the page (sections.py, advice.py) is put together from these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mismatch.present.numbers import num
from mismatch.reports.html import Html, el, join

MAX_TABLE_ROWS = 50


def chart(fig_id: str, caption: str | None = None) -> Html:
    return el("figure", el("div", class_="chart", id=f"chart-{fig_id}", data_fig=fig_id),
              el("figcaption", caption) if caption else None)


def pair_legend(colors: dict[str, str], pairs: list[str] | None = None) -> Html:
    return el("p", [el("span", el("span", class_="swatch", style=f"background:{colors[p]}"), p, class_="legend-item")
                    for p in (pairs or colors)], class_="pair-legend")


def section(anchor: str, title: str, *body: Any, lead: str | None = None) -> Html:
    return el("section", el("h2", title), el("p", lead, class_="lead") if lead else None, *body,
              id=anchor, class_="panel")


# --- generic renderers for the open-ended blocks (localization, findings) ------------------------

def value_html(value: Any, depth: int = 0) -> Html:
    """Any JSON value as escaped markup: records as tables, objects as key/value lists."""
    if isinstance(value, Html):
        return value
    if isinstance(value, dict):
        if not value:
            return el("span", "–")
        if depth > 0 and len(value) <= 4 and all(not isinstance(v, dict) for v in value.values()):
            # A small object inside a fact or a cell reads best on one line: "slope 1.2e−5 · ci95 …".
            return el("span", [join(" · " if i else None, el("span", str(k), class_="k"), " ",
                                    value_html(v, depth + 1)) for i, (k, v) in enumerate(value.items())],
                      class_="inline")
        rows = [el("tr", el("th", str(k), scope="row"), el("td", value_html(v, depth + 1))) for k, v in value.items()]
        return el("table", el("tbody", rows), class_="data kv")
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            return records_table(value)
        return el("span", ", ".join(num(v) if isinstance(v, (int, float)) else str(v) for v in value) or "–")
    if isinstance(value, float):
        return el("span", num(value, 6))
    if isinstance(value, str) and depth == 0 and ("\n" in value or len(value) > 60):
        return el("pre", value, class_="text")
    return el("span", num(value) if isinstance(value, int) else ("–" if value is None else str(value)))


def records_table(records: Sequence[Mapping[str, object]], *, limit: int = MAX_TABLE_ROWS,
                  highlight: set[int] | None = None) -> Html:
    """Rows as a table, one column per key any row has (in first-seen order; "–" where a row has none)."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    rows = [el("tr", [el("td", value_html(r.get(c), 1)) for c in columns],
               class_="highlight" if highlight and i in highlight else None)
            for i, r in enumerate(records[:limit])]
    more = len(records) - limit
    return join(el("table", el("thead", el("tr", [el("th", c) for c in columns])), el("tbody", rows),
                   class_="data"),
                el("p", f"… {more:,} more rows in summary.json", class_="note") if more > 0 else None)


def facts(items: list[tuple[str, Any]]) -> Html | None:
    shown = [(label, value) for label, value in items if value is not None]
    if not shown:
        return None
    return el("dl", [el("div", el("dt", label), el("dd", value_html(value, 1))) for label, value in shown],
              class_="facts")
