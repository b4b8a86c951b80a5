"""The cause "truncated sampling: the ratio carries the kept mass": stored log-probs processed by a
top-p / top-k / min-p sampler (vLLM processed_logprobs) against a trainer normalized over the whole
vocabulary. It leads the semantics causes (advise/diagnose.py): every other gap is measured through it.

Terms (analysis/truncation.py): the kept mass m = p(kept set) ≤ 1; each token's ratio p/q is m, so
the ratio's mean is the mean kept mass, a bias, not a policy change. Renormalizing the trainer over
the kept set (`sampling=replay`, the like-for-like train_processed column) removes it.
"""

from __future__ import annotations


from msgspec import UNSET
from msgspec.structs import replace

from mismatch.results.section_records import KeptMassRatios, Truncation
from mismatch.results.summary_model import CauseWhere, Summary, present, to_builtins
from mismatch.advise.cause import Cause
from mismatch.advise.levels import HEALTHY
from mismatch.frameworks.protocol import Recommendation
from mismatch.frameworks.sampling import truncation_fix
from mismatch.replay.truncation import misdeclared

LIKE = "train_processed/sampler"


def _parameter_words(truncation: Truncation) -> tuple[str, CauseWhere]:
    """The truncation in words (declared, or estimated with its confidence) and its `where` entries."""
    declared, estimate = present(truncation.declared), present(truncation.estimate)
    if declared:
        active = {k: v for k, v in declared.items()
                  if (k == "top_p" and v < 1) or (k == "top_k" and v > 0) or (k == "min_p" and v > 0)}
        fit = present(truncation.declared_fit)
        wrong = misdeclared(fit, present(estimate.confidence) if estimate is not None else None)
        words = ", ".join(f"{k} {v:g}" for k, v in active.items()) + " (declared in meta.sampler" + \
            (")" if wrong else ", replayed as declared)")
        if wrong:
            words += (f"; but the declaration explains {fit:.0%} of the tokens where {estimate.kind} "
                      f"{estimate.value:g} explains {estimate.confidence:.0%}: fix meta.sampler (the "
                      "like-for-like pair replays the estimate)")
        return words, CauseWhere(source="declared", **active, declared_fit=fit,
                                 **({"misdeclared": True, "estimate": {estimate.kind: estimate.value}} if wrong else {}))
    if not estimate:
        return "its parameter not estimated (the trainer is not a torch engine)", CauseWhere(source=None)
    low, high = estimate.range
    span = f"{low:g}" if low == high else f"{low:g}-{high:g}"
    others = ", ".join(f"{name} {o['value']:g}: {o['confidence']:.0%}" for name, o in (estimate.others or {}).items())
    words = (f"{estimate.kind} ~ {estimate.value:g} (range {span}; estimated, not declared: it explains "
             f"{estimate.confidence:.0%} of {estimate.n_tokens} tokens within {estimate.tolerance_nats:g} nats "
             f"of kept mass; next best {others})")
    return words, CauseWhere(source="estimated", **{estimate.kind: estimate.value}, confidence=estimate.confidence,
                             range=estimate.range)


def ratio_words(ratios: KeptMassRatios) -> list[str]:
    """The token ratio's mean and share outside [0.9, 1.1] without and with the kept-set replay."""
    words = []
    for r, label in ((ratios.without_replay, "without replay"), (ratios.with_replay, "renormalized over the kept set")):
        if r is not UNSET:
            words.append(f"{label} ({r.pair}): ratio mean {r.ratio_mean:.4g}, "
                         f"{r.frac_outside_band:.1%} of tokens outside [0.9, 1.1]")
    return words


def truncated_sampling(summary: Summary, level: dict[str, str]) -> Cause | None:
    """The cause, when the alignment check reads the stored log-probs as truncated."""
    if summary.semantics != "truncated":
        return None
    truncation = summary.alignment.truncation or Truncation()
    ratios = present(truncation.ratios) or KeptMassRatios()
    # The ratio's mean over every trainable token is the mean kept mass (what TRL #7269 reports);
    # the semantics evidence leaves stored 0.0 (a lone kept token, or padding) to the padding check.
    without = present(ratios.without_replay)
    mass = present(without.ratio_mean if without is not None else truncation.kept_mass_mean)
    parameter, where = _parameter_words(truncation)
    evidence = [f"{truncation.frac_raised or 0:.0%} of {present(truncation.n_tokens)} tokens with a stored "
                f"log-prob below 0 sit above the replay and {truncation.frac_lowered or 0:.1%} below it: "
                "the ratio is <= 1 up to rounding, by the kept mass",
                f"the sampler truncated: {parameter}", *ratio_words(ratios)]
    rules_out = [f"not a temperature: one below 1 lowers unlikely tokens ({truncation.frac_unlikely_lowered or 0:.0%} "
                 "of them lowered here), one above 1 lowers likely ones"]
    if LIKE in level and level[LIKE] in HEALTHY:
        rules_out.append(f"renormalized over the kept set ({LIKE}) the gap is {level[LIKE]} (kl_k3 "
                         f"{summary.pairs[LIKE].kl_k3:.3g}): the truncation is the gap, not the numerics")
    elif LIKE in level:
        evidence.append(f"renormalized over the kept set ({LIKE}) a {level[LIKE]} gap remains (kl_k3 "
                        f"{summary.pairs[LIKE].kl_k3:.3g}): the truncation is not all of it")
    return Cause(kind="truncated_sampling", pair="train/sampler", fix="replay_kept_set",
                 title=f"truncated sampling: the ratio carries the kept mass (mean {mass:.3g})"
                 if isinstance(mass, (int, float)) else "truncated sampling: the ratio carries the kept mass",
                 evidence=tuple(evidence), rules_out=tuple(rules_out),
                 where=replace(where, kept_mass_mean=mass, ratios=to_builtins(ratios)))


def replay_kept_set(cause: Cause, why: str, framework: str | None) -> Recommendation:
    """The fix: renormalize the trainer over the kept set where the stack can, else sample the
    training rollouts untruncated, in the words of the target's release."""
    # sampling=replay renormalizes over a recorded kept set or a declared truncation, never a guess.
    declare = _declare(cause.where)
    return Recommendation(
        kind="replay_kept_set", params=to_builtins(replace(cause.where, ratios=UNSET)),
        why=f"{why}: renormalize the trainer's log-probs over the sampler's kept set before the ratio (vLLM "
            f"--return-sampling-mask records it per token as format v1's sampling_mask; {declare}audit with "
            "--train hf:sampling=replay --infer hf-decode:sampling=replay to see the ratio without the bias), or "
            "sample training rollouts with "
            f"top_p = 1, top_k off, min_p 0. {truncation_fix(framework)}")


def _declare(where: CauseWhere) -> str:
    """For an estimated truncation: the meta.sampler key to declare before replaying it."""
    if where.source != "estimated":
        return ""
    kind, value = next(((k, v) for k, v in (("top_p", where.top_p), ("top_k", where.top_k), ("min_p", where.min_p))
                        if v is not UNSET), (None, None))
    return f"declare meta.sampler.{kind}: {value:g} (the estimate) and " if kind else ""
