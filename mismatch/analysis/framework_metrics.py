"""Each pair's gap under the names the training frameworks log, computed their way (clamps,
reductions per sequence or per rollout, default thresholds), beside our own metrics.

Flow: token table -> PairArrays per pair -> summary.json["framework_metrics"][pair][framework][key].
Read from each framework's source at the commit named in its block; `ours` names our pair metric
when the framework's is the same number, and `note` says how it differs when it is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.groups import key_codes

SAFETY_BOUND = 20.0  # verl and slime clamp log-ratios to +-20 before exp (rollout_corr_helper.py:75)


class PairArrays:
    """A pair's trainable tokens with both log-probs defined, and their sequence and rollout
    (codes 0..k-1 in table order); the log-ratio and the group sizes are made once."""

    def __init__(self, logp_a: np.ndarray, logp_b: np.ndarray, seq: np.ndarray, rollout: np.ndarray) -> None:
        self.logp_a = logp_a    # the trainer side (log pi_train in the frameworks' terms)
        self.logp_b = logp_b    # the rollout side (log pi_rollout)
        self.seq = seq          # each token's sequence (one branch of one rollout)
        self.rollout = rollout  # each token's rollout
        self.log_ratio = logp_a - logp_b
        self._counts = {id(seq): np.bincount(seq), id(rollout): np.bincount(rollout)}

    # Terms several metrics share, made once per pair.
    @cached_property
    def ratio(self) -> np.ndarray:
        return terms.ratio(self.log_ratio)

    @cached_property
    def k1(self) -> np.ndarray:
        return terms.k1(self.log_ratio)

    @cached_property
    def k3(self) -> np.ndarray:
        return terms.k3(self.log_ratio)

    @cached_property
    def abs_log_ratio(self) -> np.ndarray:
        return np.abs(self.log_ratio)

    @cached_property
    def clamped_ratio_sq(self) -> np.ndarray:
        """exp(log-ratio clamped to +-SAFETY_BOUND)^2, verl's and slime's chi-square term."""
        return np.square(np.exp(np.clip(self.log_ratio, -SAFETY_BOUND, SAFETY_BOUND)))

    @cached_property
    def prob_abs_diff(self) -> np.ndarray:
        return terms.prob_abs_diff(self.logp_a, self.logp_b)

    def per(self, codes: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Mean of `values` per code (`seq` or `rollout`)."""
        counts = self._counts[id(codes)]
        return np.bincount(codes, weights=values, minlength=len(counts)) / counts


@dataclass(frozen=True, slots=True)
class FrameworkMetric:
    framework: str
    key: str
    compute: Callable[[PairArrays], float]
    ours: str | None = None  # our pair metric that is the same number
    note: str = ""           # how it differs from ours, when it does


def _clamped(p: PairArrays) -> np.ndarray:
    return np.clip(p.log_ratio, -SAFETY_BOUND, SAFETY_BOUND)


def _rollout_mean(p: PairArrays, values: np.ndarray) -> float:
    return float(p.per(p.rollout, values).mean())


def _log_ppl_diff(p: PairArrays) -> np.ndarray:
    """Per sequence: mean logp_rollout - mean logp_train (verl's d_s)."""
    return p.per(p.seq, p.logp_b) - p.per(p.seq, p.logp_a)


def _verl_is_ess(p: PairArrays, threshold: float = 2.0) -> float:
    # rollout_corr_helper.py:677-694: token-level weights exp(clamped log-ratio), truncated to
    # [1/T, T] for the statistic, ESS = 1 / mean((w / mean w)^2).
    weights = np.clip(np.exp(_clamped(p)), 1.0 / threshold, threshold)
    return float(1.0 / np.mean(np.square(weights / weights.mean())))


def _probs(p: PairArrays) -> tuple[np.ndarray, np.ndarray]:
    return np.exp(p.logp_a), np.exp(p.logp_b)


def _trl_sequence_mask_ratio(p: PairArrays, clip_max: float = 3.0) -> np.ndarray:
    # grpo_trainer.py:2579-2621, TRL's default mode: per sequence exp(sum log-ratio), 0 above clip_max.
    ratio = terms.ratio(np.bincount(p.seq, weights=p.log_ratio))
    return np.where(ratio > clip_max, 0.0, ratio)


# verl @ b178a3cd56f5: verl/trainer/ppo/rollout_corr_helper.py:822-938 (keys prefixed rollout_corr/),
# verl/utils/debug/metrics.py:48-107 (training/...). Token means over all tokens unless said.
VERL = [
    FrameworkMetric("verl", "rollout_corr/kl", lambda p: float(np.mean(p.k1)), ours="kl_k1"),
    FrameworkMetric("verl", "rollout_corr/k3_kl", lambda p: float(np.mean(p.k3)), ours="kl_k3"),
    FrameworkMetric("verl", "rollout_corr/training_ppl", lambda p: float(np.mean(np.exp(-p.per(p.seq, p.logp_a)))),
                    note="per sequence exp(-mean logp_train), then the mean over sequences"),
    FrameworkMetric("verl", "rollout_corr/rollout_ppl", lambda p: float(np.mean(np.exp(-p.per(p.seq, p.logp_b)))),
                    note="per sequence exp(-mean logp_rollout), then the mean over sequences"),
    FrameworkMetric("verl", "rollout_corr/log_ppl_diff", lambda p: float(np.mean(_log_ppl_diff(p))),
                    note="per sequence mean logp_rollout - mean logp_train, then the mean"),
    FrameworkMetric("verl", "rollout_corr/log_ppl_abs_diff", lambda p: float(np.mean(np.abs(_log_ppl_diff(p)))),
                    note="the mean over sequences of |log_ppl_diff|"),
    FrameworkMetric("verl", "rollout_corr/ppl_ratio", lambda p: float(np.mean(np.exp(_log_ppl_diff(p)))),
                    ours="ppl_ratio"),
    FrameworkMetric("verl", "rollout_corr/chi2_token",
                    lambda p: float(np.mean(p.clamped_ratio_sq)) - 1.0,
                    ours="chi2_token", note="log-ratio clamped to +-20 before exp (ours is not clamped)"),
    FrameworkMetric("verl", "rollout_corr/chi2_seq",
                    lambda p: float(np.mean(np.exp(2.0 * np.clip(np.bincount(p.seq, weights=p.log_ratio),
                                                                 -SAFETY_BOUND, SAFETY_BOUND)))) - 1.0,
                    ours="chi2_seq", note="sequence log-ratio sum clamped to +-20 (ours is not clamped)"),
    FrameworkMetric("verl", "rollout_corr/rollout_is_eff_sample_size", _verl_is_ess,
                    note="token weights truncated to [1/2, 2] (rollout_is_threshold 2.0) before the ESS"),
    FrameworkMetric("verl", "training/rollout_probs_diff_mean",
                    lambda p: float(np.mean(p.prob_abs_diff)), ours="prob_abs_diff_mean"),
    FrameworkMetric("verl", "training/rollout_probs_diff_max",
                    lambda p: float(np.max(p.prob_abs_diff)), ours="prob_abs_diff_max"),
    FrameworkMetric("verl", "training/rollout_probs_diff_std",
                    lambda p: float(np.std(p.prob_abs_diff, ddof=1)),
                    note="sample std (ddof 1) of |p_train - p_rollout|"),
    FrameworkMetric("verl", "training/rollout_actor_probs_pearson_corr",
                    lambda p: float(np.corrcoef(*_probs(p))[0, 1]), note="Pearson correlation of the probabilities"),
]

# TRL @ f2cd57710ae3: trl/trainer/grpo_trainer.py:2780-2812 (sampling/...), with GRPOConfig defaults
# (vllm_importance_sampling_mode sequence_mask, clip_max 3.0): the ratio is logged after masking.
TRL = [
    FrameworkMetric("trl", "sampling/sampling_logp_difference/mean", lambda p: float(np.mean(p.abs_log_ratio)),
                    ours="log_ratio_abs_mean"),
    FrameworkMetric("trl", "sampling/sampling_logp_difference/max", lambda p: float(np.max(p.abs_log_ratio)),
                    ours="log_ratio_abs_max"),
    FrameworkMetric("trl", "sampling/importance_sampling_ratio/mean",
                    lambda p: float(np.mean(_trl_sequence_mask_ratio(p))),
                    note="sequence ratios after TRL's default sequence_mask at clip_max 3 (masked ones count 0)"),
    FrameworkMetric("trl", "sampling/importance_sampling_ratio/min",
                    lambda p: float(np.min(_trl_sequence_mask_ratio(p))), note="as the mean, the smallest"),
    FrameworkMetric("trl", "sampling/importance_sampling_ratio/max",
                    lambda p: float(np.max(_trl_sequence_mask_ratio(p))), note="as the mean, the largest"),
]

# slime @ 624b824a898a: slime/backends/megatron_utils/loss.py:895-927, 1136-1151 (train/...), reduced
# per rollout (tokens of a rollout averaged, then the mean over rollouts; cp_utils.py:47-124);
# examples/train_infer_mismatch_helper/mis.py:391-451 (train/mis_..., the same reduction).
SLIME = [
    FrameworkMetric("slime", "train/train_rollout_logprob_abs_diff",
                    lambda p: _rollout_mean(p, p.abs_log_ratio),
                    note="per rollout mean |log-ratio|, then the mean over rollouts"),
    FrameworkMetric("slime", "train/tis", lambda p: _rollout_mean(p, p.ratio),
                    note="raw ratio, per rollout then over rollouts"),
    FrameworkMetric("slime", "train/tis_abs", lambda p: _rollout_mean(p, np.abs(p.ratio - 1.0)),
                    note="|ratio - 1|, per rollout then over rollouts"),
    FrameworkMetric("slime", "train/tis_clipfrac",
                    lambda p: _rollout_mean(p, (p.ratio > 2.0).astype(np.float64)),
                    note="share clipped by --tis-clip 2 (--tis-clip-low 0 clips nothing below)"),
    FrameworkMetric("slime", "train/mis_kl", lambda p: _rollout_mean(p, p.k1),
                    note="k1, per rollout then over rollouts"),
    FrameworkMetric("slime", "train/mis_k3_kl", lambda p: _rollout_mean(p, p.k3),
                    note="k3, per rollout then over rollouts"),
    FrameworkMetric("slime", "train/mis_chi2_token",
                    lambda p: float(np.mean(p.per(p.rollout, p.clamped_ratio_sq) - 1.0)),
                    note="per rollout mean of exp(clamped log-ratio)^2 - 1, then the mean"),
]

# prime-rl @ 559b44772e47: src/prime_rl/trainer/rl/loss.py:100-106, train.py:499-520 (mismatch_kl/all/...):
# k3 of every token, gathered across ranks.
PRIME_RL = [
    FrameworkMetric("prime-rl", "mismatch_kl/all/mean", lambda p: float(np.mean(p.k3)),
                    ours="kl_k3"),
    FrameworkMetric("prime-rl", "mismatch_kl/all/max", lambda p: float(np.max(p.k3)),
                    note="the largest token k3"),
    FrameworkMetric("prime-rl", "mismatch_kl/all/median", lambda p: float(np.median(p.k3)),
                    note="the median token k3"),
]

# OpenRLHF @ 3c3be6234e0c: openrlhf/models/loss.py:218, trainer/ray/ppo_actor.py:316-388 (a global token mean).
OPENRLHF = [
    FrameworkMetric("openrlhf", "train/vllm_kl", lambda p: float(np.mean(p.k1)), ours="kl_k1"),
]

FRAMEWORK_METRICS: tuple[FrameworkMetric, ...] = (*VERL, *TRL, *SLIME, *PRIME_RL, *OPENRLHF)


def pair_arrays(table: pd.DataFrame, a: str, b: str) -> PairArrays:
    """The pair's trainable tokens where both log-probs are defined (a sequence is a rollout's branch).

    Every token table mismatch writes keeps a branch's rows, and a rollout's, together, so a
    group is a stretch of equal keys and is numbered by counting stretches (no sort)."""
    logp_a, logp_b = (table[f"logp_{name}"].to_numpy(np.float64) for name in (a, b))
    keep = table["trainable"].to_numpy(dtype=bool) & ~np.isnan(logp_a - logp_b)
    rollout = key_codes(table["rollout"])[keep]
    branch = key_codes(table["branch"])[keep]
    new_rollout = _starts(rollout)
    return PairArrays(logp_a=logp_a[keep], logp_b=logp_b[keep],
                      seq=np.cumsum(new_rollout | _starts(branch)) - 1, rollout=np.cumsum(new_rollout) - 1)


def _starts(codes: np.ndarray) -> np.ndarray:
    """Where a stretch of equal codes begins."""
    return np.r_[True, codes[1:] != codes[:-1]] if len(codes) else np.zeros(0, dtype=bool)


def framework_metrics(pair: PairArrays) -> dict[str, dict[str, float | None]]:
    """{framework: {key: value}} for one pair; None where the pair has no tokens."""
    out: dict[str, dict[str, float | None]] = {}
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for metric in FRAMEWORK_METRICS:
            value = metric.compute(pair) if len(pair.logp_a) else None
            out.setdefault(metric.framework, {})[metric.key] = value
    return out


def crosswalk_rows() -> list[dict[str, Any]]:
    """The README's and the report's table: each framework key, our metric when it is the same
    number, and how it differs otherwise."""
    return [{"framework": m.framework, "key": m.key, "ours": m.ours, "note": m.note} for m in FRAMEWORK_METRICS]
