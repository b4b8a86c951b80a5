"""Correction simulator: what each framework's importance-sampling fix would do to the measured ratios.

Flow: token table (train/sampler `log_ratio` per trainable token) -> simulate -> summary.json["corrections"].
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.chunked import Chunk, Chunks, run_passes, table_chunks
from mismatch.analysis.groups import Spans, dot, find_spans
from mismatch.analysis.metrics import span_sums
from mismatch.errors import MismatchError

# Conventions, shared with the frameworks cited per mode below:
# - log_ratio = log pi_train - log pi_sampler per token, ratio = exp(log_ratio); a "sequence" is one branch
#   of one rollout; only trainable tokens with a non-NaN log_ratio count.
# - Each mode gives every token a `weight` (the factor on its loss term; 0 = dropped) and an `affected` flag
#   (the correction changed what that token contributes). Sequence modes give each token its sequence's weight.
# - IS modes weight with a (processed) ratio. Rejection modes (rs_*, verl's rollout_rs) only drop tokens:
#   weight 1 kept, 0 rejected, to be combined with an IS mode in the trainer, as verl does.
# - No safety clamp on IS ratios (verl clamps log-ratios at +-20): an overflowing sequence ratio is inf,
#   truncates to the cap and fails every mask, which is what the unclamped TRL does too.
# - Inputs may be numpy arrays, lists or torch tensors; torch is never imported here (a tensor implies it is).

# verl's SAFETY_BOUND for rejection statistics (verl/trainer/ppo/rollout_corr_helper.py).
VERL_SAFETY_BOUND = 20.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Correction:
    """One simulated correction: a mode name (see MODES) and its parameters."""

    mode: str
    params: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec = MODES.get(self.mode)
        if spec is None:
            raise MismatchError(f"unknown correction mode {self.mode!r} (valid: {', '.join(MODES)})")
        if set(self.params) != set(spec.params):
            raise MismatchError(f"correction {self.mode}: needs params {', '.join(spec.params)}; "
                                f"got {', '.join(self.params) or 'none'}")
        for name, value in self.params.items():
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise MismatchError(f"correction {self.mode}: {name} must be a positive number, got {value!r}")
        if {"low", "high"} <= set(self.params) and self.params["low"] > self.params["high"]:
            raise MismatchError(f"correction {self.mode}: low {self.params['low']} is above "
                                f"high {self.params['high']}")


@dataclass(kw_only=True, slots=True, frozen=True)
class CorrectionResult:
    """What one correction does to the measured tokens (one item of summary.json["corrections"])."""

    mode: str
    params: dict[str, float]
    level: str  # token | sequence | rollout: the unit whose weight the mode decides
    n_tokens: int
    n_sequences: int
    n_rollouts: int
    frac_tokens_affected: float
    frac_sequences_affected: float
    frac_rollouts_affected: float
    weight_mean: float
    weight_std: float
    weight_max: float
    ess: float
    by_turn: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """Contract keys first (ARCHITECTURE.md, "Results dir"), then the extras."""
        return {"mode": self.mode, "params": dict(self.params),
                "frac_tokens_affected": self.frac_tokens_affected,
                "frac_rollouts_affected": self.frac_rollouts_affected,
                "weight_mean": self.weight_mean, "weight_max": self.weight_max, "ess": self.ess,
                "weight_std": self.weight_std, "level": self.level, "n_tokens": self.n_tokens,
                "n_sequences": self.n_sequences, "n_rollouts": self.n_rollouts,
                "frac_sequences_affected": self.frac_sequences_affected,
                "by_turn": [dict(row) for row in self.by_turn]}


class _Tokens:
    """Trainable, non-NaN tokens cut into spans that never cross a sequence, a rollout or a turn.

    A mode's weight is either per token or, for modes that weigh whole sequences or rollouts,
    per span (`ModeSpec.per_span`): such weights are constant over a span, and working on ~1e5
    spans instead of ~1e7 tokens is what keeps the 41 default corrections cheap.
    """

    def __init__(self, log_ratio: np.ndarray, spans: Spans, *, span_seq: np.ndarray,
                 num_seqs: int, span_rollout: np.ndarray, num_rollouts: int,
                 turn: tuple[np.ndarray, np.ndarray] | None = None,
                 span_stats: dict[str, np.ndarray] | None = None,
                 logp: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.log_ratio = log_ratio  # log pi_train - log pi_sampler, one per token, in span order
        self.logp = logp  # (logp_train, logp_sampler) per token, for the probability-gap modes
        self.num_tokens = spans.num_tokens
        self.spans = spans
        self.span_seq, self.num_seqs = span_seq, num_seqs
        self.span_rollout, self.num_rollouts = span_rollout, num_rollouts
        self.turn = turn  # (distinct turn keys, turn code of each span), or None
        # Tokens per rollout of these tokens (N / R); a chunk's sums are rescaled to the run's
        # (_CorrectionSums, ModeSpec.balanced).
        self.balance = self.num_tokens / max(num_rollouts, 1)
        if span_stats is not None:  # the metrics' own per-span sums, when the caller has them
            self.__dict__["run_stats"] = span_stats

    @cached_property
    def ratio(self) -> np.ndarray:
        with np.errstate(over="ignore"):
            return np.exp(self.log_ratio)

    def per_seq(self, per_span: np.ndarray) -> np.ndarray:
        return np.bincount(self.span_seq, weights=per_span, minlength=self.num_seqs)

    @cached_property
    def seq_count(self) -> np.ndarray:
        return self.per_seq(self.spans.lengths)

    @cached_property
    def span_stats(self) -> dict[str, np.ndarray]:
        """Per span: sum, min and max of the log-ratio (keys as metrics.span_sums)."""
        return {"log_ratio": self.spans.sum(self.log_ratio), "log_ratio_min": self.spans.min(self.log_ratio),
                "log_ratio_max": self.spans.max(self.log_ratio)}

    @property
    def span_log_ratio(self) -> np.ndarray:
        return self.span_stats["log_ratio"]

    def seq_ratio_range(self) -> tuple[np.ndarray, np.ndarray]:
        """Per span: the smallest and largest token ratio of its sequence (exp is monotonic, so
        exp(min log_ratio) is min(ratio) bit for bit)."""
        low, high = np.full(self.num_seqs, np.inf), np.full(self.num_seqs, -np.inf)
        np.minimum.at(low, self.span_seq, self.span_stats["log_ratio_min"])
        np.maximum.at(high, self.span_seq, self.span_stats["log_ratio_max"])
        with np.errstate(over="ignore"):
            return np.exp(low)[self.span_seq], np.exp(high)[self.span_seq]

    @cached_property
    def seq_sum(self) -> np.ndarray:
        """Per span: the sum of its sequence's log-ratios (TRL/verl sequence level)."""
        return self.per_seq(self.span_log_ratio)[self.span_seq]

    @cached_property
    def seq_mean(self) -> np.ndarray:
        """Per span: the mean of its sequence's log-ratios (the geometric mean, in log space)."""
        return (self.per_seq(self.span_log_ratio) / np.maximum(self.seq_count, 1))[self.span_seq]

    @cached_property
    def rollout_sum(self) -> np.ndarray:
        """Per span: the sum of its rollout's log-ratios."""
        return np.bincount(self.span_rollout, weights=self.span_log_ratio, minlength=self.num_rollouts)[self.span_rollout]

    @cached_property
    def verl_span_stats(self) -> dict[str, np.ndarray]:
        """Per span: sums (k1, k2, k3) and maxima (k1_max, k2_max, k3_max) of verl's estimators."""
        stats = {}
        for estimator in ("k1", "k2", "k3"):
            values = _verl_stat(self, estimator)
            stats[estimator], stats[f"{estimator}_max"] = self.spans.sum(values), self.spans.max(values)
        return stats

    def spread(self, per_span: np.ndarray) -> np.ndarray:
        return self.spans.spread(per_span)

    @cached_property
    def prob_gap(self) -> np.ndarray:
        """pi_train - pi_sampler of each token (signed)."""
        if self.logp is None:
            raise MismatchError("probability-gap corrections (ipo_mask, dppo_*) need both log-probs, "
                                "not only their log-ratio: pass logp_train and logp_sampler")
        logp_train, logp_sampler = self.logp
        with np.errstate(over="ignore", invalid="ignore"):
            return np.exp(logp_train) - np.exp(logp_sampler)


ModeFn = Callable[..., tuple[np.ndarray, np.ndarray]]


@dataclass(kw_only=True, slots=True, frozen=True)
class ModeSpec:
    params: tuple[str, ...]
    level: str
    fn: ModeFn
    doc: str
    per_span: bool = False  # fn returns one weight per span (constant over sequences or rollouts)
    # Weights proportional to the run's tokens per rollout (N / R, `_Tokens.balance`): summed per
    # unit of it, chunk by chunk, and scaled by the whole run's N / R at the end.
    balanced: bool = False


def _exp(log_ratio: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(log_ratio)


# --- IS modes: one-sided cap (TRL's four modes keep TRL's names and semantics) ---
# TRL trl/trainer/grpo_trainer.py (_generate_and_score_completions) with GRPOConfig
# vllm_importance_sampling_mode / vllm_importance_sampling_cap (trl/trainer/grpo_config.py):
# ratio = exp(per-token diff) or exp(sum over the completion); *_truncate: torch.clamp(ratio, max=cap);
# *_mask: ratio.masked_fill(ratio > cap, 0).

def _truncate(ratio: np.ndarray, cap: float) -> tuple[np.ndarray, np.ndarray]:
    return np.minimum(ratio, cap), ratio > cap


def _mask_above(ratio: np.ndarray, cap: float) -> tuple[np.ndarray, np.ndarray]:
    above = ratio > cap
    return np.where(above, 0.0, ratio), above


def token_truncate(t: _Tokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    # Also verl rollout_is="token" with a float rollout_is_threshold (TIS), slime --use-tis --tis-clip C
    # (slime/backends/megatron_utils/loss.py vanilla_tis_function, --tis-clip-low 0 = its default).
    return _truncate(t.ratio, cap)


def token_mask(t: _Tokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    return _mask_above(t.ratio, cap)


def sequence_truncate(t: _Tokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    # Also verl rollout_is="sequence" (exp of the masked sum, then clamp(max=threshold)).
    return _truncate(_exp(t.seq_sum), cap)


def sequence_mask(t: _Tokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    return _mask_above(_exp(t.seq_sum), cap)


def geometric_truncate(t: _Tokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    # slime MIS tis_level="geometric", tis_mode="truncate"
    # (examples/train_infer_mismatch_helper/mis.py compute_mis_weights: exp(masked_mean(log-ratio))).
    return _truncate(_exp(t.seq_mean), cap)


# --- IS modes: two-sided band ---

def _band_mask(ratio: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    keep = (ratio >= low) & (ratio <= high)
    return np.where(keep, ratio, 0.0), ~keep


def _clip(ratio: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    return np.clip(ratio, low, high), (ratio < low) | (ratio > high)


def token_clip(t: _Tokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # slime vanilla_tis_function: torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip);
    # OpenRLHF is_correction_type="tis": exp(log-ratio).clamp(min=low, max=high) (openrlhf/models/loss.py).
    return _clip(t.ratio, low, high)


def sequence_clip(t: _Tokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # TRL sequence_truncate with both vllm_importance_sampling_clip_min and _clip_max
    # (grpo_trainer.py:2579-2619 @f2cd5771: torch.clamp(exp(sum of the completion), min, max)).
    return _clip(_exp(t.seq_sum), low, high)


def token_icepop(t: _Tokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # IcePop: zero a token's weight outside [low, high], keep its raw ratio inside.
    # verl rollout_is="token" with rollout_is_threshold "low_high" (compute_rollout_correction_weights);
    # OpenRLHF is_correction_type="icepop"; slime MIS tis_mode="mask" at token level; prime-rl
    # token_mask_low/token_mask_high (src/prime_rl/trainer/rl/config.py LossConfig, ratio < low | ratio > high).
    return _band_mask(t.ratio, low, high)


def sequence_icepop(t: _Tokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # verl rollout_is="sequence" with "low_high"; slime MIS tis_level="sequence", tis_mode="mask".
    return _band_mask(_exp(t.seq_sum), low, high)


def geometric_icepop(t: _Tokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # slime MIS tis_level="geometric", tis_mode="mask"; prime-rl geo_mask_low/geo_mask_high gate.
    return _band_mask(_exp(t.seq_mean), low, high)


def seq_mask_tis(t: _Tokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # OpenRLHF is_correction_type="seq-mask-tis": drop sequences whose geometric-mean ratio leaves
    # [low, high]; kept tokens carry their own raw token ratio (openrlhf/models/loss.py PolicyLoss).
    keep = t.spread(_geometric_kept(t, low, high))
    return np.where(keep, t.ratio, 0.0), ~keep


def _geometric_kept(t: _Tokens, low: float, high: float) -> np.ndarray:
    """Per span: whether its sequence's geometric-mean ratio lies in [low, high]."""
    geometric = _exp(t.seq_mean)
    return (geometric >= low) & (geometric <= high)


def sequence_minmax_mask(t: _Tokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # prime-rl sequence_mask_low / sequence_mask_high: drop the whole sequence when any token's ratio is
    # below low or above high (the "max" of the ratios decides); kept tokens keep their token ratio.
    keep = t.spread(_minmax_kept(t, low, high))
    return np.where(keep, t.ratio, 0.0), ~keep


def _minmax_kept(t: _Tokens, low: float, high: float) -> np.ndarray:
    """Per span: whether every token ratio of its sequence lies in [low, high]."""
    seq_min, seq_max = t.seq_ratio_range()
    return (seq_min >= low) & (seq_max <= high)


# --- probability-gap masks: prime-rl's losses since 2026-03 (src/prime_rl/trainer/rl/loss.py @559b4477,
# configs in packages/prime-rl-configs/src/prime_rl/configs/trainer.py:494-519). A token is masked by
# the gap of its probabilities, dp = pi_train - pi_infer, not by its ratio; a kept token weighs its
# raw ratio (no clip). IPO masks |dp| > ipo_threshold whatever the advantage; DPPO (the default) masks
# dp > dppo_mask_high on tokens of positive-advantage samples and dp < -dppo_mask_low on negative
# ones. Rollouts carry no advantages, so DPPO is simulated per sign, as if every sample had it. ---

def ipo_mask(t: _Tokens, *, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    masked = np.abs(t.prob_gap) > threshold
    return np.where(masked, 0.0, t.ratio), masked


def dppo_positive(t: _Tokens, *, high: float) -> tuple[np.ndarray, np.ndarray]:
    masked = t.prob_gap > high
    return np.where(masked, 0.0, t.ratio), masked


def dppo_negative(t: _Tokens, *, low: float) -> tuple[np.ndarray, np.ndarray]:
    masked = t.prob_gap < -low
    return np.where(masked, 0.0, t.ratio), masked


def veto_mask(t: _Tokens, *, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    # slime MIS rs_veto_threshold (examples/train_infer_mismatch_helper/mis.py:90-96 @624b824a): a
    # sequence holding any token with ratio < threshold (a "catastrophic" token) is rejected whole;
    # rejection semantics like verl's rollout_rs: weight 1 kept, 0 rejected.
    seq_min, _ = t.seq_ratio_range()
    vetoed = seq_min < threshold
    return np.where(vetoed, 0.0, 1.0), vetoed


# --- per-rollout modes (agentic: a rollout is many branches) ---

def rollout_clip(t: _Tokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """Each rollout's ratio (exp of the sum over all its branches' trainable tokens) clipped to [low, high]."""
    return _clip(_exp(t.rollout_sum), low, high)


def rollout_balanced_truncate(t: _Tokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """Token TIS at cap, then each rollout's weights averaged so every rollout gets the same total mass.

    weight = min(ratio, cap) * (N / R) / n_tokens(rollout): a rollout that forked five subagents
    no longer outweighs a single-branch one five times, and the mean weight stays near 1. Affected
    are the capped tokens; the rebalancing shows in the weight stats.
    """
    capped, affected = _truncate(t.ratio, cap)
    return capped * t.spread(_balance_scale(t)), affected


def _balance_scale(t: _Tokens) -> np.ndarray:
    """Per span: (N / R) / n_tokens of its rollout (N / R: t.balance)."""
    per_rollout = np.bincount(t.span_rollout, weights=t.spans.lengths, minlength=t.num_rollouts)[t.span_rollout]
    return t.balance / per_rollout


# --- rejection modes: verl rollout_rs (verl/trainer/ppo/rollout_corr_helper.py,
# compute_rollout_rejection_mask). Statistics on log_ratio clamped at +-20:
# k1 = -log_ratio (kept when log(low) <= k1 <= log(high): bounds apply to 1/ratio, verl's sign),
# k2 = log_ratio^2 / 2, k3 = ratio - 1 - log_ratio (kept when <= high). token_* per token,
# seq_sum_* / seq_mean_* / seq_max_* aggregate over the sequence and drop it whole. ---

def _verl_stat(t: _Tokens, estimator: str) -> np.ndarray:
    log_ratio = np.clip(t.log_ratio, -VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    return {"k1": terms.k1, "k2": terms.k2, "k3": terms.k3}[estimator](log_ratio)


def _verl_rejection(aggregate: str, estimator: str) -> ModeFn:
    # A partial, not a closure: a simulator is pickled back from a worker process (run_passes).
    return partial(_verl_reject, aggregate, estimator)


def _verl_reject(aggregate: str, estimator: str, t: _Tokens, *, high: float,
                 low: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    if aggregate == "token":
        stat = _verl_stat(t, estimator)
    elif aggregate == "seq_sum":  # per span from here on (the sequence's statistic)
        stat = t.per_seq(t.verl_span_stats[estimator])[t.span_seq]
    elif aggregate == "seq_mean":
        stat = (t.per_seq(t.verl_span_stats[estimator]) / t.seq_count)[t.span_seq]
    else:  # seq_max
        per_seq = np.full(t.num_seqs, -np.inf)
        np.maximum.at(per_seq, t.span_seq, t.verl_span_stats[f"{estimator}_max"])
        stat = per_seq[t.span_seq]
    if estimator == "k1":
        keep = (stat >= math.log(low)) & (stat <= math.log(high))
    else:
        keep = stat <= high
    return keep.astype(np.float64), ~keep


MODES: dict[str, ModeSpec] = {
    "token_truncate": ModeSpec(params=("cap",), level="token", fn=token_truncate,
                               doc="TRL token_truncate / token TIS: min(ratio, cap)"),
    "token_mask": ModeSpec(params=("cap",), level="token", fn=token_mask,
                           doc="TRL token_mask: ratio, or 0 where ratio > cap"),
    "sequence_truncate": ModeSpec(params=("cap",), per_span=True, level="sequence", fn=sequence_truncate,
                                  doc="TRL sequence_truncate: min(exp(sum log_ratio), cap)"),
    "sequence_mask": ModeSpec(params=("cap",), per_span=True, level="sequence", fn=sequence_mask,
                              doc="TRL sequence_mask: exp(sum log_ratio), or 0 above cap"),
    "geometric_truncate": ModeSpec(params=("cap",), per_span=True, level="sequence", fn=geometric_truncate,
                                   doc="slime geometric TIS: min(exp(mean log_ratio), cap)"),
    "token_clip": ModeSpec(params=("low", "high"), level="token", fn=token_clip,
                           doc="slime TIS / OpenRLHF tis: clip(ratio, low, high)"),
    "sequence_clip": ModeSpec(params=("low", "high"), per_span=True, level="sequence", fn=sequence_clip,
                              doc="TRL sequence_truncate with clip_min: clip(exp(sum log_ratio), low, high)"),
    "token_icepop": ModeSpec(params=("low", "high"), level="token", fn=token_icepop,
                             doc="IcePop / MIS: ratio inside [low, high], else 0"),
    "sequence_icepop": ModeSpec(params=("low", "high"), per_span=True, level="sequence", fn=sequence_icepop,
                                doc="sequence MIS: exp(sum) inside [low, high], else 0"),
    "geometric_icepop": ModeSpec(params=("low", "high"), per_span=True, level="sequence", fn=geometric_icepop,
                                 doc="geometric MIS: exp(mean) inside [low, high], else 0"),
    "seq_mask_tis": ModeSpec(params=("low", "high"), level="sequence", fn=seq_mask_tis,
                             doc="OpenRLHF seq-mask-tis: token ratio if exp(mean) in [low, high], else 0"),
    "sequence_minmax_mask": ModeSpec(params=("low", "high"), level="sequence", fn=sequence_minmax_mask,
                                     doc="prime-rl sequence_mask_low/high: token ratio, 0 for the whole "
                                         "sequence if any ratio leaves [low, high]"),
    "ipo_mask": ModeSpec(params=("threshold",), level="token", fn=ipo_mask,
                         doc="prime-rl IPO: ratio, or 0 where |p_train - p_sampler| > threshold"),
    "dppo_positive": ModeSpec(params=("high",), level="token", fn=dppo_positive,
                              doc="prime-rl DPPO on positive-advantage samples: ratio, or 0 where "
                                  "p_train - p_sampler > high"),
    "dppo_negative": ModeSpec(params=("low",), level="token", fn=dppo_negative,
                              doc="prime-rl DPPO on negative-advantage samples: ratio, or 0 where "
                                  "p_train - p_sampler < -low"),
    "veto_mask": ModeSpec(params=("threshold",), per_span=True, level="sequence", fn=veto_mask,
                          doc="slime rs_veto_threshold: reject a sequence with any ratio below threshold"),
    "rollout_clip": ModeSpec(params=("low", "high"), per_span=True, level="rollout", fn=rollout_clip,
                             doc="clip(exp(sum over the rollout), low, high)"),
    "rollout_balanced_truncate": ModeSpec(params=("cap",), level="rollout", fn=rollout_balanced_truncate, balanced=True,
                                          doc="min(ratio, cap), each rollout's weights rescaled to equal mass"),
}
for _aggregate in ("token", "seq_sum", "seq_mean", "seq_max"):
    for _estimator in ("k1", "k2", "k3"):
        if _aggregate == "seq_max" and _estimator == "k1":
            continue  # verl has no seq_max_k1 (SUPPORTED_ROLLOUT_RS_OPTIONS)
        _option = f"{_aggregate}_{_estimator}"
        MODES[f"rs_{_option}"] = ModeSpec(
            params=("low", "high") if _estimator == "k1" else ("high",),
            level="token" if _aggregate == "token" else "sequence", per_span=_aggregate != "token",
            fn=_verl_rejection(_aggregate, _estimator),
            doc=f"verl rollout_rs={_option}: keep (weight 1) or reject (weight 0)")


# Modes that read the tokens' probabilities, not only their log-ratio.
PROB_GAP_MODES = frozenset({"ipo_mask", "dppo_positive", "dppo_negative"})
# Modes that only keep or drop (weight 1 or 0): a filter beside an IS mode, never a correction alone.
REJECTION_MODES = frozenset({mode for mode in MODES if mode.startswith("rs_")} | {"veto_mask"})


def _correction(mode: str, **params: float) -> Correction:
    return Correction(mode=mode, params=params)


# What `summary.json["corrections"]` lists: TRL's four modes at several caps (the contract needs 2 and 3),
# plus each framework's other modes at its documented defaults or typical values.
DEFAULT_CORRECTIONS: tuple[Correction, ...] = (
    *(_correction(mode, cap=cap)
      for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
      # verl's RolloutCorrectionConfig docs: typical caps 1.5-5 at token level, 2-10 at sequence level.
      for cap in (1.5, 2.0, 3.0, 5.0, 10.0)),
    *(_correction("geometric_truncate", cap=cap) for cap in (1.01, 1.1, 2.0)),
    _correction("token_clip", low=0.5, high=2.0),          # slime mis.yaml bounds
    _correction("sequence_clip", low=0.5, high=3.0),       # TRL sequence_truncate, clip_min 0.5, clip_max 3
    _correction("token_icepop", low=0.5, high=5.0),        # verl decoupled_token_icepop / OpenRLHF default
    _correction("token_icepop", low=0.125, high=8.0),      # prime-rl token_mask_low/high defaults
    _correction("sequence_icepop", low=0.5, high=2.0),     # verl decoupled_seq_is_rs bounds
    _correction("geometric_icepop", low=0.999, high=1.001),
    _correction("geometric_icepop", low=0.1, high=10.0),   # prime-rl geo_mask_low/high defaults
    _correction("seq_mask_tis", low=0.999, high=1.002),
    _correction("seq_mask_tis", low=0.95, high=1.05),
    _correction("sequence_minmax_mask", low=0.125, high=8.0),
    _correction("rollout_clip", low=0.5, high=2.0),
    *(_correction("rollout_balanced_truncate", cap=cap) for cap in (2.0, 3.0)),
    _correction("rs_token_k1", low=0.5, high=2.0),
    _correction("rs_token_k3", high=0.01),
    _correction("rs_seq_sum_k1", low=0.5, high=2.0),        # verl decoupled_seq_is_rs default
    _correction("rs_seq_mean_k1", low=0.999, high=1.001),  # verl Geo-RS default
    _correction("rs_seq_mean_k3", high=0.01),              # verl K3-RS default
    _correction("rs_seq_max_k3", high=0.5),
    *(_correction("ipo_mask", threshold=threshold) for threshold in (0.05, 0.1, 0.2)),  # prime-rl: 0.1
    _correction("dppo_positive", high=0.2),                # prime-rl dppo_mask_high default
    _correction("dppo_negative", low=0.2),                 # prime-rl dppo_mask_low default
    _correction("veto_mask", threshold=1e-4),              # slime mis.yaml rs_veto_threshold
)


# --- input handling: numpy or torch, never importing torch ourselves ---

def _is_tensor(values: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor cannot exist unless torch is already imported
    return torch is not None and isinstance(values, torch.Tensor)


def _to_numpy(values: Any) -> np.ndarray:
    if _is_tensor(values):
        values = values.detach()
        if values.is_floating_point():
            values = values.double()  # bf16 has no numpy dtype
        return values.cpu().numpy()
    return np.asarray(values)


def _codes(keys: Any) -> tuple[np.ndarray, int]:
    """Integer codes 0..n-1 for sortable keys (ints, strings), in sorted key order."""
    keys = _to_numpy(keys)
    _, codes = np.unique(keys, return_inverse=True)
    codes = codes.reshape(-1).astype(np.int64)
    return codes, int(codes.max()) + 1 if len(codes) else 0


def _prepare(log_ratio: Any, *, seq: Any, rollout: Any, trainable: Any | None,
             turn: Any | None = None, logp_sampler: Any | None = None) -> tuple[_Tokens, np.ndarray]:
    """The tokens to correct, and which of the given ones they are."""
    log_ratio = _to_numpy(log_ratio).astype(np.float64, copy=False)
    arrays = {"seq": _to_numpy(seq), "rollout": _to_numpy(rollout)}
    if logp_sampler is not None:
        arrays["logp_sampler"] = _to_numpy(logp_sampler).astype(np.float64, copy=False)
    if trainable is not None:
        arrays["trainable"] = _to_numpy(trainable).astype(bool)
    if turn is not None:
        arrays["turn"] = _to_numpy(turn)
    if log_ratio.ndim != 1 or any(a.shape != log_ratio.shape for a in arrays.values()):
        shapes = ", ".join(f"{k} {a.shape}" for k, a in arrays.items())
        raise ValueError(f"corrections need 1-D arrays of one length; got log_ratio {log_ratio.shape}, {shapes}")
    keep = ~np.isnan(log_ratio)  # no stored sampler log-prob: nothing to correct
    if "trainable" in arrays:
        keep &= arrays["trainable"]
    seq_codes, num_seqs = _codes(arrays["seq"][keep])
    rollout_codes, num_rollouts = _codes(arrays["rollout"][keep])
    keys = [seq_codes, rollout_codes]
    if turn is not None:
        turn_keys, turn_codes = np.unique(arrays["turn"][keep], return_inverse=True)
        keys.append(turn_codes.reshape(-1))
    spans = find_spans(keys, int(keep.sum()))
    logp = None
    if logp_sampler is not None:
        sampler = arrays["logp_sampler"][keep]
        logp = (sampler + log_ratio[keep], sampler)
    tokens = _Tokens(log_ratio[keep], spans, span_seq=seq_codes[spans.starts], num_seqs=num_seqs,
                     span_rollout=rollout_codes[spans.starts], num_rollouts=num_rollouts,
                     turn=(turn_keys, keys[2][spans.starts]) if turn is not None else None, logp=logp)
    return tokens, keep


def _apply(tokens: _Tokens, correction: Correction) -> tuple[np.ndarray, np.ndarray]:
    """(weight, affected) per token."""
    spec = MODES[correction.mode]
    weight, affected = spec.fn(tokens, **correction.params)
    if spec.per_span:
        weight, affected = tokens.spread(weight), tokens.spread(affected)
    return weight, affected


def correction_weights(log_ratio: Any, correction: Correction, *, seq: Any,
                       rollout: Any | None = None, logp_sampler: Any | None = None) -> tuple[Any, Any]:
    """(weight, affected) per token for one correction, for use inside a trainer.

    `log_ratio`, `seq` (and `rollout`, for the rollout modes) are 1-D and aligned; pass only the
    tokens that enter the loss. Given torch tensors, returns tensors on the same device (weight in
    log_ratio's dtype); given arrays, numpy arrays. NaN log-ratios get weight NaN, affected False.
    The probability-gap modes (PROB_GAP_MODES) also need the sampler's log-probs, `logp_sampler`.
    """
    values = _to_numpy(log_ratio).astype(np.float64, copy=False)
    rollout = seq if rollout is None else rollout
    tokens, valid = _prepare(values, seq=seq, rollout=rollout, trainable=None, logp_sampler=logp_sampler)
    weight = np.full(values.shape, np.nan)
    affected = np.zeros(values.shape, dtype=bool)
    weight[valid], affected[valid] = _apply(tokens, correction)
    if _is_tensor(log_ratio):
        torch = sys.modules["torch"]
        return (torch.from_numpy(weight).to(device=log_ratio.device, dtype=log_ratio.dtype),
                torch.from_numpy(affected).to(device=log_ratio.device))
    return weight, affected


def effective_sample_size(weight: np.ndarray, counts: np.ndarray | None = None) -> float:
    """(sum w)^2 / (n sum w^2), scale-free; 0 when every weight is 0, NaN with no tokens.

    `counts`: how many tokens carry each weight (one each by default). Infinite weights
    dominate: k of them among n give k/n (the limit), not inf/inf.
    """
    weight = np.asarray(weight, dtype=np.float64)
    n = len(weight) if counts is None else int(counts.sum())
    if n == 0:
        return math.nan
    sums = _EssSums()
    sums.add(weight, counts)
    return sums.value(n)


class _EssSums:
    """The sums behind an ESS, added chunk by chunk: the infinite weights' count, and the finite
    ones' sums scaled by the largest weight so far (so sum w^2 of big sequence ratios cannot
    overflow; a larger weight in a later chunk rescales what came before)."""

    def __init__(self) -> None:
        self.infinite, self.scale, self.total, self.total_sq = 0, 0.0, 0.0, 0.0

    def add(self, weight: np.ndarray, counts: np.ndarray | None) -> None:
        infinite = np.isinf(weight)
        if infinite.any():
            self.infinite += int(infinite.sum() if counts is None else counts[infinite].sum())
            weight, counts = weight[~infinite], None if counts is None else counts[~infinite]
        top = float(weight.max()) if len(weight) else 0.0
        if top <= 0:
            return
        scale = max(self.scale, top)
        shrink = self.scale / scale
        scaled = weight / scale
        if counts is None:
            total, total_sq = scaled.sum(), dot(scaled, scaled)
        else:
            total, total_sq = dot(counts, scaled), dot(counts, np.square(scaled))
        self.total = self.total * shrink + float(total)
        self.total_sq = self.total_sq * shrink * shrink + float(total_sq)
        self.scale = scale

    def merge(self, other: _EssSums) -> None:
        self.infinite += other.infinite
        scale = max(self.scale, other.scale)
        if scale <= 0:
            return
        mine, theirs = self.scale / scale, other.scale / scale
        self.total = self.total * mine + other.total * theirs
        self.total_sq = self.total_sq * mine * mine + other.total_sq * theirs * theirs
        self.scale = scale

    def value(self, n: int) -> float:
        if self.infinite:
            return self.infinite / n
        if self.scale <= 0:
            return 0.0
        return float(np.float64(self.total) ** 2 / (n * np.float64(self.total_sq)))


class _CorrectionSums:
    """One correction's weights over the tokens, summed chunk by chunk (a sequence and a rollout lie
    in one chunk): the counts, the touched tokens, sequences and rollouts, the weight's mean and
    spread (Chan's merge), its maximum, the sums behind its ESS, and the per-turn sums."""

    def __init__(self, correction: Correction) -> None:
        self.correction, self.spec = correction, MODES[correction.mode]
        self.n = self.n_seqs = self.n_rollouts = self.hits = self.seqs_hit = self.rollouts_hit = 0
        self.total, self.m2, self.top = 0.0, 0.0, -math.inf
        self.ess = _EssSums()
        self.turns: dict[Any, np.ndarray] = {}  # turn -> [tokens, touched, weight sum]

    def add(self, tokens: _Tokens) -> None:
        n = tokens.num_tokens
        if not n:
            return
        spans = tokens.spans
        weight, affected = self.spec.fn(tokens, **self.correction.params)
        if self.spec.balanced:
            weight = weight / tokens.balance
        counts = spans.lengths if self.spec.per_span else None
        with np.errstate(invalid="ignore", over="ignore"):
            if self.spec.per_span:
                span_weight, span_hits = weight * counts, affected * counts
            else:
                span_weight, span_hits = spans.sum(weight), spans.sum(affected, dtype=np.int64)
            total = float(span_weight.sum())
            mean = total / n
            deviation = weight - mean
            m2 = dot(deviation, deviation) if counts is None else dot(counts, np.square(deviation))
            merged = self.n + n
            delta = mean - (self.total / self.n if self.n else 0.0)
            self.m2 = self.m2 + m2 + (delta * delta * self.n * n / merged if self.n else 0.0)
        self.total += total
        self.n, self.n_seqs, self.n_rollouts = merged, self.n_seqs + tokens.num_seqs, self.n_rollouts + tokens.num_rollouts
        self.hits += int(span_hits.sum())
        self.seqs_hit += int((tokens.per_seq(span_hits) > 0).sum())
        self.rollouts_hit += int((np.bincount(tokens.span_rollout, weights=span_hits,
                                              minlength=tokens.num_rollouts) > 0).sum())
        self.top = max(self.top, float(weight.max()))
        self.ess.add(weight, counts)
        if tokens.turn is not None:
            self._add_turns(tokens, span_weight, span_hits)

    def merge(self, other: _CorrectionSums) -> None:
        """Take in the sums of later tokens (add's arithmetic, their sums as one chunk's)."""
        if not other.n:
            return
        with np.errstate(invalid="ignore", over="ignore"):
            merged = self.n + other.n
            delta = other.total / other.n - (self.total / self.n if self.n else 0.0)
            self.m2 = self.m2 + other.m2 + (delta * delta * self.n * other.n / merged if self.n else 0.0)
        self.total += other.total
        self.n, self.n_seqs, self.n_rollouts = merged, self.n_seqs + other.n_seqs, self.n_rollouts + other.n_rollouts
        self.hits, self.seqs_hit = self.hits + other.hits, self.seqs_hit + other.seqs_hit
        self.rollouts_hit += other.rollouts_hit
        self.top = max(self.top, other.top)
        self.ess.merge(other.ess)
        for key, row in other.turns.items():
            self.turns[key] = self.turns[key] + row if key in self.turns else row

    def _add_turns(self, tokens: _Tokens, span_weight: np.ndarray, span_hits: np.ndarray) -> None:
        assert tokens.turn is not None
        keys, span_turn = tokens.turn
        counts = np.bincount(span_turn, weights=tokens.spans.lengths, minlength=len(keys))
        hits = np.bincount(span_turn, weights=span_hits, minlength=len(keys))
        with np.errstate(invalid="ignore", over="ignore"):
            sums = np.bincount(span_turn, weights=span_weight, minlength=len(keys))
        for key, row in zip(keys.tolist(), np.stack([counts, hits, sums], axis=1)):
            self.turns[key] = self.turns[key] + row if key in self.turns else row

    def result(self) -> CorrectionResult:
        n, nan = self.n, math.nan
        base = {"mode": self.correction.mode, "params": dict(self.correction.params), "level": self.spec.level}
        if n == 0:
            return CorrectionResult(**base, n_tokens=0, n_sequences=0, n_rollouts=0, frac_tokens_affected=nan,
                                    frac_sequences_affected=nan, frac_rollouts_affected=nan, weight_mean=nan,
                                    weight_std=nan, weight_max=nan, ess=nan, by_turn=[])
        scale = n / self.n_rollouts if self.spec.balanced else 1.0  # the run's N / R
        mean = self.total / n * scale
        return CorrectionResult(
            **base, n_tokens=n, n_sequences=self.n_seqs, n_rollouts=self.n_rollouts,
            frac_tokens_affected=self.hits / n, frac_sequences_affected=self.seqs_hit / self.n_seqs,
            frac_rollouts_affected=self.rollouts_hit / self.n_rollouts, weight_mean=mean,
            weight_std=math.sqrt(self.m2 / n) * scale if math.isfinite(mean) else nan, weight_max=self.top * scale,
            ess=self.ess.value(n), by_turn=self._by_turn(scale))

    def _by_turn(self, scale: float) -> list[dict[str, Any]]:
        """Per turn: how many tokens, the share the correction touched, and their mean weight."""
        with np.errstate(invalid="ignore", over="ignore"):
            return [{"turn": key, "n_tokens": int(count), "frac_tokens_affected": float(hit / count),
                     "weight_mean": float(total / count * scale)}
                    for key, (count, hit, total) in sorted(self.turns.items())]


def _results(tokens: _Tokens, corrections: Sequence[Correction]) -> list[CorrectionResult]:
    """Every correction's result on tokens in memory (one chunk)."""
    sums = [_CorrectionSums(correction) for correction in corrections]
    for found in sums:
        found.add(tokens)
    return [found.result() for found in sums]


def simulate(log_ratio: Any, corrections: Sequence[Correction] | None = None, *, seq: Any,
             rollout: Any, turn: Any | None = None, trainable: Any | None = None,
             logp_sampler: Any | None = None) -> list[CorrectionResult]:
    """Apply each correction to the measured tokens and describe the result.

    All inputs are 1-D and aligned (numpy arrays, lists or torch tensors): `log_ratio` =
    log pi_train - log pi_sampler; `seq` names each token's sequence (one branch of one rollout:
    its ids must differ across rollouts), `rollout` its rollout, `turn` its turn (for by_turn),
    `trainable` which tokens enter the loss, `logp_sampler` the sampler's log-probs (needed by the
    probability-gap modes). NaN log-ratios and non-trainable tokens are dropped. By default every
    DEFAULT_CORRECTIONS item, less the probability-gap ones when `logp_sampler` is not given.
    """
    if corrections is None:
        corrections = [c for c in DEFAULT_CORRECTIONS if logp_sampler is not None or c.mode not in PROB_GAP_MODES]
    tokens, _ = _prepare(log_ratio, seq=seq, rollout=rollout, trainable=trainable, turn=turn,
                         logp_sampler=logp_sampler)
    return _results(tokens, corrections)


class CorrectionSimulator:
    """Every correction simulated over a table's chunks (an Analysis of one pass)."""

    def __init__(self, corrections: Sequence[Correction] = DEFAULT_CORRECTIONS, *,
                 pair: tuple[str, str] = ("train", "sampler")) -> None:
        self.columns = (f"logp_{pair[0]}", f"logp_{pair[1]}")
        self.sums = [_CorrectionSums(correction) for correction in corrections]

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        tokens = _chunk_tokens(chunk, self.columns)
        for found in self.sums:
            found.add(tokens)

    def merge(self, other: CorrectionSimulator, index: int) -> None:
        for found, theirs in zip(self.sums, other.sums):
            found.merge(theirs)

    def result(self) -> list[CorrectionResult]:
        return [found.result() for found in self.sums]


def simulate_table(table: pd.DataFrame | Chunks, corrections: Sequence[Correction] = DEFAULT_CORRECTIONS, *,
                   pair: tuple[str, str] = ("train", "sampler")) -> list[CorrectionResult]:
    """`simulate` on a token table (tokens.parquet as a DataFrame), or on its chunks of whole
    rollouts (analysis/chunked.py), chunk by chunk.

    Reads columns `rollout`, `branch`, `turn`, `trainable`, `logp_<A>` and `logp_<B>` of the pair;
    log_ratio = logp_A - logp_B, a sequence is a (rollout, branch).
    """
    found = CorrectionSimulator(corrections, pair=pair)
    run_passes(table if callable(table) else table_chunks(table), [found])
    return found.result()


def _chunk_tokens(chunk: Chunk, columns: tuple[str, str]) -> _Tokens:
    """One chunk's trainable tokens of the pair, cut into spans per turn."""
    needed = ["rollout", "branch", "turn", "trainable", *columns]
    missing = [name for name in needed if name not in chunk.table.columns]
    if missing:
        raise MismatchError(f"token table has no column {missing[0]!r} (columns: "
                            f"{', '.join(map(str, chunk.table.columns))})")
    # The metrics' own pair: its log-ratio, ratio and spans are computed once for both.
    pair_view = chunk.pair(*columns)
    tokens_view = pair_view.view
    spans, turns = tokens_view.grouping(["turn"])
    return _Tokens(pair_view.log_ratio, spans, span_seq=tokens_view.span_seq,
                   num_seqs=tokens_view.num_seqs, span_rollout=tokens_view.span_rollout,
                   num_rollouts=tokens_view.num_rollouts, turn=(turns.keys["turn"].to_numpy(), turns.span_group),
                   span_stats=span_sums(pair_view, spans), logp=(pair_view.logp_a, pair_view.logp_b))


def summary_corrections(table: pd.DataFrame | Chunks,
                        corrections: Sequence[Correction] = DEFAULT_CORRECTIONS) -> list[dict[str, Any]]:
    """`summary.json["corrections"]`: every correction simulated over train/sampler trainable tokens."""
    return [result.to_dict() for result in simulate_table(table, corrections)]
