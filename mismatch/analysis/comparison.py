"""`diff`'s comparison of two engine configs, a and b, each against the reference, read in chunks.

What grows with the run is per rollout (each mean metric's per-token terms summed per rollout, for
the bootstrap over rollouts) or per turn and position bin; the worst tokens are kept a chunk's
top at a time. So `diff` holds no token table, as the audit holds none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.chunked import Chunk, Chunks, run_passes

# Metrics that are token means: their bootstrap over rollouts is exact from per-rollout sums.
MEAN_METRICS = ("log_ratio_abs_mean", "kl_k1", "kl_k2", "kl_k3", "chi2_token",
                "prob_abs_diff_mean", "frac_outside_2", "bitwise_equal_frac")
NUM_BOOTSTRAP = 1000
BOOTSTRAP_BATCH = 50  # draws resampled at a time
POSITION_BIN = 256  # the position bins of `where` (ConfigComparison._where), in tokens
WORST_COLUMNS = ("rollout", "branch", "pos", "token_id", "logp_a", "logp_b", "logp_reference")


class ConfigComparison:
    """summary.json `diff` (but the throughputs, which are the engines'): per-metric deltas of
    b/reference − a/reference with bootstrap CIs over rollouts, the closer config, and where a
    and b disagree most, over trainable tokens."""

    def __init__(self, *, seed: int = 0, num_bootstrap: int = NUM_BOOTSTRAP, top: int = 10) -> None:
        self.seed, self.num_bootstrap, self.top = seed, num_bootstrap, top
        self.sums: list[tuple[pd.DataFrame, pd.DataFrame]] = []  # per chunk: a/reference, b/reference
        self.by_turn: list[pd.DataFrame] = []
        self.by_position: list[pd.DataFrame] = []
        self.worst: list[pd.DataFrame] = []

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        table = chunk.table
        trainable = table[table["trainable"].to_numpy(bool)]
        self.sums.append((_per_rollout_terms(trainable, "a", "reference"),
                          _per_rollout_terms(trainable, "b", "reference")))
        gap = np.abs(trainable["logp_a"].to_numpy() - trainable["logp_b"].to_numpy())
        frame = pd.DataFrame({"turn": trainable["turn"].to_numpy(), "pos": trainable["pos"].to_numpy(),
                              "gap": gap}).dropna()
        self.by_turn.append(frame.groupby("turn")["gap"].agg(["sum", "max", "size"]))
        self.by_position.append(frame.groupby((frame["pos"] // POSITION_BIN) * POSITION_BIN)["gap"]
                                .agg(["sum", "max", "size"]))
        worst = trainable.loc[:, list(WORST_COLUMNS)].assign(gap=gap).nlargest(self.top, "gap")
        self.worst.append(worst.astype({"rollout": str, "branch": str}))

    def merge(self, other: ConfigComparison, index: int) -> None:
        self.sums.extend(other.sums)
        self.by_turn.extend(other.by_turn)
        self.by_position.extend(other.by_position)
        self.worst.extend(other.worst)

    def result(self) -> dict[str, Any]:
        sums_a = _rollout_order([a for a, _ in self.sums])
        sums_b = _rollout_order([b for _, b in self.sums]).reindex(sums_a.index)
        deltas = bootstrap_from_sums(sums_a, sums_b, seed=self.seed, num_bootstrap=self.num_bootstrap)
        low, high = deltas["kl_k3"]["ci95"]
        return {
            "deltas": deltas,  # metric(b/reference) - metric(a/reference)
            "closer_to_reference": "b" if high < 0 else "a" if low > 0 else "tie",
            "closer_rule": "by kl_k3 to the reference; 'tie' when the 95% bootstrap CI of the "
                           "difference (over rollouts) contains 0",
            "where": self._where(),
        }

    def _where(self) -> dict[str, Any]:
        """Turns, position bins and tokens where configs a and b disagree most with each other."""
        worst = (pd.concat(self.worst, ignore_index=True).nlargest(self.top, "gap") if self.worst
                 else pd.DataFrame(columns=[*WORST_COLUMNS, "gap"]))
        return {
            "by_turn": [{"turn": int(key), **row} for key, row in _gap_rows(self.by_turn)],
            "by_position": [{"pos_from": int(key), **row} for key, row in _gap_rows(self.by_position)],
            "worst_tokens": [{"rollout": str(r.rollout), "branch": str(r.branch), "pos": int(r.pos),
                              "token_id": int(r.token_id), "logp_a": float(r.logp_a),
                              "logp_b": float(r.logp_b), "logp_reference": float(r.logp_reference)}
                             for r in worst.itertuples()],
        }


def compare_configs(chunks: Chunks, *, seed: int = 0, num_bootstrap: int = NUM_BOOTSTRAP) -> dict[str, Any]:
    """ConfigComparison of a table's chunks."""
    comparison = ConfigComparison(seed=seed, num_bootstrap=num_bootstrap)
    run_passes(chunks, [comparison])
    return comparison.result()


def _gap_rows(parts: list[pd.DataFrame]) -> list[tuple[Any, dict[str, float | int]]]:
    """Per key, the chunks' gap sums, maxima and counts as one: mean, max and token count."""
    if not parts:
        return []
    merged = pd.concat(parts).groupby(level=0).agg({"sum": "sum", "max": "max", "size": "sum"}).sort_index()
    return [(key, {"abs_diff_mean": float(row["sum"] / row["size"]), "abs_diff_max": float(row["max"]),
                   "n_tokens": int(row["size"])}) for key, row in merged.iterrows()]


def _rollout_order(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Per-rollout sums of every chunk, in rollout key order (a rollout lies in one chunk)."""
    if not parts:
        return pd.DataFrame(columns=["n", *MEAN_METRICS], dtype=np.float64)
    return pd.concat(parts).sort_index(kind="stable")


def _per_rollout_terms(table: pd.DataFrame, a: str, b: str) -> pd.DataFrame:
    """Per rollout: token count and the sum of each mean-type metric's per-token term."""
    logp_a = table[f"logp_{a}"].to_numpy(np.float64)
    logp_b = table[f"logp_{b}"].to_numpy(np.float64)
    log_ratio = logp_a - logp_b
    valid = ~np.isnan(log_ratio)
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = terms.ratio(log_ratio)
        per_token = pd.DataFrame({
            "n": valid.astype(np.float64),
            "log_ratio_abs_mean": np.abs(log_ratio),
            "kl_k1": terms.k1(log_ratio),
            "kl_k2": terms.k2(log_ratio),
            "kl_k3": terms.k3(log_ratio),
            "chi2_token": terms.ratio_sq(ratio) - 1.0,
            "prob_abs_diff_mean": terms.prob_abs_diff(logp_a, logp_b),
            "frac_outside_2": terms.outside(ratio).astype(np.float64),
            "bitwise_equal_frac": (logp_a == logp_b).astype(np.float64),
        })
    per_token.loc[~valid] = 0.0  # NaN tokens (no value on one side) count in neither sum nor n
    return per_token.groupby(np.asarray(table["rollout"])).sum()


def bootstrap_deltas(table: pd.DataFrame, *, seed: int, num_bootstrap: int) -> dict[str, Any]:
    """bootstrap_from_sums of a table in memory (its trainable rows, or all of them as given)."""
    return bootstrap_from_sums(_per_rollout_terms(table, "a", "reference"),
                               _per_rollout_terms(table, "b", "reference"), seed=seed, num_bootstrap=num_bootstrap)


def bootstrap_from_sums(sums_a: pd.DataFrame, sums_b: pd.DataFrame, *, seed: int,
                        num_bootstrap: int) -> dict[str, Any]:
    """metric(b/ref) − metric(a/ref) with a 95% CI from resampling rollouts with replacement.

    Mean-type metrics are ratios of per-rollout sums, so each resample is a weighted sum
    (multinomial counts × per-rollout sums): vectorized, no replay and no Python loop per draw.
    The draws are made BOOTSTRAP_BATCH at a time (the same stream of draws as all at once), so the
    counts in memory are a batch's, not (draws × rollouts).
    """
    num_rollouts = len(sums_a)
    rng = np.random.default_rng(seed)
    uniform = np.full(num_rollouts, 1.0 / max(num_rollouts, 1))
    columns = ["n", *MEAN_METRICS]
    values_a, values_b = sums_a[columns].to_numpy(np.float64), sums_b[columns].to_numpy(np.float64)
    draws_a, draws_b = [], []
    for start in range(0, num_bootstrap if num_rollouts else 0, BOOTSTRAP_BATCH):
        counts_SR = rng.multinomial(num_rollouts, uniform, size=min(BOOTSTRAP_BATCH, num_bootstrap - start))
        counts_SR = counts_SR.astype(np.float64)
        draws_a.append(counts_SR @ values_a)
        draws_b.append(counts_SR @ values_b)
    out: dict[str, Any] = {}
    for column, name in enumerate(MEAN_METRICS, start=1):
        with np.errstate(invalid="ignore", divide="ignore"):
            point_a = sums_a[name].sum() / sums_a["n"].sum()
            point_b = sums_b[name].sum() / sums_b["n"].sum()
            delta_S = (np.concatenate([d[:, column] / d[:, 0] for d in draws_b])
                       - np.concatenate([d[:, column] / d[:, 0] for d in draws_a])) if draws_a else np.empty(0)
        low, high = np.nanquantile(delta_S, [0.025, 0.975]) if len(delta_S) else (np.nan, np.nan)
        out[name] = {"a": float(point_a), "b": float(point_b), "delta": float(point_b - point_a),
                     "ci95": [float(low), float(high)]}
    return out
