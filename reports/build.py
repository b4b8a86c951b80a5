"""`build_report(DIR)`: summary.json + tokens.parquet → DIR/index.html, one self-contained page.

The last step of the flow (results dir → HTML). It reads the results dir through its contract
module, `mismatch.results` (names, readers, `json_safe`), and imports neither torch nor the engines.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, TypedDict

import pandas as pd

from mismatch.results.chunks import ChunkSource
from mismatch.errors import ReportError, ResultsError
from mismatch.results import REPORT_FILE, TOKENS_FILE, json_safe, tokens_chunks
from mismatch.results import read_summary as read_results_summary
from mismatch.reports import advice, aggregate, figures, sections
from mismatch.present.headline import banner, focus_pair
from mismatch.reports.blocks import section
from mismatch.reports.digest import Chunks, Digest, DigestAnalysis, digest
from mismatch.reports.figures import Figure
from mismatch.reports.html import Html, el, join
from mismatch.reports.worst import WorstBlock, WorstOptions
from mismatch.results.summary_model import Summary, present

TEMPLATES = Path(__file__).with_name("templates")


class PageData(TypedDict):
    """The JSON the page's script reads (templates/report.js): the figures by id, the worst
    rollouts token by token, and each pair's color."""

    figures: dict[str, Figure]
    worst: WorstBlock | None
    colors: dict[str, str]


def read_summary(results_dir: Path) -> Summary:
    try:
        return read_results_summary(results_dir)
    except ResultsError as exc:  # the report's own error kind, for callers that catch it
        raise ReportError(str(exc)) from None


def check_results(results_dir: Path, summary: Summary) -> None:
    """tokens.parquet and rollouts.parquet are the ones summary.json recorded (results.verify): the
    page must never show another run's tokens, or half of them, under this run's numbers."""
    from mismatch.results.verify import check_tables

    try:
        check_tables(results_dir, summary)
    except ResultsError as exc:
        raise ReportError(str(exc)) from None


def token_chunks(results_dir: Path) -> tuple[Chunks, list[str]]:
    """tokens.parquet's chunks of whole rollouts (only what the charts and the worst rollouts read:
    the tree weights and the rest stay on disk), and the columns they have. A log-prob above 0 or
    infinite is refused as the chunk is read: no run stores one (replay.checks.check_column)."""
    path = results_dir / TOKENS_FILE
    if not path.is_file():
        raise ReportError(f"{results_dir}: no {TOKENS_FILE}")
    import pyarrow.parquet as pq

    wanted = {"rollout", "branch", "branch_kind", "turn", "segment", "pos", "role", "token_id", "trainable"}
    names = [n for n in pq.ParquetFile(path).schema_arrow.names if n in wanted or n.startswith("logp_")]
    missing = {"rollout", "branch", "turn", "pos", "role", "token_id", "trainable"} - set(names)
    if missing:
        raise ReportError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
    source = tokens_chunks([path], columns=names)

    def read(number: int) -> pd.DataFrame:
        chunk = source.read(number)
        for name in (n for n in chunk.columns if n.startswith("logp_")):
            values = chunk[name].to_numpy("float64", na_value=float("nan"))
            bad = (values > 0) | (values == float("-inf"))
            if bad.any():
                raise ReportError(f"{path}: {name} holds {float(values[bad][0])!r} (a log-prob is finite and <= 0): "
                                  "not a table a run writes")
        return _with_defaults(chunk)
    return ChunkSource(count=source.count, read=read), names


def _with_defaults(chunk: pd.DataFrame) -> pd.DataFrame:
    """The columns an older table lacks, at what they meant then (one main branch, one segment)."""
    if "branch_kind" not in chunk.columns:
        chunk["branch_kind"] = "main"
    if "segment" not in chunk.columns:
        chunk["segment"] = 0
    return chunk


def find_tokenizer(summary: Summary, results_dir: Path) -> Path | None:
    """The checkpoint's tokenizer.json: as recorded (relative to the cwd or the results dir's parent)."""
    checkpoints = [summary.checkpoint, *(present(summary.engine(source).checkpoint) for source in summary.engines)]
    for checkpoint in filter(None, checkpoints):
        for base in (Path.cwd(), results_dir.parent, results_dir.parent.parent):
            candidate = (base / str(checkpoint) / "tokenizer.json")
            if candidate.is_file():
                return candidate
    return None


def script_json(data: Any) -> str:
    """JSON that is inert inside <script type="application/json">: no '<', '>' or '&' survives.

    Escaped as \\u003c etc., which JSON.parse reads back as the same characters, so token text like
    `</script><img onerror=…>` can never close the block or open a tag.
    """
    text = json.dumps(json_safe(data), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


# plotly.js's "basic" bundle (scatter, bar, pie and the core: axes, shapes, legends, menus), the
# npm package plotly.js-basic-dist-min 4.1.1, MIT (its header keeps the notice): the report draws
# only bar and scatter traces, and the full bundle (4.8 MB) made each report 5 MB.
PLOTLY_BUNDLE = TEMPLATES / "plotly-basic.min.js"


@lru_cache(maxsize=1)
def plotly_js() -> str:
    source = PLOTLY_BUNDLE.read_text(encoding="utf-8")
    # The bundle goes into a <script> element verbatim: it must not be able to close it.
    if re.search(r"</script", source, re.IGNORECASE):
        raise RuntimeError("plotly.js bundle contains '</script': cannot inline it safely")
    return source


def csp_hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


def chart_figures(summary: Summary, found: Digest, pairs: list[str],
                  colors: dict[str, str]) -> dict[str, Figure]:
    """Every chart of the page by id; a chart whose data are absent is simply not in the dict."""
    figs: dict[str, Figure] = {}
    if found.histograms:
        max_count = max(max(h["counts"]) for h in found.histograms.values())
        for pair, hist in found.histograms.items():
            figs[f"hist-{pair}"] = figures.histogram_figure(pair, hist, color=colors[pair], max_count=max_count)
    turn = aggregate.by_key_from_summary([(row.turn, row.pairs) for row in summary.turns], "turn", pairs,
                                         x_title="turn") or found.by_turn
    blocks = {"turn": (turn, False, False), "position": (found.by_position, False, False),
              "prob": (aggregate.by_probability_from_summary(summary, pairs), True, True),
              "branch_kind": (aggregate.by_key_from_summary([(row.branch_kind, row.pairs) for row in summary.branch_kinds],
                                                            "branch_kind", pairs, x_title="branch kind"), True, True)}
    for fig_id, (block, categorical, bars) in blocks.items():
        if block is not None:
            figs[fig_id] = figures.breakdown_figure(block, colors=colors, categorical=categorical, bars=bars)
    localization = summary.localization
    if localization.layers and (fig := figures.layer_figure(localization.layers)):
        figs["layers"] = fig
    kernels = localization.kernels
    if kernels and kernels.by_module and (fig := figures.ranked_bar_figure(kernels.by_module)):
        figs["kernels"] = fig
    return figs


def distribution_section(pairs: list[str], figs: dict[str, Figure], colors: dict[str, str]) -> Html | None:
    panels = [el("figure", el("figcaption", el("span", class_="swatch", style=f"background:{colors[p]}"), p),
                 el("div", class_="chart", id=f"chart-hist-{i}", data_fig=f"hist-{p}"), class_="hist")
              for i, p in enumerate(pairs) if f"hist-{p}" in figs]
    if not panels:
        return None
    return section("distribution", "Distribution of the log-ratio",
                   el("div", panels, class_=f"grid-{min(len(panels), 3)}"),
                   lead="Trainable tokens, counts on a log scale, one x-range for every pair: "
                        "the tails are what PPO's ratio feels.")


def _moved_token_texts(summary: Summary, tokenizer_path: Path | None) -> dict[str, str] | None:
    """The text of each token the distribution pass names (often one no rollout sampled)."""
    from mismatch.reports.worst import token_texts

    found = present(summary.distribution) or {}
    ids = {int(t["token_id"]) for gap in found.values() for t in gap.tokens or ()}  # each: token_id, tv_share, n_positions
    return token_texts(ids, tokenizer_path) if ids else None


def page_body(summary: Summary, tokens: tuple[Chunks, list[str]], *, tokenizer_path: Path | None,
              worst_options: WorstOptions, digested: DigestAnalysis | None = None) -> tuple[Html, PageData, str]:
    """(static markup, JSON data for the page's script, page title); `tokens` as token_chunks gives
    them. `digested`: the tokens already read for the page in the analysis's passes, used when it
    read them for this summary's pairs and focus (else they are read here)."""
    pairs = list(summary.pairs)
    colors = figures.pair_colors(pairs)
    focus = focus_pair(summary)
    is_audit = summary.command != "diff"
    if (digested is not None and digested.pairs == pairs and digested.focus == focus
            and digested.options == worst_options and digested.with_turns >= (not summary.turns)
            and digested.with_worst_tokens == is_audit):
        found = digested.result(tokenizer_path)
    else:
        chunks, columns = tokens
        expected = {pair: metrics.n_tokens for pair, metrics in summary.pairs.items() if metrics.n_tokens is not None}
        found = digest(chunks, columns, pairs=pairs, focus=focus, tokenizer_path=tokenizer_path,
                       options=worst_options, with_turns=not summary.turns,
                       with_worst_tokens=is_audit, expected=expected)
    figs = chart_figures(summary, found, pairs, colors)
    worst = found.worst if focus in found.scored else None
    texts = worst["text"] if worst else None
    top = banner(summary)
    nav = [("verdict", "Verdict"), ("snippet", "Snippet"), ("gaps", "Gaps"), ("diff", "A vs B"), ("distribution", "Distribution"),
           ("next-token", "Next-token"), ("where", "Where"), ("localization", "Localization"),
           ("findings", "Findings"), ("corrections", "Corrections"), ("frameworks", "Frameworks"),
           ("worst", "Worst rollouts")]
    body = [
        sections.banner_html(top),
        advice.first_screen_snippet(summary),
        sections.context_line(summary),
        sections.gaps_section(summary, pairs, colors),
        sections.diff_section(summary, texts),
        distribution_section(pairs, figs, colors),
        sections.next_token_section(summary, _moved_token_texts(summary, tokenizer_path)),
        sections.where_section(summary, pairs, figs, colors),
        sections.localization_section(summary, figs),
        sections.findings_section(summary),
        advice.corrections_section(summary),
        sections.frameworks_section(summary),
        sections.worst_section(worst, found.worst_tokens if worst and is_audit else None),
        sections.absent_line(summary),
        sections.footer(summary),
    ]
    body = [part for part in body if part]
    present = {anchor for anchor, _ in nav if any(f'id="{anchor}"' in part for part in body)}
    header = el("header", el("div", el("span", "mismatch", class_="brand"), el("span", "report", class_="brand-sub"),
                             class_="brand-box"),
                el("nav", [el("a", label, href=f"#{anchor}") for anchor, label in nav if anchor in present]),
                class_="top")
    data: PageData = {"figures": figs, "worst": worst, "colors": colors}
    title = f"mismatch {summary.command}: {top.label.lower()}"
    return join(header, el("main", body)), data, title


def render_page(body: Html, data: PageData, title: str) -> str:
    template = (TEMPLATES / "report.html").read_text()
    app_js = (TEMPLATES / "report.js").read_text()
    plotly = plotly_js()
    parts = {
        "TITLE": el("title", title),
        "CSS": (TEMPLATES / "report.css").read_text(),
        # Only our two scripts may run: an injected inline handler or <script> would be blocked
        # even if escaping ever failed, and default-src 'none' forbids every network fetch.
        "SCRIPT_HASHES": f"{csp_hash(plotly)} {csp_hash(app_js)}",
        "BODY": body,
        "DATA": script_json(data),
        "PLOTLY": plotly,
        "APP": app_js,
    }
    # One pass over the template: inserted text is never scanned for placeholders again.
    return re.sub(r"@@([A-Z_]+)@@", lambda m: parts[m.group(1)], template)


def atomic_write(path: Path, text: str) -> None:
    """temp file + rename: a reader sees the old report or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600; a report is meant to be shared
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_report(results_dir: Path, *, tokenizer_path: Path | None = None,
                 worst_options: WorstOptions = WorstOptions(), digested: DigestAnalysis | None = None,
                 verify: bool = True) -> Path:
    """Write `results_dir/index.html` from its summary.json and tokens.parquet; return its path.

    Token text comes from `tokenizer_path` (a tokenizer.json), else from the checkpoint the
    summary names when it can be found; without one, tokens show as their ids. `digested`: the
    page's reading of the tokens, run in the analysis's passes (page_body). `verify`: check the
    tables against summary.json first (check_results); the run that has just written them in its
    staged dir skips hashing them again.
    """
    results_dir = Path(results_dir)
    summary = read_summary(results_dir)
    if verify:
        check_results(results_dir, summary)
    tokens = token_chunks(results_dir)
    if tokenizer_path is None:
        tokenizer_path = find_tokenizer(summary, results_dir)
    body, data, title = page_body(summary, tokens, tokenizer_path=tokenizer_path, worst_options=worst_options,
                                  digested=digested)
    out = results_dir / REPORT_FILE
    atomic_write(out, render_page(body, data, title))
    return out


if __name__ == "__main__":  # `python -m mismatch.reports.build DIR`: the same as `mismatch report DIR`, torch-free
    import sys

    print(build_report(Path(sys.argv[1])))
