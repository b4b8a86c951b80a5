"""The verdict in one glance: healthy, correct with X, or fix at the source: Y, with key numbers.

Read from summary.json only (`diagnosis`, `verdicts`, `recommendations`, and `diff` for diff
reports): the banner restates what the audit concluded. With a diagnosis the headline is its lead
cause, the fix at the source, and the correction only if the ratio still needs it meanwhile; a
summary without one (written before the diagnosis existed) leads with its recommendations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# How each recommendation kind reads in a headline (mismatch.advise.recommend's kinds); an unknown kind
# is shown by its name. An item's explicit "action": "correct" | "fix" | "none" wins over the kind.
CORRECT_KINDS = frozenset({"correction"})
NO_ACTION_KINDS = frozenset({"no_correction", "none", "healthy"})
# Fixes for a comparison that is itself wrong: a correction on top would correct the wrong thing.
BUG_KINDS = frozenset({"fix_alignment", "fix_renderer", "raw_logprobs", "match_temperature", "match_checkpoint", "replay_kept_set"})
LABELS = {"recompute_old_logprobs": "recompute old log-probs with the trainer",
          "fp16": "fp16 instead of bf16", "batch_invariant": "a batch-invariant inference mode",
          "fix_renderer": "the renderer (re-rendered tokens differ from the sampled ones)",
          "fix_alignment": "the log-prob alignment (off by {shift:+d})",
          "raw_logprobs": "store raw log-probs (they are temperature/top-p processed)",
          "replay_kept_set": "renormalize the trainer over the sampler's kept set (sampling replay), or sample "
                             "training rollouts untruncated (top_p = 1)",
          "match_temperature": "the trainer's temperature: {stored_temperature:g}, the stored log-probs', "
                               "not {trainer_temperature:g}",
          "fix_weight_sync": "the weight sync of {at}",
          "match_sampler_config": "audit again with the sampler's config (--infer {infer})",
          "inspect_turn": "read turn {turn} of the rollouts that step up there",
          "routing_replay": "routing replay (R3)",
          "match_checkpoint": "audit against the checkpoint that sampled these rollouts"}
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


def recommendation_action(rec: dict[str, Any], correction_modes: set[str] = frozenset()) -> str:
    """correct | fix | none, for one item of summary["recommendations"]."""
    action = str(rec.get("action", "")).lower()
    if action in ("correct", "fix", "none"):
        return action
    kind = str(rec.get("kind", ""))
    if kind in NO_ACTION_KINDS:
        return "none"
    if kind in CORRECT_KINDS or kind in correction_modes:  # a bare mode name is a correction too
        return "correct"
    return "fix"


def describe(rec: dict[str, Any]) -> str:
    """A recommendation as a reader would say it: `token_truncate (cap=1.5)`, `fp16 instead of bf16`."""
    params = rec.get("params") if isinstance(rec.get("params"), dict) else {}
    kind = str(rec.get("kind", "?"))
    if kind == "correction" and "mode" in params:
        # The parameters that configure the correction; the rest (its simulated effect) is evidence.
        knobs = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
                 if k in ("cap", "low", "high", "threshold")]
        return f"{params['mode']} ({', '.join(knobs)})" if knobs else str(params["mode"])
    if kind in LABELS:
        try:
            return LABELS[kind].format(**params)
        except (KeyError, ValueError, TypeError):
            return kind.replace("_", " ")
    if params and all(isinstance(v, (int, float, str)) for v in params.values()):
        return f"{kind} ({', '.join(f'{k}={v}' for k, v in params.items())})"
    return kind


def key_numbers(metrics: dict[str, Any]) -> list[tuple[str, Any, str]]:
    # One name per quantity: each tile is labelled with its summary.json key (docs/glossary.md).
    return [("kl_k3", metrics.get("kl_k3"), "num"),
            ("ratio_q001 – ratio_q999", (metrics.get("ratio_q001"), metrics.get("ratio_q999")), "range"),
            ("log_ratio_abs_max", metrics.get("log_ratio_abs_max"), "num"),
            ("frac_outside_2", metrics.get("frac_outside_2"), "pct"),
            ("ess", metrics.get("ess"), "num"),
            ("bitwise_equal_frac", metrics.get("bitwise_equal_frac"), "pct"),
            ("n_tokens", metrics.get("n_tokens"), "num")]


def _sentence(text: str) -> str:
    # verdicts.py appends "(kl_k3 …)" to its sentence: the numbers are in the tiles already.
    head = text.split(" (kl_k3", 1)[0].strip()
    return head[:1].upper() + head[1:] if head else head


# Re-rendered tokens that differ from the sampled ones lead the page only when they are a share of
# the trained tokens worth a headline; a handful is listed below it.
MINOR_DRIFT_FRAC = 0.01


def _minor_drift(rec: dict[str, Any], summary: dict[str, Any]) -> bool:
    if rec.get("kind") != "fix_renderer":
        return False
    touched = (summary.get("drift") or {}).get("trainable_tokens_touched")
    trainable = (summary.get("counts") or {}).get("trainable_tokens")
    return isinstance(touched, int) and bool(trainable) and touched < MINOR_DRIFT_FRAC * trainable


def lead_cause(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The diagnosis' first cause that explains a gap (a minor one, such as a handful of re-rendered
    tokens, is listed below the headline, never in it)."""
    causes = [c for c in (summary.get("diagnosis") or {}).get("causes") or [] if isinstance(c, dict)]
    return next((c for c in causes if not c.get("minor")), None)


def _cause_banner(cause: dict[str, Any], summary: dict[str, Any], recs: list[dict[str, Any]],
                  corrections: list[dict[str, Any]], details: list[str],
                  numbers: list[tuple[str, Any, str]]) -> Banner:
    """The cause, in its own words; the fix at its source; then the correction, only if one is
    recommended meanwhile (recommend leaves it out when the ratio is 1 up to rounding)."""
    fix = next((r for r in recs if r.get("kind") == cause.get("fix")), None)
    parts = [_sentence(str(cause.get("title", cause.get("kind", "?"))))]
    unexplained = cause.get("kind") == "unexplained"
    if unexplained:  # the size, what was ruled out and the command that would decide: no fix to name
        where = cause.get("where") or {}
        parts += [str(line) for line in cause.get("evidence") or []][:1]
        if where.get("ruled_out"):
            parts.append("ruled out: " + "; ".join(str(line) for line in where["ruled_out"]))
        if where.get("next"):
            parts.append(f"next: {where['next']}")
    if fix is not None:
        parts.append("fix: " + describe(fix))
    if corrections:
        parts.append(("meanwhile correct with " if fix is not None or unexplained else "correct with ")
                     + "; ".join(describe(r) for r in corrections))
    evidence = [str(line) for line in cause.get("evidence") or []]
    # An unexplained gap's evidence and what was ruled out are its headline already.
    lines = [f"Evidence: {'; '.join(evidence)}."] if evidence and not unexplained else []
    lines += [f"Not the others: {cause['rules_out'][0]}."] if cause.get("rules_out") and not unexplained else []
    others = [c for c in (summary.get("diagnosis") or {}).get("causes") or [] if c is not cause]
    lines += ["Also found: " + "; ".join(str(c.get("title")) for c in others) + "."] if others else []
    status, label = ("fix", "FIX AT THE SOURCE") if fix is not None else ("unknown", "UNEXPLAINED") if unexplained \
        else ("correct", "CORRECT") if corrections else ("fix", "CAUSE FOUND")
    return Banner(status=status, label=label, headline=" — ".join(parts), details=[*lines, *details],
                  numbers=numbers)


def audit_banner(summary: dict[str, Any]) -> Banner:
    """_audit_banner, with what the rollouts' meta.checkpoint says when it disagrees with the audited
    checkpoint (summary.json declared_checkpoint.line): in the headline's first clause when the identity
    cause leads or the weight digests differ; another name the data agree with is a notice, the
    first of the details."""
    banner = _audit_banner(summary)
    found = summary.get("declared_checkpoint") or {}
    declared = found.get("line")
    if not declared:
        return banner
    cause = lead_cause(summary)
    if cause is not None and cause.get("kind") == "identity":
        first, _, rest = banner.headline.partition(" — ")
        banner.headline = f"{first} ({declared})" + (f" — {rest}" if rest else "")
    elif any(row.get("match") == "other weights" for row in found.get("declared") or []):
        banner.headline = f"Checkpoint: {declared} — {banner.headline}"
    else:
        banner.details.insert(0, f"Checkpoint: {declared}.")
    return banner


def _audit_banner(summary: dict[str, Any]) -> Banner:
    """The diagnosis' lead cause when there is one (_cause_banner). Else: fix at the source when the
    comparison is broken, the gap is large or no cap meets the rule; correct with X when a correction
    meets its rule; else the verdict level (healthy, small, large)."""
    pair = focus_pair(summary)
    metrics = (summary.get("pairs") or {}).get(pair) or {}
    verdict = (summary.get("verdicts") or {}).get(pair) if pair else None
    level = (verdict or {}).get("level", "unknown")
    recs = [r for r in summary.get("recommendations") or [] if isinstance(r, dict)]
    modes = {str(c.get("mode")) for c in summary.get("corrections") or [] if isinstance(c, dict)}
    actions = [(recommendation_action(r, modes), r) for r in recs]
    fixes = [r for a, r in actions if a == "fix"]
    corrections = [r for a, r in actions if a == "correct"]
    bugs = [r for r in fixes if r.get("kind") in BUG_KINDS and not _minor_drift(r, summary)]
    uncorrectable = any((r.get("params") or {}).get("meets_rule") is False for r in corrections)
    numbers = key_numbers(metrics)
    details = []
    clip = (summary.get("clip") or {})
    if pair and (clip.get("pairs") or {}).get(pair) is not None and clip.get("range"):
        # The first line answers "is my ratio OK?" in the user's own clip range.
        low, high = clip["range"]
        details.append(f"Mismatch alone takes {clip['pairs'][pair]:.2%} of {pair} tokens out of the "
                       f"PPO clip range [{low:g}, {high:g}].")
        numbers.insert(0, (f"outside clip [{low:g}, {high:g}]", clip["pairs"][pair], "pct"))
    verdict_line = None
    if verdict and verdict.get("text"):
        verdict_line = f"{pair} ({verdict.get('meaning', 'log-ratio')}): {_sentence(verdict['text'])}."
        details.append(verdict_line)
    # Facts that explain no gap but change how to read one (a replayed config farther from the
    # trainer than the sampler was; a declaration the replay contradicts).
    details += [f"Note: {finding}." for finding in (summary.get("diagnosis") or {}).get("findings") or []]
    cause = lead_cause(summary)
    if cause is not None:
        return _cause_banner(cause, summary, recs, corrections, details, numbers)
    if bugs or (fixes and (level == "large" or uncorrectable or not corrections)):
        first = bugs or fixes
        headline = "Fix at the source: " + "; ".join(describe(r) for r in first)
        if corrections and not bugs:
            headline += " — meanwhile correct with " + "; ".join(describe(r) for r in corrections)
        rest = [r for r in fixes if r not in first]
        if rest:
            details.append("Also at the source: " + "; ".join(describe(r) for r in rest) + ".")
        return Banner(status="fix", label="FIX AT THE SOURCE", headline=headline, details=details,
                      numbers=numbers)
    if corrections:
        if fixes:
            details.append("At the source, optionally: " + "; ".join(describe(r) for r in fixes) + ".")
        return Banner(status="correct", label="CORRECT", details=details, numbers=numbers,
                      headline="Correct with " + "; ".join(describe(r) for r in corrections))
    if verdict is None:
        return Banner(status="unknown", label="NO VERDICT", numbers=numbers, details=details,
                      headline="No verdict recorded in summary.json (re-run the audit to get one)")
    details = [line for line in details if line != verdict_line]  # the verdict is the headline itself
    return _level_banner(pair, verdict, details=details, numbers=numbers, recommended=bool(recs))


def _level_banner(pair: str | None, verdict: dict[str, Any], *, details: list[str],
                  numbers: list[tuple[str, Any, str]], recommended: bool) -> Banner:
    """No cause, fix or correction to lead with: the verdict's own sentence and level (healthy,
    small or large gap)."""
    level = verdict.get("level", "unknown")
    if level in HEALTHY_LEVELS:
        status, label = "healthy", "HEALTHY"
    elif level in ("small", "large"):
        status, label = level, f"{level.upper()} GAP"
    else:
        status, label = "unknown", "NOT JUDGED"
    if pair:
        details.append(f"On {pair} ({verdict.get('meaning', 'its log-ratio')}), trainable tokens.")
    if not recommended and level not in HEALTHY_LEVELS:
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
