"""The page's advice: the recommendation, with its config snippets, and the simulated corrections.

Read from summary.json `recommendations`, `corrections` and `config_snippets` only.
"""

from __future__ import annotations

from typing import Any

from mismatch.reports.banner import describe, recommendation_action
from mismatch.reports.blocks import fmt, section
from mismatch.reports.html import Html, el, join, num

CORRECTION_COLUMNS = (("frac_tokens_affected", "tokens affected", "pct"),
                      ("frac_rollouts_affected", "rollouts affected", "pct"),
                      ("weight_mean", "weight mean", "num"), ("weight_max", "weight max", "num"),
                      ("ess", "ESS", "num"))


def snippet_blocks(value: Any) -> list[Html]:
    """Config snippet(s): one text, or {framework: text} (each a block people copy as is)."""
    if isinstance(value, str):
        return [el("pre", value, class_="snippet")]
    if isinstance(value, dict):
        return [el("details", el("summary", str(name)), el("pre", text if isinstance(text, str) else repr(text),
                                                            class_="snippet"), open=i == 0 or None)
                for i, (name, text) in enumerate(value.items())]
    return []


def _compact(params: Any) -> str:
    if not isinstance(params, dict) or not params:
        return ""
    return ", ".join(f"{k}={num(v) if isinstance(v, float) else v}" for k, v in params.items())


def is_recommended(correction: dict[str, Any], recs: list[dict[str, Any]]) -> bool:
    """The simulated row a `correction` recommendation chose: same mode, same cap/bounds."""
    params = correction.get("params") if isinstance(correction.get("params"), dict) else {}
    for rec in recs:
        chosen = rec.get("params") if isinstance(rec.get("params"), dict) else {}
        mode = chosen.get("mode", rec.get("kind"))
        if mode == correction.get("mode") and all(chosen.get(k) == v for k, v in params.items()):
            return True
    return False


def corrections_section(summary: dict[str, Any]) -> Html | None:
    corrections = [c for c in summary.get("corrections") or [] if isinstance(c, dict)]
    recs = [r for r in summary.get("recommendations") or [] if isinstance(r, dict)]
    if not corrections and not recs:
        return None
    modes = {str(c.get("mode")) for c in corrections}
    rec_items = []
    for rec in recs:
        action = recommendation_action(rec, modes)
        badge = {"correct": "correct", "fix": "fix at the source", "none": "no action"}[action]
        rec_items.append(el("li", el("span", badge, class_=f"badge badge-{action}"), " ",
                            el("strong", describe(rec)), " ", el("code", str(rec.get("kind", "")), class_="kind"),
                            el("p", rec.get("why")) if rec.get("why") else None,
                            el("p", _compact(rec.get("params")), class_="params") if rec.get("params") else None,
                            snippet_blocks(rec.get("snippets") or rec.get("snippet"))))
    # Snippets for the whole set, per framework (what `mismatch recommend --for F` prints), if stored.
    snippets = snippet_blocks(summary.get("config_snippets"))
    table = None
    if corrections:
        extra = [("level", "level", "text")] if any("level" in c for c in corrections) else []
        columns = extra + list(CORRECTION_COLUMNS)
        head = el("tr", el("th", "mode"), el("th", "params"), [el("th", label) for _, label, _ in columns])
        rows = []
        # Corrections that change nothing here read the same on every column: one line names them.
        untouched = [c for c in corrections if c.get("frac_tokens_affected") == 0
                     and not is_recommended(c, recs)]
        shown = [c for c in corrections if not any(c is u for u in untouched)]
        if len(untouched) > 1:
            rows.append(el("tr", el("td", f"{len(untouched)} corrections change no token here: " + ", ".join(
                f"{c.get('mode')} ({_compact(c.get('params'))})" for c in untouched),
                colspan=str(2 + len(columns))), class_="collapsed"))
        else:
            shown = corrections
        for c in shown:
            mark = is_recommended(c, [r for r in recs if recommendation_action(r, modes) == "correct"])
            rows.append(el("tr", el("td", ("★ " if mark else "") + str(c.get("mode"))),
                           el("td", _compact(c.get("params")) or "–"),
                           [el("td", str(c.get(key, "–")) if kind == "text" else fmt(c.get(key), kind))
                            for key, _, kind in columns],
                           class_="highlight" if mark else None))
        table = el("div", el("table", el("thead", head), el("tbody", rows), class_="data num corrections"),
                   class_="scroll")
    return section("corrections", "Recommendation and corrections",
                   el("ul", rec_items, class_="recs") if rec_items else
                   el("p", "Recommendation: not computed.", class_="note"),
                   join(el("h3", "Config snippets"), snippets) if snippets else None,
                   join(el("h3", f"Simulated corrections ({len(corrections)})"),
                        el("p", "Over train/sampler trainable tokens; ★ the recommended one.", class_="note"),
                        table) if table else None)
