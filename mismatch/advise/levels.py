"""Each pair's gap as a level (exact | negligible | small | large | unknown), by stated thresholds on
kl_k3 and the ratio's tail: what the verdicts word, the diagnosis reads and the rule corrects."""

from __future__ import annotations

from mismatch.results.summary_model import PairMetrics, Summary

# Thresholds (kl_k3 is per token; frac_outside_2 is the share of tokens with ratio outside [0.5, 2]).
NEGLIGIBLE_KL = 1e-6
SMALL_KL = 1e-3
SMALL_TAIL = 1e-3

HEALTHY = ("exact", "negligible")
GAPS = ("small", "large")


def gap_level(metrics: PairMetrics) -> str:
    """exact | negligible | small | large | unknown (no tokens to judge)."""
    if not metrics.n_tokens:
        return "unknown"
    if metrics.bitwise_equal_frac == 1.0:
        return "exact"
    kl, tail = metrics.kl_k3, metrics.frac_outside_2
    if kl is None or tail is None or kl != kl:  # NaN/inf from overflow counts as large
        return "large"
    if kl < NEGLIGIBLE_KL and tail == 0.0:
        return "negligible"
    if kl < SMALL_KL and tail < SMALL_TAIL:
        return "small"
    return "large"


def pair_levels(summary: Summary) -> dict[str, str]:
    """summary.json's pairs, each at its gap level."""
    return {pair: gap_level(metrics) for pair, metrics in summary.pairs.items()}
