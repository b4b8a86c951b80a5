"""The simulated corrections: each importance-sampling mode the frameworks ship (its weight and
which tokens it changes, cited to the framework's source), the modes by name, and the corrections
summary.json lists. corrections.py simulates them on the user's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from mismatch.advise.correction_tokens import CorrectionTokens, verl_stat
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


ModeFn = Callable[..., tuple[np.ndarray, np.ndarray]]


@dataclass(kw_only=True, slots=True, frozen=True)
class ModeSpec:
    params: tuple[str, ...]
    level: str
    fn: ModeFn
    doc: str
    per_span: bool = False  # fn returns one weight per span (constant over sequences or rollouts)
    # Weights proportional to the run's tokens per rollout (N / R, `CorrectionTokens.balance`): summed per
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


def token_truncate(t: CorrectionTokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    # Also verl rollout_is="token" with a float rollout_is_threshold (TIS), slime --use-tis --tis-clip C
    # (slime/backends/megatron_utils/loss.py vanilla_tis_function, --tis-clip-low 0 = its default).
    return _truncate(t.ratio, cap)


def token_mask(t: CorrectionTokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    return _mask_above(t.ratio, cap)


def sequence_truncate(t: CorrectionTokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    # Also verl rollout_is="sequence" (exp of the masked sum, then clamp(max=threshold)).
    return _truncate(_exp(t.seq_sum), cap)


def sequence_mask(t: CorrectionTokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    return _mask_above(_exp(t.seq_sum), cap)


def geometric_truncate(t: CorrectionTokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    # slime MIS tis_level="geometric", tis_mode="truncate"
    # (examples/train_infer_mismatch_helper/mis.py compute_mis_weights: exp(masked_mean(log-ratio))).
    return _truncate(_exp(t.seq_mean), cap)


# --- IS modes: two-sided band ---

def _band_mask(ratio: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    keep = (ratio >= low) & (ratio <= high)
    return np.where(keep, ratio, 0.0), ~keep


def _clip(ratio: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    return np.clip(ratio, low, high), (ratio < low) | (ratio > high)


def token_clip(t: CorrectionTokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # slime vanilla_tis_function: torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip);
    # OpenRLHF is_correction_type="tis": exp(log-ratio).clamp(min=low, max=high) (openrlhf/models/loss.py).
    return _clip(t.ratio, low, high)


def sequence_clip(t: CorrectionTokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # TRL sequence_truncate with both vllm_importance_sampling_clip_min and _clip_max
    # (grpo_trainer.py:2579-2619 @f2cd5771: torch.clamp(exp(sum of the completion), min, max)).
    return _clip(_exp(t.seq_sum), low, high)


def token_icepop(t: CorrectionTokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # IcePop: zero a token's weight outside [low, high], keep its raw ratio inside.
    # verl rollout_is="token" with rollout_is_threshold "low_high" (compute_rollout_correction_weights);
    # OpenRLHF is_correction_type="icepop"; slime MIS tis_mode="mask" at token level; prime-rl
    # token_mask_low/token_mask_high (src/prime_rl/trainer/rl/config.py LossConfig, ratio < low | ratio > high).
    return _band_mask(t.ratio, low, high)


def sequence_icepop(t: CorrectionTokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # verl rollout_is="sequence" with "low_high"; slime MIS tis_level="sequence", tis_mode="mask".
    return _band_mask(_exp(t.seq_sum), low, high)


def geometric_icepop(t: CorrectionTokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # slime MIS tis_level="geometric", tis_mode="mask"; prime-rl geo_mask_low/geo_mask_high gate.
    return _band_mask(_exp(t.seq_mean), low, high)


def seq_mask_tis(t: CorrectionTokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # OpenRLHF is_correction_type="seq-mask-tis": drop sequences whose geometric-mean ratio leaves
    # [low, high]; kept tokens carry their own raw token ratio (openrlhf/models/loss.py PolicyLoss).
    keep = t.spread(_geometric_kept(t, low, high))
    return np.where(keep, t.ratio, 0.0), ~keep


def _geometric_kept(t: CorrectionTokens, low: float, high: float) -> np.ndarray:
    """Per span: whether its sequence's geometric-mean ratio lies in [low, high]."""
    geometric = _exp(t.seq_mean)
    return (geometric >= low) & (geometric <= high)


def sequence_minmax_mask(t: CorrectionTokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    # prime-rl sequence_mask_low / sequence_mask_high: drop the whole sequence when any token's ratio is
    # below low or above high (the "max" of the ratios decides); kept tokens keep their token ratio.
    keep = t.spread(_minmax_kept(t, low, high))
    return np.where(keep, t.ratio, 0.0), ~keep


def _minmax_kept(t: CorrectionTokens, low: float, high: float) -> np.ndarray:
    """Per span: whether every token ratio of its sequence lies in [low, high]."""
    seq_min, seq_max = t.seq_ratio_range()
    return (seq_min >= low) & (seq_max <= high)


# --- probability-gap masks: prime-rl's losses since 2026-03 (src/prime_rl/trainer/rl/loss.py @559b4477,
# configs in packages/prime-rl-configs/src/prime_rl/configs/trainer.py:494-519). A token is masked by
# the gap of its probabilities, dp = pi_train - pi_infer, not by its ratio; a kept token weighs its
# raw ratio (no clip). IPO masks |dp| > ipo_threshold whatever the advantage; DPPO (the default) masks
# dp > dppo_mask_high on tokens of positive-advantage samples and dp < -dppo_mask_low on negative
# ones. Rollouts carry no advantages, so DPPO is simulated per sign, as if every sample had it. ---

def ipo_mask(t: CorrectionTokens, *, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    masked = np.abs(t.prob_gap) > threshold
    return np.where(masked, 0.0, t.ratio), masked


def dppo_positive(t: CorrectionTokens, *, high: float) -> tuple[np.ndarray, np.ndarray]:
    masked = t.prob_gap > high
    return np.where(masked, 0.0, t.ratio), masked


def dppo_negative(t: CorrectionTokens, *, low: float) -> tuple[np.ndarray, np.ndarray]:
    masked = t.prob_gap < -low
    return np.where(masked, 0.0, t.ratio), masked


def veto_mask(t: CorrectionTokens, *, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    # slime MIS rs_veto_threshold (examples/train_infer_mismatch_helper/mis.py:90-96 @624b824a): a
    # sequence holding any token with ratio < threshold (a "catastrophic" token) is rejected whole;
    # rejection semantics like verl's rollout_rs: weight 1 kept, 0 rejected.
    seq_min, _ = t.seq_ratio_range()
    vetoed = seq_min < threshold
    return np.where(vetoed, 0.0, 1.0), vetoed


# --- per-rollout modes (agentic: a rollout is many branches) ---

def rollout_clip(t: CorrectionTokens, *, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """Each rollout's ratio (exp of the sum over all its branches' trainable tokens) clipped to [low, high]."""
    return _clip(_exp(t.rollout_sum), low, high)


def rollout_balanced_truncate(t: CorrectionTokens, *, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """Token TIS at cap, then each rollout's weights averaged so every rollout gets the same total mass.

    weight = min(ratio, cap) * (N / R) / n_tokens(rollout): a rollout that forked five subagents
    no longer outweighs a single-branch one five times, and the mean weight stays near 1. Affected
    are the capped tokens; the rebalancing shows in the weight stats.
    """
    capped, affected = _truncate(t.ratio, cap)
    return capped * t.spread(_balance_scale(t)), affected


def _balance_scale(t: CorrectionTokens) -> np.ndarray:
    """Per span: (N / R) / n_tokens of its rollout (N / R: t.balance)."""
    per_rollout = np.bincount(t.span_rollout, weights=t.spans.lengths, minlength=t.num_rollouts)[t.span_rollout]
    return t.balance / per_rollout


# --- rejection modes: verl rollout_rs (verl/trainer/ppo/rollout_corr_helper.py,
# compute_rollout_rejection_mask). Statistics on log_ratio clamped at +-20:
# k1 = -log_ratio (kept when log(low) <= k1 <= log(high): bounds apply to 1/ratio, verl's sign),
# k2 = log_ratio^2 / 2, k3 = ratio - 1 - log_ratio (kept when <= high). token_* per token,
# seq_sum_* / seq_mean_* / seq_max_* aggregate over the sequence and drop it whole. ---


def _verl_rejection(aggregate: str, estimator: str) -> ModeFn:
    # A partial, not a closure: a simulator is pickled back from a worker process (run_passes).
    return partial(_verl_reject, aggregate, estimator)


def _verl_reject(aggregate: str, estimator: str, t: CorrectionTokens, *, high: float,
                 low: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    if aggregate == "token":
        stat = verl_stat(t, estimator)
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
