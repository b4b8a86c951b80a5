"""Rule 1 of the recommendation (recommend.py RULE): which simulated correction, if any, of those
the target release can express, and the words that say why it won."""

from __future__ import annotations

import math

from mismatch.advise.correction_modes import MODES, REJECTION_MODES
from mismatch.advise.evidence import PAIR, Evidence
from mismatch.errors import MismatchError
from mismatch.frameworks.protocol import Recommendation, Target
from mismatch.frameworks.registry import MODULES, module
from mismatch.results.summary_model import Correction, PairMetrics, Params

MAX_FRAC_AFFECTED = 0.01  # at most 1% of trainable tokens clipped
MIN_ESS = 0.9


def choose_correction(evidence: Evidence, target: Target | None = None) -> Recommendation:
    """Rule 1: the simulated correction with the most ESS among those that change at most 1% of the
    trainable tokens, from the modes `target`'s release can express (any framework's, without one)."""
    level = evidence.level
    if level == "unknown":
        return Recommendation(kind="no_correction", params={"gap": level},
                              why="no stored sampler log-probs on trainable tokens: the train/sampler "
                                  "ratio cannot be measured, so no correction can be chosen")
    if level in ("exact", "negligible"):
        return Recommendation(kind="no_correction", params={"gap": level},
                              why=f"the {evidence.pair} ratio is 1 up to rounding ({_gap_words(evidence.metrics)}): "
                                  "a correction would change nothing")
    who = target.label if target is not None else "a framework"
    expressible = [c for c in evidence.corrections if _expressible(c, target)]
    if not expressible:
        raise MismatchError(f"no simulated corrections that {who} can express: summary.json has no "
                            "'corrections' (simulate them with mismatch.advise.corrections.summary_corrections)")
    # A step at a turn biases every later token the same way, as a slope along position does.
    unit = "sequence" if evidence.grows_with_position or evidence.onset_turn is not None else "token"
    candidates = [c for c in expressible if _mode_level(c) == unit] or expressible
    ranked = sorted(candidates, key=_rank)
    chosen = ranked[0]
    passing = [c for c in ranked if _passes(c)]
    why = [f"the {evidence.pair} gap is {level} ({_gap_words(evidence.metrics)})",
           _unit_reason(evidence, candidates is not expressible),
           _winner_words(chosen, ranked, who, passing=bool(passing))]
    params = {"mode": chosen.mode, **chosen.params, "frac_tokens_affected": chosen.frac_tokens_affected,
              "frac_rollouts_affected": chosen.frac_rollouts_affected, "ess": chosen.ess,
              "weight_mean": chosen.weight_mean, "meets_rule": bool(passing),
              "ranked": [_brief(c) for c in ranked[:5]]}
    if target is not None:
        params["framework"] = target.label
    if evidence.pair != PAIR:
        params["pair"] = evidence.pair
    return Recommendation(kind="correction", why="; ".join(why), params=params)


def _gap_words(metrics: PairMetrics | None) -> str:
    if metrics is None:
        return "not measured"
    return (f"kl_k3 {_shown(metrics.kl_k3)}, ratio_q001-ratio_q999 {_shown(metrics.ratio_q001)}-"
            f"{_shown(metrics.ratio_q999)} over {metrics.n_tokens or 0:,} trainable tokens")


def _shown(value: float | None) -> str:
    return f"{value:.3g}" if value is not None else "null"


def _expressible(correction: Correction, target: Target | None) -> bool:
    """A correction a trainer can run: an IS mode (a rejection filter corrects no ratio by itself),
    with a native setting in `target`'s release, or in some framework's newest release without one."""
    mode = correction.mode
    if mode not in MODES or mode in REJECTION_MODES:
        return False
    params = correction.params
    if target is not None:
        return module(target.framework).express(mode, params, target.release) is not None
    return any(found.express(mode, params, found.RELEASES[-1]) is not None
               for found in MODULES.values())


def _mode_level(correction: Correction) -> str:
    return MODES[correction.mode].level


def _rank(correction: Correction) -> tuple[bool, float, float, float]:
    """Passing first; then the most ESS (the least variance the weights add); then the fewest tokens
    changed; then the weight mean nearest 1 (the least mass taken from the gradient)."""
    weight_mean = correction.weight_mean
    bias = abs(_num(weight_mean) - 1.0) if weight_mean is not None else math.inf
    return (not _passes(correction), -_num(correction.ess), _num(correction.frac_tokens_affected, 1.0), bias)


def _brief(correction: Correction) -> Params:
    return {"mode": correction.mode, "params": dict(correction.params), "ess": correction.ess,
            "frac_tokens_affected": correction.frac_tokens_affected,
            "weight_mean": correction.weight_mean, "meets_rule": _passes(correction)}


def describe(correction: Correction) -> str:
    """`token_icepop [0.5, 5]`, `token_truncate cap 2`, `ipo_mask threshold 0.1`."""
    params = correction.params
    if "low" in params and "high" in params:
        return f"{correction.mode} [{params['low']:g}, {params['high']:g}]"
    return f"{correction.mode} " + ", ".join(f"{k} {v:g}" for k, v in params.items())


def _effect(correction: Correction) -> str:
    verb = "clipped" if correction.mode in _CLIPPING else "dropped"
    return (f"ESS {_num(correction.ess):.3f}, {_num(correction.frac_tokens_affected):.2%} of tokens "
            f"{verb}, weight mean {_num(correction.weight_mean):.3f}")


_CLIPPING = frozenset({"token_truncate", "sequence_truncate", "geometric_truncate", "token_clip", "sequence_clip",
                       "rollout_clip", "rollout_balanced_truncate"})


def _winner_words(chosen: Correction, ranked: list[Correction], who: str, *, passing: bool) -> str:
    if passing:
        words = (f"{describe(chosen)} keeps the most ESS of the {len(ranked)} simulated corrections {who} can "
                 f"express that change at most {MAX_FRAC_AFFECTED:.0%} of trainable tokens with ESS >= {MIN_ESS} "
                 f"({_effect(chosen)})")
    else:
        words = (f"no simulated correction {who} can express changes at most {MAX_FRAC_AFFECTED:.0%} of tokens "
                 f"with ESS >= {MIN_ESS}; {describe(chosen)} keeps the most ESS ({_effect(chosen)}): the tail is "
                 "too heavy for a correction alone, fix the source")
    other = next((c for c in ranked[1:] if c.mode != chosen.mode), None)
    if other is not None:
        words += f"; the best other mode, {describe(other)}: {_effect(other)}"
    same = [c for c in ranked[1:] if c.mode == chosen.mode]
    if same and "cap" in chosen.params:
        below = [c for c in same if c.params["cap"] < chosen.params["cap"]]
        if below:
            nearest = max(below, key=lambda c: c.params["cap"])
            words += f"; cap {nearest.params['cap']:g} would clip {_num(nearest.frac_tokens_affected):.2%} " \
                     f"(ESS {_num(nearest.ess):.3f})"
    return words


def _num(value: float | int | None, missing: float = -math.inf) -> float:
    return missing if value is None or value != value else float(value)


def _passes(correction: Correction) -> bool:
    frac, ess = correction.frac_tokens_affected, correction.ess
    return frac is not None and ess is not None and frac <= MAX_FRAC_AFFECTED and ess >= MIN_ESS


def _unit_reason(evidence: Evidence, restricted: bool) -> str:
    if evidence.onset_turn is not None or evidence.grows_with_position:
        reason = (f"the mismatch steps up at turn {evidence.onset_turn} and stays" if evidence.onset_turn is not None
                  else "the mismatch grows with position")
        reason += (": later tokens are biased the same way, so the product over the sequence is what drifts and "
                   "a per-token cap would miss it")
        return f"sequence-level modes only, because {reason}" if restricted else \
            f"{reason}, but no sequence-level mode is expressible here"
    if evidence.grows_with_position is None:
        return "token-level modes (the position trend was not measured; token level is the safe default)"
    return "token-level modes, because the mismatch does not grow with position: per-token noise, corrected per token"
