"""The verdict in one glance: healthy, correct with X, or fix at the source: Y, with key numbers.

Read from summary.json only (`verdicts`, `recommendations`, and `diff` for diff reports): the
banner restates what the audit concluded and never derives a new conclusion of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Recommendation kinds that reweight or mask tokens in the loss (TRL's four modes, verl/slime
# names); any other kind changes the stack itself and is a fix at the source. An item's explicit
# "action": "correct" | "fix" | "none" wins over the name.
CORRECTION_PREFIXES = ("token_", "sequence_", "seq_", "geo_", "tis", "mis", "icepop", "is_",
                       "rejection", "rs_", "clip", "cap", "truncate", "mask", "weight")
NO_ACTION_KINDS = frozenset({"none", "healthy", "no_correction", "nothing"})
HEALTHY_LEVELS = frozenset({"exact", "negligible"})


@dataclass(kw_only=True, slots=True)
class Banner:
    status: str        # healthy | correct | fix | small | large | diff | unknown
    label: str         # the pill: HEALTHY, CORRECT, FIX AT THE SOURCE, …
    headline: str
    details: list[str] = field(default_factory=list)
    numbers: list[tuple[str, Any, str]] = field(default_factory=list)  # (label, value, kind)


def focus_pair(summary: dict[str, Any]) -> str | None:
    """The pair the verdict is about: the first with tokens (train/sampler for an audit)."""
    pairs = summary.get("pairs") or {}
    for name, metrics in pairs.items():
        if isinstance(metrics, dict) and metrics.get("n_tokens"):
            return name
    return next(iter(pairs), None)


def recommendation_action(rec: dict[str, Any], correction_modes: set[str]) -> str:
    """correct | fix | none, for one item of summary["recommendations"]."""
    action = str(rec.get("action", "")).lower()
    if action in ("correct", "fix", "none"):
        return action
    kind = str(rec.get("kind", "")).lower()
    if kind in NO_ACTION_KINDS:
        return "none"
    if kind in correction_modes or kind.startswith(CORRECTION_PREFIXES):
        return "correct"
    return "fix"


def describe(rec: dict[str, Any]) -> str:
    """`token_truncate (cap=2)`: the kind and its parameters as a reader would type them."""
    params = rec.get("params")
    if isinstance(params, dict) and params:
        return f"{rec.get('kind', '?')} ({', '.join(f'{k}={v}' for k, v in params.items())})"
    return str(rec.get("kind", "?"))


def key_numbers(metrics: dict[str, Any]) -> list[tuple[str, Any, str]]:
    return [("kl_k3 per token", metrics.get("kl_k3"), "num"),
            ("ratio p1 – p99.9", (metrics.get("ratio_p01"), metrics.get("ratio_p999")), "range"),
            ("max |log-ratio|", metrics.get("log_ratio_abs_max"), "num"),
            ("tokens outside [0.5, 2]", metrics.get("frac_outside_2"), "pct"),
            ("ESS", metrics.get("ess"), "num"),
            ("bitwise equal", metrics.get("bitwise_equal_frac"), "pct"),
            ("trainable tokens", metrics.get("n_tokens"), "num")]


def _sentence(text: str) -> str:
    # verdicts.py appends "(kl_k3 …)" to its sentence: the numbers are in the tiles already.
    head = text.split(" (kl_k3", 1)[0].strip()
    return head[:1].upper() + head[1:] if head else head


def audit_banner(summary: dict[str, Any]) -> Banner:
    pair = focus_pair(summary)
    metrics = (summary.get("pairs") or {}).get(pair) or {}
    verdict = (summary.get("verdicts") or {}).get(pair) if pair else None
    recs = [r for r in summary.get("recommendations") or [] if isinstance(r, dict)]
    modes = {str(c.get("mode")) for c in summary.get("corrections") or [] if isinstance(c, dict)}
    actions = [(recommendation_action(r, modes), r) for r in recs]
    fixes = [r for a, r in actions if a == "fix"]
    corrections = [r for a, r in actions if a == "correct"]
    numbers = key_numbers(metrics)
    # With a recommendation the verdict sentence is evidence under it; without, it is the headline.
    details = [f"{pair}: {_sentence(verdict['text'])}."] if recs and verdict and verdict.get("text") else []
    details += [f"Why: {r['why']}" for r in fixes + corrections if r.get("why")]
    if fixes:
        headline = "Fix at the source: " + "; ".join(describe(r) for r in fixes)
        if corrections:
            headline += " — meanwhile correct with " + "; ".join(describe(r) for r in corrections)
        return Banner(status="fix", label="FIX AT THE SOURCE", headline=headline, details=details,
                      numbers=numbers)
    if corrections:
        return Banner(status="correct", label="CORRECT", details=details, numbers=numbers,
                      headline="Correct with " + "; ".join(describe(r) for r in corrections))
    if verdict is None:
        return Banner(status="unknown", label="NO VERDICT", numbers=numbers, details=details,
                      headline="No verdict recorded in summary.json (re-run the audit to get one)")
    level = verdict.get("level", "unknown")
    if level in HEALTHY_LEVELS:
        status, label = "healthy", "HEALTHY"
    elif level in ("small", "large"):
        status, label = level, f"{level.upper()} GAP"
    else:
        status, label = "unknown", "NOT JUDGED"
    if pair:
        details.append(f"On {pair} ({verdict.get('meaning', 'its log-ratio')}), trainable tokens.")
    if not recs and level not in HEALTHY_LEVELS:
        details.append("Recommendation: not computed for this results dir.")
    return Banner(status=status, label=label, headline=_sentence(verdict.get("text", "")),
                  details=details, numbers=numbers)


def diff_banner(summary: dict[str, Any]) -> Banner:
    """Which config is closer to the reference, by kl_k3, with its bootstrap interval."""
    diff = summary.get("diff") or {}
    engines = summary.get("engines") or {}
    spec = {role: (engines.get(role) or {}).get("spec", role) for role in ("a", "b", "reference")}
    closer = diff.get("closer_to_reference")
    kl = (diff.get("deltas") or {}).get("kl_k3") or {}
    ci = kl.get("ci95") or [None, None]
    numbers: list[tuple[str, Any, str]] = [
        ("kl_k3 A vs reference", kl.get("a"), "num"), ("kl_k3 B vs reference", kl.get("b"), "num"),
        ("Δ kl_k3 (B − A)", kl.get("delta"), "num"), ("95% CI of Δ", tuple(ci), "ci")]
    speed = diff.get("throughput_tokens_per_s") or {}
    numbers += [(f"{role.upper()} tokens/s", speed.get(role), "num") for role in ("a", "b") if role in speed]
    details = [f"A = {spec['a']}   ·   B = {spec['b']}   ·   reference = {spec['reference']}"]
    if diff.get("closer_rule"):
        details.append(f"Rule: {diff['closer_rule']}.")
    if closer in ("a", "b"):
        headline = f"Config {closer.upper()} ({spec[closer]}) is closer to the reference"
        return Banner(status="diff", label=f"{closer.upper()} IS CLOSER", headline=headline,
                      details=details, numbers=numbers)
    if closer == "tie":
        return Banner(status="healthy", label="TIE", details=details, numbers=numbers,
                      headline="No significant difference: A and B are equally close to the reference")
    return Banner(status="unknown", label="NOT COMPARED", details=details, numbers=numbers,
                  headline="The config comparison was not computed (no `diff` block in summary.json)")


def banner(summary: dict[str, Any]) -> Banner:
    return diff_banner(summary) if summary.get("command") == "diff" else audit_banner(summary)
