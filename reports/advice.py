"""The page's advice: the recommendation, with its config snippets, and the simulated corrections.

Read from summary.json `recommendations`, `corrections` and `config_snippets` only.
"""

from __future__ import annotations

from typing import Any

from mismatch.present.headline import describe, recommendation_action
from mismatch.present.numbers import formatted, num
from mismatch.reports.blocks import section
from mismatch.reports.html import Html, el, join
from mismatch.results.summary_model import Correction, Recommendation, Summary, present

CORRECTION_COLUMNS = (("frac_tokens_affected", "tokens affected", "pct"),
                      ("frac_rollouts_affected", "rollouts affected", "pct"),
                      ("weight_mean", "weight mean", "num"), ("weight_max", "weight max", "num"),
                      ("ess", "ess", "num"))


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


def params_table(params: Any) -> Html | None:
    """A recommendation's parameters as a small table (name, value): numbers formatted, a nested
    parameter dict compact ("cap=1.5"), a list of records (the ranked alternatives) a table of its own."""
    if not isinstance(params, dict) or not params:
        return None
    rows, nested = [], []
    for key, value in params.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            nested.append((key, value))
            continue
        shown = _compact(value) if isinstance(value, dict) else num(value) if isinstance(value, float) else str(value)
        rows.append(el("tr", el("th", str(key), scope="row"), el("td", shown)))
    tables = [el("table", el("tbody", rows), class_="data kv params")] if rows else []
    for key, records in nested:
        columns = list(dict.fromkeys(k for record in records for k in record))
        head = el("tr", [el("th", column) for column in columns])
        body = [el("tr", [el("td", _compact(r.get(c)) if isinstance(r.get(c), dict) else
                             num(r.get(c)) if isinstance(r.get(c), float) else str(r.get(c, "–")))
                          for c in columns]) for r in records]
        tables.append(el("details", el("summary", f"{key} ({len(records)})"),
                         el("div", el("table", el("thead", head), el("tbody", body), class_="data num"), class_="scroll")))
    return join(*tables)


def known_framework(summary: Summary) -> str | None:
    """The user's framework when the audit knows it: the one `audit --for` named, else a replay
    derived from its config (`--train verl:ppo.yaml`), whose snippet the summary holds."""
    snippets = present(summary.config_snippets)
    if snippets is None:
        return None
    asked = present(summary.framework)  # `audit --for NAME`
    if asked in snippets:
        return asked
    for source in ("train", "infer"):
        derived = summary.engine(source).from_config
        name = str(derived.framework or "") if derived else ""
        if name in snippets:
            return name
    return None


def first_screen_snippet(summary: Summary) -> Html | None:
    """The snippet for the user's framework, right under the verdict: what to paste, first."""
    framework = known_framework(summary)
    if framework is None:
        return None
    return el("section", el("h2", f"Paste into your {framework} config"),
              el("pre", present(summary.config_snippets)[framework], class_="snippet"),
              el("p", "The correction the recommendation below chooses, at the settings it simulated; "
                      "see the glossary (docs/glossary.md) for each term.", class_="note"),
              id="snippet", class_="panel")


def is_recommended(correction: Correction, recs: list[Recommendation]) -> bool:
    """The simulated row a `correction` recommendation chose: same mode, same cap/bounds."""
    for rec in recs:
        chosen = present(rec.params) or {}
        mode = chosen.get("mode", rec.kind)
        if mode == correction.mode and all(chosen.get(k) == v for k, v in correction.params.items()):
            return True
    return False


def _cell(correction: Correction, key: str, kind: str) -> str:
    """One column of a simulated correction's row: its value as the column's kind, "–" when unset."""
    value = present(getattr(correction, key))
    if kind == "text":
        return "–" if value is None else str(value)
    return formatted(value, kind)


def corrections_section(summary: Summary) -> Html | None:
    corrections, recs = summary.corrections, summary.recommendations
    if not corrections and not recs:
        return None
    modes = {c.mode for c in corrections}
    rec_items = []
    for rec in recs:
        action = recommendation_action(rec, modes)
        badge = {"correct": "correct", "fix": "fix at the source", "none": "no action"}[action]
        rec_items.append(el("li", el("span", badge, class_=f"badge badge-{action}"), " ",
                            el("strong", describe(rec)), " ", el("code", rec.kind, class_="kind"),
                            el("p", rec.why) if rec.why else None,
                            params_table(present(rec.params))))
    # Snippets for the whole set, per framework (what `mismatch recommend --for F` prints), if stored.
    snippets = snippet_blocks(present(summary.config_snippets))
    table = None
    if corrections:
        extra = [("level", "level", "text")] if any(present(c.level) is not None for c in corrections) else []
        columns = extra + list(CORRECTION_COLUMNS)
        head = el("tr", el("th", "mode"), el("th", "params"), [el("th", label) for _, label, _ in columns])
        rows = []
        # Corrections that change nothing here read the same on every column: one line names them.
        untouched = [c for c in corrections if c.frac_tokens_affected == 0
                     and not is_recommended(c, recs)]
        shown = [c for c in corrections if not any(c is u for u in untouched)]
        if len(untouched) > 1:
            rows.append(el("tr", el("td", f"{len(untouched)} of them change no token here: " + ", ".join(
                f"{c.mode} ({_compact(c.params)})" for c in untouched),
                colspan=str(2 + len(columns))), class_="collapsed"))
        else:
            shown = corrections
        for c in shown:
            mark = is_recommended(c, [r for r in recs if recommendation_action(r, modes) == "correct"])
            rows.append(el("tr", el("td", ("★ " if mark else "") + c.mode),
                           el("td", _compact(c.params) or "–"),
                           [el("td", _cell(c, key, kind)) for key, _, kind in columns],
                           class_="highlight" if mark else None))
        table = el("div", el("table", el("thead", head), el("tbody", rows), class_="data num corrections"),
                   class_="scroll")
    return section("corrections", "Recommendation and corrections",
                   el("ul", rec_items, class_="recs") if rec_items else
                   el("p", "Recommendation: not computed.", class_="note"),
                   join(el("h3", "Config snippets"), snippets) if snippets else None,
                   join(el("h3", "Simulated corrections"),
                        el("p", f"{len(corrections)} simulated over train/sampler's trainable tokens; ★ the "
                                "recommended one.", class_="note"),
                        table) if table else None)
