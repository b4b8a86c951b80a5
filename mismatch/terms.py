"""The per-token terms every gap metric is made of, each defined once: metrics, breakdowns, trees,
diff, corrections and the report compute them here and only reduce them differently.

A pair's tokens give `log_ratio = logp_A - logp_B` (ratio = pi_A / pi_B, as PPO uses it). Each
function takes arrays and an optional `out` buffer (the analysis reuses one scratch array
instead of a fresh ~40 MB array per term). `PAIR_METRIC_TERMS` says, for every summary.json
pair metric built on a term, which term and which reduction, and whether a larger value is worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ratio outside [1/OUTSIDE_FACTOR, OUTSIDE_FACTOR] counts in frac_outside_2.
OUTSIDE_FACTOR = 2.0


def ratio(log_ratio: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """pi_A / pi_B. An overflowing ratio is inf, not hidden by a clamp: that is the finding."""
    with np.errstate(over="ignore"):
        return np.exp(log_ratio, out=out)


def k1(log_ratio: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """logp_B - logp_A: the k1 estimator of KL(pi_B || pi_A) from samples of pi_B."""
    # 0.0 - x, not -x: the negation of an exact 0.0 stays +0.0.
    return np.subtract(0.0, log_ratio, out=out)


def k2(log_ratio: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """log_ratio^2 / 2 (halving is exact, so mean(k2) == mean(log_ratio^2) / 2 bit for bit)."""
    squared = np.square(log_ratio, out=out)
    return np.multiply(squared, 0.5, out=squared)


def k3(log_ratio: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """r - 1 - log r, without the cancellation of exp(x) - 1 near r = 1 and exactly 0 at r = 1."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.subtract(np.expm1(log_ratio, out=out), log_ratio, out=out)


def ratio_sq(ratio_values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """r^2, whose mean minus 1 is the token-level chi-square divergence."""
    with np.errstate(over="ignore"):
        return np.square(ratio_values, out=out)


def outside(ratio_values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ratio > 2 or ratio < 1/2 (bool): the tokens far enough off for any correction to touch."""
    return np.logical_or(ratio_values > OUTSIDE_FACTOR, ratio_values < 1.0 / OUTSIDE_FACTOR, out=out)


def prob_abs_diff(logp_a: np.ndarray, logp_b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """|pi_A - pi_B| of the token."""
    with np.errstate(over="ignore", invalid="ignore"):
        prob_b = np.exp(logp_b)
        return np.abs(np.subtract(np.exp(logp_a, out=out), prob_b, out=out), out=out)


@dataclass(frozen=True, slots=True)
class MetricTerm:
    term: str        # the function of this module the metric reduces
    reduction: str   # "mean" over tokens, "max", or "mean - 1" (chi-square)
    worse: str       # "higher": a larger value is a larger gap


# summary.json pair metrics that reduce one token term (the rest are counts, extremes of the
# ratio, quantiles, or per-sequence: see mismatch.metrics).
PAIR_METRIC_TERMS: dict[str, MetricTerm] = {
    "log_ratio_abs_mean": MetricTerm("abs(log_ratio)", "mean", "higher"),
    "log_ratio_abs_max": MetricTerm("abs(log_ratio)", "max", "higher"),
    "kl_k1": MetricTerm("k1", "mean", "higher"),
    "kl_k2": MetricTerm("k2", "mean", "higher"),
    "kl_k3": MetricTerm("k3", "mean", "higher"),
    "chi2_token": MetricTerm("ratio_sq", "mean - 1", "higher"),
    "prob_abs_diff_mean": MetricTerm("prob_abs_diff", "mean", "higher"),
    "prob_abs_diff_max": MetricTerm("prob_abs_diff", "max", "higher"),
    "frac_outside_2": MetricTerm("outside", "mean", "higher"),
    "bitwise_equal_frac": MetricTerm("logp_a == logp_b", "mean", "lower"),
}


# What each framework logs under its own name for (nearly) the same quantity, read from its source
# (log_ratio = logp_train - logp_rollout there too). "same" means the same formula and reduction
# as ours; otherwise the difference is said. Sources, at the commits read:
#   verl   b178a3cd56f5 verl/trainer/ppo/rollout_corr_helper.py (keys prefixed rollout_corr/),
#          verl/utils/debug/metrics.py (training/...)
#   TRL    f2cd57710ae3 trl/trainer/grpo_trainer.py (sampling/...)
#   slime  624b824a898a slime/backends/megatron_utils/loss.py (train/...),
#          examples/train_infer_mismatch_helper/mis.py (train/mis_...)
#   prime-rl 559b44772e47 src/prime_rl/trainer/rl/loss.py, trainer/rl/train.py (mismatch_kl/...)
#   OpenRLHF 3c3be6234e0c openrlhf/models/loss.py, openrlhf/trainer/ray/ppo_actor.py (train/vllm_kl)
FRAMEWORK_NAMES: dict[str, dict[str, str]] = {
    "kl_k1": {
        "verl": "rollout_corr/kl (same: token mean of logp_rollout - logp_train)",
        "slime": "train/mis_kl (per sequence, then the mean over sequences)",
        "openrlhf": "train/vllm_kl (same: a global token mean)",
    },
    "kl_k3": {
        "verl": "rollout_corr/k3_kl (same, no clamp)",
        "slime": "train/mis_k3_kl (per sequence, then the mean over sequences)",
        "prime-rl": "mismatch_kl/all/mean (same formula; against the current trainer forward)",
        "trl": "kl (async GRPO only; against the generator's log-probs)",
    },
    "chi2_token": {
        "verl": "rollout_corr/chi2_token (log-ratio clamped to +-20 before exp)",
        "slime": "train/mis_chi2_token (clamped +-20; per sequence, then over sequences)",
    },
    "chi2_seq": {
        "verl": "rollout_corr/chi2_seq (sequence log-ratio sum clamped to +-20 before exp)",
        "slime": "train/mis_chi2_seq (clamped +-20)",
    },
    "ppl_ratio": {
        "verl": "rollout_corr/ppl_ratio (same: mean over sequences of exp(-mean log-ratio))",
        "slime": "train/mis_ppl_ratio (same)",
    },
    "ess": {
        "verl": "rollout_corr/rollout_is_eff_sample_size (on weights clamped to [1/T, T])",
    },
    "log_ratio_abs_mean": {
        "trl": "sampling/sampling_logp_difference/mean (same: token mean of |log-ratio|)",
        "slime": "train/train_rollout_logprob_abs_diff (per sequence, then over sequences)",
    },
    "log_ratio_abs_max": {
        "trl": "sampling/sampling_logp_difference/max (same)",
    },
    "prob_abs_diff_mean": {
        "verl": "training/rollout_probs_diff_mean (same: |p_train - p_rollout|, token mean)",
    },
    "prob_abs_diff_max": {
        "verl": "training/rollout_probs_diff_max (same)",
    },
    "ratio_mean": {
        "slime": "train/tis (raw ratio; per sequence, then over sequences)",
        "verl": "rollout_corr/rollout_is_mean (token mode: ratio of the log-ratio clamped +-20)",
    },
}
