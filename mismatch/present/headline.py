"""The verdict in one glance: healthy, correct with X, or fix at the source: Y, with key numbers;
and the lines a cause or a verdict is printed as. The report's banner and the terminal's `answer:`
are both this module's words.

Read from summary.json only (`diagnosis`, `verdicts`, `recommendations`, and `diff` for diff
reports): the banner restates what the audit concluded. With a diagnosis the headline is its lead
cause, the fix at the source, and the correction only if the ratio still needs it meanwhile; a
summary without one (written before the diagnosis existed) leads with its recommendations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mismatch.results.summary_model import (
    UNSET,
    Cause,
    EngineEntry,
    PairMetrics,
    Recommendation,
    Summary,
    Verdict,
    partial_metrics,
    present,
)
from mismatch.results.section_records import Comparison, MetricDelta, PrefixConsistency

# How each recommendation kind reads in a headline (mismatch.advise.recommend's kinds); an unknown kind
# is shown by its name.
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
          "inspect_token_rows": "{rows} on both sides (lm_head, embedding, logit masks)",
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


def focus_pair(summary: Summary) -> str | None:
    """The pair the verdict is about: the first with tokens (train/sampler for an audit)."""
    for name, metrics in summary.pairs.items():
        if metrics.n_tokens:
            return name
    return next(iter(summary.pairs), None)


def recommendation_action(rec: Recommendation, correction_modes: set[str] = frozenset()) -> str:
    """correct | fix | none, for one of the summary's recommendations."""
    if rec.kind in NO_ACTION_KINDS:
        return "none"
    if rec.kind in CORRECT_KINDS or rec.kind in correction_modes:  # a bare mode name is a correction too
        return "correct"
    return "fix"


def describe(rec: Recommendation) -> str:
    """A recommendation as a reader would say it: `token_truncate (cap=1.5)`, `fp16 instead of bf16`."""
    params = present(rec.params) or {}
    kind = rec.kind
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


# One name per quantity: each tile is labelled with its summary.json key (docs/glossary.md).
def key_numbers(metrics: PairMetrics) -> list[tuple[str, Any, str]]:
    return [("kl_k3", metrics.kl_k3, "num"),
            ("ratio_q001 – ratio_q999", (metrics.ratio_q001, metrics.ratio_q999), "range"),
            ("log_ratio_abs_max", metrics.log_ratio_abs_max, "num"),
            ("frac_outside_2", metrics.frac_outside_2, "pct"),
            ("ess", metrics.ess, "num"),
            ("bitwise_equal_frac", metrics.bitwise_equal_frac, "pct"),
            ("n_tokens", metrics.n_tokens, "num")]


def verdict_sentence(text: str) -> str:
    """A verdict's sentence without the numbers verdicts.py appends ("(kl_k3 …)": they are in the
    tiles already), capitalized."""
    head = text.split(" (kl_k3", 1)[0].strip()
    return head[:1].upper() + head[1:] if head else head


def meaning(verdict: Verdict, default: str) -> str:
    """What the verdict's pair measures, as it says, else `default`."""
    return default if verdict.meaning is UNSET else verdict.meaning


def verdict_line(pair: str, verdict: Verdict) -> str:
    """A pair's verdict as the terminal lists it: its meaning, its level and the whole sentence."""
    return f"{pair} ({meaning(verdict, '')}): {verdict.level}: {verdict.text}"


def cause_line(cause: Cause, number: int | None = None) -> str:
    """A diagnosed cause on one line: `cause 1 (minor): <title> [<pair>]` (numbered when listed)."""
    ordinal = f" {number}" if number is not None else ""
    return f"cause{ordinal}{' (minor)' if cause.minor else ''}: {cause.title} [{cause.pair}]"


def clip_sentence(summary: Summary, pair: str = "train/sampler") -> str | None:
    """"mismatch alone takes 0.30% of train/sampler tokens out of the clip range [0.8, 1.2]"."""
    clip = present(summary.clip)
    if clip is None or clip.pairs.get(pair) is None or not clip.range:
        return None
    low, high = clip.range
    return f"mismatch alone takes {clip.pairs[pair]:.2%} of {pair} tokens out of the clip range [{low:g}, {high:g}]"


def prefix_sentence(source: str, finding: PrefixConsistency, engine: EngineEntry | None = None) -> str:
    """One line on a source whose shared prefixes got different log-probs, for the terminal and the page."""
    kind = present(engine.kind) if engine is not None else None
    equal = round(finding.frac_prefixes_bitwise_equal * finding.n_prefixes)
    worst = present(finding.worst)
    where = (f" (rollouts {', '.join(worst.rollouts)} at position {worst.pos})"
             if worst is not None and worst.rollouts else "")
    return (f"{source}{f' ({kind})' if kind else ''}: the same prefix got different log-probs in different "
            f"requests: {equal:,} of {finding.n_prefixes:,} shared prefixes bitwise equal, spread up to "
            f"{finding.max_abs_spread:.3g}{where}: batch variance, or an engine bug (one request at a time "
            "tells them apart)")


def prefix_lines(summary: Summary) -> list[str]:
    """One line per source whose shared prefixes got different log-probs, naming its engine's kind."""
    return [prefix_sentence(source, finding, summary.engine(source))
            for source, finding in summary.split_prefixes().items()]


# Re-rendered tokens that differ from the sampled ones lead the page only when they are a share of
# the trained tokens worth a headline; a handful is listed below it.
MINOR_DRIFT_FRAC = 0.01


def _minor_drift(rec: Recommendation, summary: Summary) -> bool:
    if rec.kind != "fix_renderer":
        return False
    touched = present(summary.drift.trainable_tokens_touched) if summary.drift else None
    trainable = present(summary.counts.trainable_tokens)
    return touched is not None and bool(trainable) and touched < MINOR_DRIFT_FRAC * trainable


def causes(summary: Summary) -> list[Cause]:
    """The diagnosis' causes, ranked; none for a summary written before the diagnosis existed."""
    diagnosis = present(summary.diagnosis)
    return diagnosis.causes if diagnosis is not None else []


def findings(summary: Summary) -> list[str]:
    """The diagnosis' facts that explain no gap but change how to read one."""
    diagnosis = present(summary.diagnosis)
    return diagnosis.findings if diagnosis is not None else []


def lead_cause(summary: Summary) -> Cause | None:
    """The diagnosis' first cause that explains a gap (a minor one, such as a handful of re-rendered
    tokens, is listed below the headline, never in it)."""
    return next((c for c in causes(summary) if not c.minor), None)


def _cause_banner(cause: Cause, summary: Summary, recs: list[Recommendation],
                  corrections: list[Recommendation], details: list[str],
                  numbers: list[tuple[str, Any, str]]) -> Banner:
    """The cause, in its own words; the fix at its source; then the correction, only if one is
    recommended meanwhile (recommend leaves it out when the ratio is 1 up to rounding)."""
    fix = next((r for r in recs if r.kind == cause.fix), None)
    parts = [verdict_sentence(cause.title)]
    unexplained = cause.kind == "unexplained"
    if unexplained:  # the size, what was ruled out and the command that would decide: no fix to name
        parts += cause.evidence[:1]
        if cause.where.ruled_out:
            parts.append("ruled out: " + "; ".join(str(line) for line in cause.where.ruled_out))
        if cause.where.next:
            parts.append(f"next: {cause.where.next}")
    if fix is not None:
        parts.append("fix: " + describe(fix))
    if corrections:
        parts.append(("meanwhile correct with " if fix is not None or unexplained else "correct with ")
                     + "; ".join(describe(r) for r in corrections))
    # An unexplained gap's evidence and what was ruled out are its headline already.
    lines = [f"Evidence: {'; '.join(cause.evidence)}."] if cause.evidence and not unexplained else []
    lines += [f"Not the others: {cause.rules_out[0]}."] if cause.rules_out and not unexplained else []
    others = [c for c in causes(summary) if c is not cause]
    lines += ["Also found: " + "; ".join(c.title for c in others) + "."] if others else []
    status, label = ("fix", "FIX AT THE SOURCE") if fix is not None else ("unknown", "UNEXPLAINED") if unexplained \
        else ("correct", "CORRECT") if corrections else ("fix", "CAUSE FOUND")
    return Banner(status=status, label=label, headline=" — ".join(parts), details=[*lines, *details],
                  numbers=numbers)


def audit_banner(summary: Summary) -> Banner:
    """_audit_banner, with what the rollouts' meta.checkpoint says when it disagrees with the audited
    checkpoint (summary.json declared_checkpoint.line): in the headline's first clause when the identity
    cause leads or the weight digests differ; another name the data agree with is a notice, the
    first of the details."""
    banner = _audit_banner(summary)
    found = present(summary.declared_checkpoint)
    if found is None or not found.line:
        return banner
    cause = lead_cause(summary)
    if cause is not None and cause.kind == "identity":
        first, _, rest = banner.headline.partition(" — ")
        banner.headline = f"{first} ({found.line})" + (f" — {rest}" if rest else "")
    elif any(row.match == "other weights" for row in found.declared):
        banner.headline = f"Checkpoint: {found.line} — {banner.headline}"
    else:
        banner.details.insert(0, f"Checkpoint: {found.line}.")
    return banner


def _audit_banner(summary: Summary) -> Banner:
    """The diagnosis' lead cause when there is one (_cause_banner). Else: fix at the source when the
    comparison is broken, the gap is large or no cap meets the rule; correct with X when a correction
    meets its rule; else the verdict level (healthy, small, large)."""
    pair = focus_pair(summary)
    metrics = summary.pairs[pair] if pair is not None else partial_metrics({})
    verdict = summary.verdicts.get(pair) if pair else None
    level = verdict.level if verdict is not None else "unknown"
    recs = summary.recommendations
    modes = {c.mode for c in summary.corrections}
    actions = [(recommendation_action(r, modes), r) for r in recs]
    fixes = [r for a, r in actions if a == "fix"]
    corrections = [r for a, r in actions if a == "correct"]
    bugs = [r for r in fixes if r.kind in BUG_KINDS and not _minor_drift(r, summary)]
    uncorrectable = any((present(r.params) or {}).get("meets_rule") is False for r in corrections)
    numbers = key_numbers(metrics)
    details = []
    clip = present(summary.clip)
    if pair and clip is not None and clip.pairs.get(pair) is not None and clip.range:
        # The first line answers "is my ratio OK?" in the user's own clip range.
        low, high = clip.range
        details.append(f"Mismatch alone takes {clip.pairs[pair]:.2%} of {pair} tokens out of the "
                       f"PPO clip range [{low:g}, {high:g}].")
        numbers.insert(0, (f"outside clip [{low:g}, {high:g}]", clip.pairs[pair], "pct"))
    verdict_detail = None
    if verdict is not None and verdict.text:
        verdict_detail = f"{pair} ({meaning(verdict, 'log-ratio')}): {verdict_sentence(verdict.text)}."
        details.append(verdict_detail)
    # Facts that explain no gap but change how to read one (a replayed config farther from the
    # trainer than the sampler was; a declaration the replay contradicts).
    details += [f"Note: {finding}." for finding in findings(summary)]
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
    details = [line for line in details if line != verdict_detail]  # the verdict is the headline itself
    return _level_banner(pair, verdict, details=details, numbers=numbers, recommended=bool(recs))


def _level_banner(pair: str | None, verdict: Verdict, *, details: list[str],
                  numbers: list[tuple[str, Any, str]], recommended: bool) -> Banner:
    """No cause, fix or correction to lead with: the verdict's own sentence and level (healthy,
    small or large gap)."""
    level = verdict.level
    if level in HEALTHY_LEVELS:
        status, label = "healthy", "HEALTHY"
    elif level in ("small", "large"):
        status, label = level, f"{level.upper()} GAP"
    else:
        status, label = "unknown", "NOT JUDGED"
    if pair:
        details.append(f"On {pair} ({meaning(verdict, 'its log-ratio')}), trainable tokens.")
    if not recommended and level not in HEALTHY_LEVELS:
        details.append("Recommendation: not computed for this results dir.")
    return Banner(status=status, label=label, headline=verdict_sentence(verdict.text),
                  details=details, numbers=numbers)


def role_spec(summary: Summary, role: str) -> str:
    """The spec of the engine in `role` as it described itself, else the role's name."""
    return str(present(summary.engine(role).spec) or role)


def diff_banner(summary: Summary) -> Banner:
    """Which config is closer to the reference, by kl_k3, with its bootstrap interval."""
    diff = present(summary.diff) or Comparison()
    spec = {role: role_spec(summary, role) for role in ("a", "b", "reference")}
    closer = present(diff.closer_to_reference)
    kl = (diff.deltas or {}).get("kl_k3") or MetricDelta()
    numbers: list[tuple[str, Any, str]] = [
        ("kl_k3 A vs reference", present(kl.a), "num"), ("kl_k3 B vs reference", present(kl.b), "num"),
        ("Δ kl_k3 (B − A)", present(kl.delta), "num"), ("95% CI of Δ", tuple(kl.ci95 or [None, None]), "ci")]
    speed = diff.throughput_tokens_per_s or {}
    numbers += [(f"{role.upper()} tokens/s", speed[role], "num") for role in ("a", "b") if role in speed]
    details = [f"A = {spec['a']}   ·   B = {spec['b']}   ·   reference = {spec['reference']}"]
    if diff.closer_rule:
        details.append(f"Rule: {diff.closer_rule}.")
    if closer in ("a", "b"):
        headline = f"Config {closer.upper()} ({spec[closer]}) is closer to the reference"
        return Banner(status="diff", label=f"{closer.upper()} IS CLOSER", headline=headline,
                      details=details, numbers=numbers)
    if closer == "tie":
        return Banner(status="healthy", label="TIE", details=details, numbers=numbers,
                      headline="No significant difference: A and B are equally close to the reference")
    return Banner(status="unknown", label="NOT COMPARED", details=details, numbers=numbers,
                  headline="The config comparison was not computed (no `diff` block in summary.json)")


def banner(summary: Summary) -> Banner:
    return diff_banner(summary) if summary.command == "diff" else audit_banner(summary)
