"""The report's static sections as escaped HTML, top to bottom; charts are placeholders the page fills.

Each section takes the summary (and the aggregates) and returns markup, or None when its data are
absent, so a section never shows a number the results dir does not hold. The recommendation and
corrections are advice.py's; the blocks every section is made of (tables, facts, panels), blocks.py's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from msgspec import UNSET

from mismatch.present.headline import Banner, focus_pair, prefix_sentence, role_spec
from mismatch.present.numbers import formatted, num, pct
from mismatch.reports.aggregate import pair_roles
from mismatch.reports.blocks import chart, facts, pair_legend, records_table, section, value_html
from mismatch.reports.figures import LEVEL_COLORS, Figure
from mismatch.reports.worst import WorstBlock
from mismatch.reports.html import Html, el, join
from mismatch.results.section_records import KernelLocalization, LayerLocalization, PositionSlope
from mismatch.results.summary_model import PairMetrics, Summary, present, to_builtins

# One name per quantity: each card row is labelled with its summary.json key (docs/glossary.md).
CARD_METRICS = (("kl_k3", "kl_k3", "num"), ("log_ratio_abs_mean", "log_ratio_abs_mean", "num"),
                ("log_ratio_abs_max", "log_ratio_abs_max", "num"),
                (("ratio_q001", "ratio_q999"), "ratio_q001 – ratio_q999", "range"), ("chi2_token", "chi2_token", "num"),
                ("ess", "ess", "num"), ("frac_outside_2", "frac_outside_2", "pct"),
                ("bitwise_equal_frac", "bitwise_equal_frac", "pct"), ("n_tokens", "n_tokens", "num"))


# --- header and verdict -------------------------------------------------------------------------

def context_line(summary: Summary) -> Html:
    counts = summary.counts
    items = []
    if counts.tokens is not UNSET:  # a summary made by hand may count nothing
        items.append(f"{num(present(counts.rollouts))} rollouts · {num(present(counts.branches))} branches · "
                     f"{num(present(counts.tokens))} tokens ({num(present(counts.trainable_tokens))} trainable)")
    for label, value in (("checkpoint", summary.checkpoint), ("rollouts", summary.rollouts_file)):
        if value:
            items.append(join(label, " ", el("code", value)))
    if summary.created_unix:  # 0: a summary made by hand (results.summary_model.partial_summary)
        items.append(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(summary.created_unix)))
    if summary.mismatch_version:
        items.append(f"mismatch {summary.mismatch_version} · {summary.command}")
    items.append(join("every term: ", el("code", "docs/glossary.md"), " in mismatch's source"))
    separated = [join(el("span", " · ", class_="sep") if i else None, item) for i, item in enumerate(items)]
    return el("p", separated, class_="context")


def tile_value(value: Any, kind: str) -> Html:
    """A tile's number, with `--chars`: the widest line it needs (a range may break at its dash), so
    the CSS shrinks its font to fit the tile instead of letting it spill out (report.css, .tile)."""
    text = formatted(value, kind)
    words = text.split()
    chars = max(len(w) for w in words) + (2 if len(words) > 1 else 0) if words else 1
    return el("div", text, class_="tile-value tile-range" if kind in ("range", "ci") else "tile-value",
              style=f"--chars: {chars}")


def banner_html(b: Banner) -> Html:
    tiles = [el("div", tile_value(value, kind), el("div", label, class_="tile-label"), class_="tile")
             for label, value, kind in b.numbers if value is not None]
    return el("section",
              el("div", el("span", b.label, class_="pill"), el("h1", b.headline, id="verdict-headline"),
                 class_="banner-head"),
              [el("p", line, class_="banner-detail") for line in b.details],
              el("div", tiles, class_="tiles") if tiles else None,
              id="verdict", class_=f"banner status-{b.status}")


# --- the gaps -----------------------------------------------------------------------------------

def pair_card(summary: Summary, pair: str, color: str) -> Html:
    metrics = summary.pairs[pair]
    verdict = summary.verdicts.get(pair)
    level = verdict.level if verdict is not None else "unknown"
    a, b = pair_roles(pair)
    sub = f"{a} = {role_spec(summary, a)}  vs  {b} = {role_spec(summary, b)}"
    text = verdict.text.split(" (kl_k3", 1)[0] if verdict is not None else ""
    meaning = present(verdict.meaning) if verdict is not None else None
    return el("article",
              el("header", el("span", class_="swatch", style=f"background:{color}"), el("h3", pair),
                 el("span", level.upper() if verdict is not None else "NOT JUDGED", class_=f"level level-{level}")),
              el("p", meaning, class_="meaning") if meaning else None,
              el("p", el("code", sub), class_="specs"),
              el("p", text, class_="verdict-text") if text else None,
              el("dl", [el("div", el("dt", label), el("dd", formatted(_metric(metrics, key), kind)))
                        for key, label, kind in CARD_METRICS], class_="metrics"),
              class_=f"card level-{level}")


def _metric(metrics: PairMetrics, key: str | tuple[str, ...]) -> Any:
    return tuple(getattr(metrics, k) for k in key) if isinstance(key, tuple) else getattr(metrics, key)


def triangle_svg(summary: Summary, pairs: list[str]) -> Html | None:
    """Three roles, three edges colored by level: the triangle of an audit (or a diff) at a glance."""
    roles = list(dict.fromkeys(r for pair in pairs for r in pair_roles(pair)))
    if len(pairs) != 3 or len(roles) != 3:
        return None
    points = {roles[0]: (150, 34), roles[1]: (44, 196), roles[2]: (256, 196)}
    edges, labels = [], []
    for pair in pairs:
        a, b = pair_roles(pair)
        (x1, y1), (x2, y2) = points[a], points[b]
        level = summary.verdicts[pair].level if pair in summary.verdicts else "unknown"
        color = LEVEL_COLORS.get(level, LEVEL_COLORS["unknown"])
        edges.append(el("line", x1=x1, y1=y1, x2=x2, y2=y2, stroke=color, stroke_width=7,
                        stroke_linecap="round"))
        mx, my = (x1 + x2) / 2, (y1 + y2) / 2
        dx = -30 if mx < 150 else (30 if mx > 150 else 0)
        dy = 22 if mx == 150 else 0
        labels.append(el("text", level, x=mx + dx, y=my + dy, fill=color, text_anchor="middle",
                         class_="tri-level"))
    nodes = [join(el("circle", cx=x, cy=y, r=27, class_="tri-node"),
                  el("text", role, x=x, y=y + 4, text_anchor="middle", class_="tri-role"))
             for role, (x, y) in points.items()]
    return el("svg", edges, labels, nodes, viewBox="0 -4 300 232", class_="triangle", role="img",
              aria_label="the triangle of gaps")


def metrics_table(summary: Summary, pairs: list[str]) -> Html:
    names = PairMetrics.__struct_fields__
    head = el("tr", el("th", "metric"), [el("th", pair) for pair in pairs])
    rows = [el("tr", el("th", name, scope="row"),
               [el("td", num(getattr(summary.pairs[pair], name), 6)) for pair in pairs]) for name in names]
    return el("details", el("summary", "All pair metrics"),
              el("table", el("thead", head), el("tbody", rows), class_="data num"))


def gaps_section(summary: Summary, pairs: list[str], colors: dict[str, str]) -> Html:
    is_diff = summary.command == "diff"
    title = "The gaps, side by side" if is_diff else "The three gaps of the triangle"
    lead = ("Each pair A/B is log π_A − log π_B over trainable tokens: ratio = π_A / π_B as PPO uses it.")
    triangle = triangle_svg(summary, pairs)
    negative_chi2 = any(v is not None and v < 0 for p in pairs
                        for v in (summary.pairs[p].chi2_token, summary.pairs[p].chi2_seq))
    caveat = el("p", "A χ² below 0 is an estimate, not a divergence: mean(r²) − 1 over a sample can dip "
                     "under its true value (≥ 0) when the gap is small; read it as ≈ 0.",
                class_="note") if negative_chi2 else None
    return section("gaps", title,
                   el("div", el("div", triangle, class_="triangle-box") if triangle else None,
                      el("div", [pair_card(summary, p, colors[p]) for p in pairs], class_="cards"),
                      class_="gaps"),
                   caveat, metrics_table(summary, pairs), lead=lead)


# --- where: turn, position, probability, branch kind ----------------------------------------------

def slope_text(fit: PositionSlope | None) -> str | None:
    """position_slope ({slope_per_1k, ci95_per_1k, grows_with_position, …}) in one line."""
    if fit is None or fit.slope_per_1k is UNSET:
        return None
    if fit.slope_per_1k is None:
        return "not enough tokens to fit"
    ci = fit.ci95_per_1k or [None, None]
    grows = "grows with context" if fit.grows_with_position else "no significant growth"
    p_value = present(fit.p_value)
    return (f"{num(fit.slope_per_1k, 3)} |log-ratio| per 1k tokens, 95% CI {formatted(tuple(ci), 'ci')}"
            f"{', p ' + num(p_value, 2) if p_value is not None else ''}: {grows}")


def turn_facts(summary: Summary) -> Html | None:
    """localization["turns"]: the onset turn and the drift along position, tables one click away."""
    turns = present(summary.localization.turns)
    if turns is None:
        return None
    onset = turns.onset_turn if turns.onset_turn is not UNSET else "not computed"
    items = [("onset turn" + (f" ({turns.pair})" if turns.pair else ""),
              "none: no turn departs from the earlier ones" if onset is None else onset),
             ("drift along position", slope_text(present(turns.position_slope)))]
    # every field as summary.json holds it: the tables (lists) and the onset rule
    fields = to_builtins(turns)
    tables = {k: v for k, v in fields.items() if isinstance(v, list) and v}
    rules = {k: v for k, v in fields.items() if k in ("onset_rule", "onset_params")}
    lines = el("ul", [el("li", el("strong", label + ": "), value_html(value, 1)) for label, value in items],
               class_="fact-lines")
    return join(lines,
                el("details", el("summary", "Turn localization: tables and the onset rule"),
                   [join(el("h4", k.replace("_", " ")), value_html(v)) for k, v in tables.items()],
                   value_html(rules) if rules else None) if tables or rules else None)


def branch_table(summary: Summary, pairs: list[str]) -> Html | None:
    """summary.json `branch_kinds` as rows (kind × pair) with the key metrics."""
    records = []
    for row in summary.branch_kinds:
        for pair in pairs:
            metrics = row.pairs.get(pair)
            if metrics is not None and metrics.n_tokens:
                records.append({"branch kind": row.branch_kind, "pair": pair,
                                "tokens": metrics.n_tokens, "rollouts": metrics.n_rollouts,
                                "mean |log-ratio|": metrics.log_ratio_abs_mean,
                                "kl_k3": metrics.kl_k3, "max |log-ratio|": metrics.log_ratio_abs_max,
                                "ESS": metrics.ess})
    if not records:
        return None
    return el("details", el("summary", "By branch kind: table"), records_table(records), id="branches")


def where_section(summary: Summary, pairs: list[str], figures: dict[str, Figure],
                  colors: dict[str, str]) -> Html | None:
    """Turn, position, probability bucket and branch kind: four views of one question, 2 × 2."""
    turn = turn_facts(summary)
    captions = (("turn", "By turn: a turn is one model segment with the context before it."),
                ("position", "By position in the token stream, binned."),
                ("prob", "By the probability the pair's B side gave the token: low-probability tokens "
                         "are where mismatch bites."),
                ("branch_kind", "By branch kind (trees: main, subagents, summaries), each over its own "
                                "trainable tokens."))
    charts = [chart(fig_id, caption) for fig_id, caption in captions if fig_id in figures]
    table = branch_table(summary, pairs)
    if not (turn or charts or table):
        return None
    return section("where", "Where the gap is", turn, pair_legend(colors) if charts else None,
                   el("div", charts, class_="grid-2") if charts else None, table,
                   lead="Pick the statistic in each chart's menu; hover for token counts.")


# --- localization, findings -----------------------------------------------------------------------

LAYER_FACTS = (("jump_layer", "error jumps at layer"), ("jump_block", "in sub-block"), ("jump_module", "module"),
               ("embed_rel_error", "embedding rel. error"), ("output_logp_abs_diff_mean", "output mean |Δ logp|"),
               ("a", "a"), ("b", "b (reference)"), ("num_sequences", "sequences"), ("num_tokens", "tokens compared"))
KERNEL_FACTS = (("candidate", "candidate"), ("reference", "reference"), ("num_sequences", "sequences"),
                ("num_tokens", "tokens compared"))
METHOD_KEYS = ("method", "jump_rule")


def _named_facts(block: LayerLocalization | KernelLocalization, names: tuple[tuple[str, str], ...]) -> Html | None:
    values = [(label, getattr(block, key)) for key, label in names]  # the record's fields, by the table's names
    return facts([(label, value if value is not None else "none") for label, value in values if value is not UNSET])


def _method(block: LayerLocalization | KernelLocalization) -> Html | None:
    texts = [(k, text) for k in METHOD_KEYS if isinstance(text := getattr(block, k, None), str)]
    if not texts:
        return None
    return el("details", el("summary", "How this was measured"),
              [el("p", join(el("strong", k.replace("_", " ") + ": "), text), class_="note") for k, text in texts])


def localization_section(summary: Summary, figures: dict[str, Figure]) -> Html | None:
    """localization["layers"] and ["kernels"] (turns are under "Where the gap is")."""
    localization = summary.localization
    parts: list[Any] = []
    layers = present(localization.layers)
    if layers is not None:
        shown = {key for key, _ in LAYER_FACTS} | set(METHOD_KEYS) | {"by_layer"}
        rest = {k: v for k, v in to_builtins(layers).items() if k not in shown}  # skipped, the dist jump, ...
        parts += [el("h3", "By layer"), _named_facts(layers, LAYER_FACTS),
                  chart("layers", "Relative error of the hidden states along depth, per sub-block; "
                                  "the dashed line marks the jump layer.") if "layers" in figures else None,
                  el("details", el("summary", "by_layer table (logit lens included)"),
                     value_html(to_builtins(layers.by_layer))) if layers.by_layer else None,
                  value_html(rest) if rest else None,
                  _method(layers)]
    kernels = present(localization.kernels)
    if kernels is not None:
        shown = {key for key, _ in KERNEL_FACTS} | set(METHOD_KEYS)
        parts += [el("h3", "By kernel: error each module introduces on the reference's input, ranked"),
                  _named_facts(kernels, KERNEL_FACTS),
                  chart("kernels") if "kernels" in figures else None]
        for key, value in to_builtins(kernels).items():
            if key not in shown:
                parts.append(el("details", el("summary", key.replace("_", " ")), value_html(value),
                                open=key == "by_type" or None))
        parts.append(_method(kernels))
    others = {k: v for k, v in to_builtins(localization).items() if k not in ("turns", "layers", "kernels") and v}
    if others:
        parts.append(value_html(others))
    if not any(parts):
        return None
    return section("localization", "Layer and kernel localization", parts)


def _pct_or_none(value: Any) -> str | None:
    return pct(value) if isinstance(value, (int, float)) else None


def findings_section(summary: Summary) -> Html | None:
    parts = []
    checked = present(summary.alignment)
    if checked is not None and to_builtins(checked):  # `{}`: nothing stored to check
        shift, semantics, zero = present(checked.shift), present(checked.logprob_semantics), present(checked.padded_zero_frac)
        flags = []
        if shift:
            flags.append(f"Stored log-probs fit better shifted by {shift:+d} position: an off-by-one "
                         "in the harness; no metric is trustworthy until it is fixed.")
        if semantics == "processed":
            flags.append("Stored log-probs are processed (temperature / top-p / top-k renormalized) "
                         "while the trainer's are raw: compare like for like.")
        if zero is not None and zero > 0:
            flags.append(f"{pct(zero)} of positions carry padded-zero or constant log-probs.")
        findings = checked.findings
        parts += [el("h3", "Alignment"), [el("p", f, class_="flag") for f in flags],
                  facts([("shift (stored[i] fits token i + shift)", shift), ("log-prob semantics", semantics),
                         ("estimated temperature", present(checked.estimated_temperature)),
                         ("trainable tokens without a stored log-prob", _pct_or_none(checked.missing_trainable_frac)),
                         ("padded zeros", _pct_or_none(zero)), ("constant runs", _pct_or_none(checked.constant_frac))]),
                  el("ul", [el("li", el("strong", present(f.kind) or ""), ": ", present(f.message) or "",
                               el("p", "Fix: " + f.fix, class_="note") if f.fix else None)
                            for f in findings], class_="findings") if findings else None,
                  el("details", el("summary", "Every alignment field"), value_html(to_builtins(checked)))]
    drift = present(summary.drift)
    if drift is not None and to_builtins(drift):
        spans = drift.spans or []
        parts.append(el("h3", f"Render drift: {len(spans):,} drifted span{'s' if len(spans) != 1 else ''}"))
        if spans:
            # Stored vs rendered text is the finding: monospace, whitespace kept.
            # The columns a reader needs; ids and contexts stay in summary.json.
            shown = ("rollout", "turn", "role", "kind", "trainable_tokens", "stored", "rendered")
            if any(span.at_turn is not UNSET for span in spans):  # recorded by `mismatch record`: where, and when sent
                shown = ("rollout", "branch", "turn", "at_turn", *shown[2:])
            rows = [{k: present(getattr(span, k)) for k in shown} for span in spans]  # DriftSpan's fields, by name
            parts.append(records_table([{k: el("code", v, class_="span-text") if k in ("stored", "rendered")
                                         and isinstance(v, str) else v for k, v in row.items()} for row in rows]))
        parts.append(facts([(k.replace("_", " "), v) for k, v in to_builtins(drift).items()
                            if k != "spans" and isinstance(v, (int, float, str))]))
    parts += _prefix_parts(summary)
    if not parts:
        return None
    return section("findings", "Render, alignment and prefix findings", parts)


def _prefix_parts(summary: Summary) -> list[Html]:
    """Prefix consistency per source: the same prefix must get the same log-prob in every request."""
    found = {source: item for source, item in summary.prefix_findings().items() if item.n_prefixes}
    if not found:
        return []
    flags = [el("p", prefix_sentence(source, item, summary.engine(source)), class_="flag")
             for source, item in summary.split_prefixes().items() if source in found]
    rows = [{"source": source, "tokens sharing a prefix": present(item.n_shared_tokens),
             "shared prefixes": present(item.n_prefixes),
             "bitwise equal": _pct_or_none(item.frac_prefixes_bitwise_equal),
             "largest spread": present(item.max_abs_spread)} for source, item in found.items()]
    return [el("h3", "Prefix consistency"), flags, records_table(rows)]


# --- the framework crosswalk ---------------------------------------------------------------------

def frameworks_section(summary: Summary) -> Html | None:
    """The focus pair under each framework's own metric names (summary.json framework_metrics), with
    the crosswalk: our metric when it is the same number, and how it differs when it is not."""
    from mismatch.frameworks.metrics import crosswalk_rows

    by_pair = present(summary.framework_metrics) or {}
    pair = focus_pair(summary)
    values = by_pair.get(pair)
    if not values:
        return None
    records = [{"framework": row["framework"], "logged as": row["key"],
                "value": (values.get(row["framework"]) or {}).get(row["key"]),
                "mismatch's metric": row["ours"] or "–", "how it differs": row["note"] or "same number"}
               for row in crosswalk_rows()]
    return section("frameworks", "Under your framework's names", records_table(records, limit=len(records)),
                   lead=f"{pair}, as verl, TRL, slime, prime-rl, OpenRLHF and AReaL log it, computed their way "
                        "(at the settings in summary.json framework_settings).")


# --- diff ----------------------------------------------------------------------------------------

def diff_section(summary: Summary, texts: dict[str, str] | None) -> Html | None:
    if summary.command != "diff" or present(summary.diff) is None:
        return None
    diff = summary.diff
    rows = []
    for name, d in (diff.deltas or {}).items():
        ci = d.ci95 or [None, None]
        excludes_zero = all(isinstance(v, (int, float)) for v in ci) and (ci[0] > 0 or ci[1] < 0)
        rows.append(el("tr", el("th", name, scope="row"), el("td", num(present(d.a))), el("td", num(present(d.b))),
                       el("td", num(present(d.delta))), el("td", f"{num(ci[0])} … {num(ci[1])}"),
                       el("td", "yes" if excludes_zero else "no"), class_="highlight" if excludes_zero else None))
    heads = ("metric", "A vs ref", "B vs ref", "Δ (B − A)", "95% CI", "CI excludes 0")
    table = el("table", el("thead", el("tr", [el("th", h) for h in heads])), el("tbody", rows), class_="data num")
    where = present(diff.where)
    # each worst token: rollout, branch, pos, token_id and the three log-probs
    worst = [to_builtins(token) for token in present(where.worst_tokens) or ()] if where is not None else []
    if texts is not None:
        worst = [{**w, "text": texts.get(str(w["token_id"]), "")} for w in worst]
    return section("diff", "A against B", table if rows else None,
                   el("h3", "Tokens where A and B disagree most") if worst else None,
                   records_table(worst) if worst else None,
                   lead="Deltas over rollouts with a bootstrap 95% interval; negative Δ means B is closer.")


# --- the whole next-token distribution (--distribution) -------------------------------------------

NEXT_TOKEN_FACTS = (("kl_ab_mean", "mean KL(A‖B)"), ("kl_ba_mean", "mean KL(B‖A)"), ("kl_ab_max", "max KL(A‖B)"),
                    ("tv_mean", "mean total variation"), ("topk_overlap_mean", "top-K overlap"),
                    ("argmax_agree_frac", "argmax agrees"), ("rank_differs_frac", "sampled token's rank differs"),
                    ("sampled_abs_log_ratio_mean", "sampled tokens' mean |log-ratio|"))


def next_token_section(summary: Summary, texts: dict[str, str] | None = None) -> Html | None:
    """summary.json `distribution`: per pair, the whole next-token distribution's gap, what is exact
    or bounded, the bitwise claim checked, the tokens that moved, the worst positions and turns."""
    found = present(summary.distribution)
    if not found:
        return None
    texts = texts or {}
    parts: list[Any] = []
    for pair, gap in found.items():
        scope = "exact over the whole vocabulary" if gap.exact else f"bounded: {present(gap.bounded)}"
        parts.append(el("h3", f"{pair}: top-K = {present(gap.k)}, {scope}"))
        # the record's fields, by the table's names
        parts.append(facts([(label, present(getattr(gap, key))) for key, label in NEXT_TOKEN_FACTS]))
        parts.append(el("p", gap.bitwise.claim if gap.bitwise else ""))
        tokens = [{**t, "text": texts.get(str(t["token_id"]), "")} for t in gap.tokens or ()]
        if tokens:
            parts.append(el("h4", "Tokens whose probability moved most (share of the moved mass)"))
            parts.append(records_table(tokens, limit=len(tokens)))
        if gap.worst:
            parts.append(el("h4", "Positions where the distributions differ most"))
            parts.append(records_table(gap.worst, limit=len(gap.worst)))
        if gap.turns:
            parts.append(el("h4", "By turn"))
            parts.append(records_table(gap.turns, limit=len(gap.turns)))
    return section("next-token", "The whole next-token distribution", *parts,
                   lead="Beyond the sampled token: both sides' distributions over the vocabulary at every trainable "
                        "position (--distribution; docs/distribution.md). A is the pair's first side.")


# --- worst rollouts, absent sections, footer -------------------------------------------------------

def worst_section(worst: WorstBlock | None, tokens: Sequence[Mapping[str, object]] | None = None) -> Html | None:
    if worst is None:
        return None
    lead = (f"The {len(worst['rollouts'])} worst of {worst['num_ranked']:,} rollouts by {worst['rank_by']} "
            f"on {worst['focus']}. Each token is colored by its log-ratio (red: A gives it more probability, "
            "blue: less); hover a token for its id, log-probs and ratio. Grey tokens are context.")
    table = join(el("h3", f"The {len(tokens)} trainable tokens with the largest |log-ratio| on {worst['focus']}"),
                 records_table(tokens, limit=len(tokens))) if tokens else None
    return section("worst", "The worst rollouts", table, el("div", id="worst-controls", class_="worst-controls"),
                   el("div", id="worst-list"), lead=lead)


def absent_line(summary: Summary) -> Html | None:
    localization = summary.localization
    checks = (("turn onset and position drift", localization.turns),
              ("layer localization", localization.layers),
              ("kernel localization", localization.kernels),
              ("render drift", summary.drift), ("alignment checks", summary.alignment),
              ("corrections", summary.corrections), ("recommendations", summary.recommendations))
    # a section written empty (`{}`) was not computed either
    absent = [name for name, value in checks if not to_builtins(present(value))]
    if not absent:
        return None
    return el("p", el("strong", "Not computed in this run: "), ", ".join(absent), ".", class_="absent")


def engines_table(summary: Summary) -> Html | None:
    engines = summary.engines
    if not engines:
        return None
    keys = ("spec", "kind", "dtype", "device", "logprob_semantics", "tokens_per_s", "seconds")
    head = el("tr", el("th", "role"), [el("th", k) for k in keys])
    described = {role: summary.engine(role) for role in engines}
    rows = [el("tr", el("th", role, scope="row"),
               [el("td", num(value) if isinstance(value := getattr(e, k), (int, float))
                   else "–" if value is UNSET else str(value)) for k in keys]) for role, e in described.items()]
    return el("details", el("summary", "Engines and settings"),
              el("table", el("thead", head), el("tbody", rows), class_="data"),
              value_html(engines))


def footer(summary: Summary) -> Html:
    return el("footer", engines_table(summary),
              el("p", "Built from summary.json and tokens.parquet by mismatch's reports/. Rebuild with ",
                 el("code", "mismatch report DIR"), ". Self-contained: no network, no external files."))
