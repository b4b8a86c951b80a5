"""`mismatch diff`: two engine configs replayed on the same rollouts, each against a reference.

rollouts → replay_sources(a, b, reference) → pairs a/reference, b/reference, a/b → per-metric
deltas with bootstrap CIs over rollouts, where the configs differ most, and their throughputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.chunked import table_chunks
from mismatch.audit import build_summary, publish, replay_for_results, shard_info
from mismatch.replay import DEFAULT_BLOCK, ProgressFactory, Shard
from mismatch.results import results_lock

DIFF_PAIRS = (("a", "reference"), ("b", "reference"), ("a", "b"))
# Metrics that are token means: their bootstrap over rollouts is exact from per-rollout sums.
MEAN_METRICS = ("log_ratio_abs_mean", "kl_k1", "kl_k2", "kl_k3", "chi2_token",
                "prob_abs_diff_mean", "frac_outside_2", "bitwise_equal_frac")
NUM_BOOTSTRAP = 1000


@dataclass(kw_only=True, slots=True, frozen=True)
class DiffResult:
    summary: dict[str, Any]
    tokens: pd.DataFrame
    out: Path | None


def diff(checkpoint: str | Path, rollouts: str | Path, *, a: str, b: str, reference: str = "hf",
         out: str | Path | None = None, force: bool = False, seed: int = 0,
         shard: Shard | None = None, block_size: int = DEFAULT_BLOCK,
         progress: ProgressFactory | None = None) -> DiffResult:
    """Which of configs `a` and `b` is closer to `reference`, by how much, and where."""
    out_dir = Path(out) if out is not None else None
    with results_lock(out_dir):
        return _diff(checkpoint, rollouts, a=a, b=b, reference=reference, out_dir=out_dir, force=force,
                     seed=seed, shard=shard, block_size=block_size, progress=progress)


def _diff(checkpoint: str | Path, rollouts: str | Path, *, a: str, b: str, reference: str,
          out_dir: Path | None, force: bool, seed: int, shard: Shard | None, block_size: int,
          progress: ProgressFactory | None) -> DiffResult:
    replayed, work, inputs = replay_for_results(checkpoint, rollouts, {"a": a, "b": b, "reference": reference},
                                        out=out_dir, force=force, shard=shard, block_size=block_size,
                                        progress=progress, command="diff")
    summary = analyze_diff(replayed.table, engines=replayed.engines, checkpoint=str(checkpoint),
                           rollouts_file=str(rollouts), seed=seed)
    summary["shard"] = shard_info(shard, block_size)
    summary["inputs"] = inputs
    if out_dir is not None:
        publish(out_dir, replayed.table, summary, DIFF_PAIRS, force=force, work=work)
    return DiffResult(summary=summary, tokens=replayed.table, out=out_dir)


def analyze_diff(table: pd.DataFrame, *, engines: dict[str, Any], checkpoint: str,
                 rollouts_file: str, seed: int = 0) -> dict[str, Any]:
    summary = build_summary(table_chunks(table), engines=engines, checkpoint=checkpoint,
                            rollouts_file=rollouts_file, pairs=DIFF_PAIRS, command="diff")
    summary["diff"] = compare_configs(table, summary, seed=seed)
    return summary


def compare_configs(table: pd.DataFrame, summary: dict[str, Any], *, seed: int = 0,
                    num_bootstrap: int = NUM_BOOTSTRAP) -> dict[str, Any]:
    trainable = table[table["trainable"]]
    deltas = bootstrap_deltas(trainable, seed=seed, num_bootstrap=num_bootstrap)
    kl = deltas["kl_k3"]
    if kl["ci95"][1] < 0:
        closer = "b"
    elif kl["ci95"][0] > 0:
        closer = "a"
    else:
        closer = "tie"
    engines = summary["engines"]
    return {
        "deltas": deltas,  # metric(b/reference) - metric(a/reference)
        "closer_to_reference": closer,
        "closer_rule": "by kl_k3 to the reference; 'tie' when the 95% bootstrap CI of the "
                       "difference (over rollouts) contains 0",
        "throughput_tokens_per_s": {source: engines[source].get("tokens_per_s") for source in ("a", "b")},
        "where": where_they_differ(trainable),
    }


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
    """metric(b/ref) − metric(a/ref) with a 95% CI from resampling rollouts with replacement.

    Mean-type metrics are ratios of per-rollout sums, so each resample is a weighted sum
    (multinomial counts × per-rollout sums): vectorized, no replay and no Python loop per draw.
    """
    sums_a = _per_rollout_terms(table, "a", "reference")
    sums_b = _per_rollout_terms(table, "b", "reference").reindex(sums_a.index)
    num_rollouts = len(sums_a)
    rng = np.random.default_rng(seed)
    counts_SR = rng.multinomial(num_rollouts, np.full(num_rollouts, 1.0 / num_rollouts),
                                size=num_bootstrap).astype(np.float64)
    out: dict[str, Any] = {}
    for name in MEAN_METRICS:
        point_a = sums_a[name].sum() / sums_a["n"].sum()
        point_b = sums_b[name].sum() / sums_b["n"].sum()
        with np.errstate(invalid="ignore", divide="ignore"):
            draws_a = counts_SR @ sums_a[name].to_numpy() / (counts_SR @ sums_a["n"].to_numpy())
            draws_b = counts_SR @ sums_b[name].to_numpy() / (counts_SR @ sums_b["n"].to_numpy())
        low, high = np.nanquantile(draws_b - draws_a, [0.025, 0.975])
        out[name] = {"a": float(point_a), "b": float(point_b), "delta": float(point_b - point_a),
                     "ci95": [float(low), float(high)]}
    return out


def where_they_differ(table: pd.DataFrame, *, top: int = 10) -> dict[str, Any]:
    """Turns, position bins and tokens where configs a and b disagree most with each other."""
    gap = np.abs(table["logp_a"].to_numpy() - table["logp_b"].to_numpy())
    frame = pd.DataFrame({"turn": table["turn"].to_numpy(), "pos": table["pos"].to_numpy(),
                          "gap": gap}).dropna()
    by_turn = frame.groupby("turn")["gap"].agg(["mean", "max", "size"]).reset_index()
    bins = (frame["pos"] // 256) * 256
    by_pos = frame.groupby(bins)["gap"].agg(["mean", "max", "size"]).reset_index()
    worst = table.assign(gap=gap).nlargest(top, "gap")
    return {
        "by_turn": [{"turn": int(r.turn), "abs_diff_mean": float(r["mean"]), "abs_diff_max": float(r["max"]),
                     "n_tokens": int(r["size"])} for _, r in by_turn.iterrows()],
        "by_position": [{"pos_from": int(r.pos), "abs_diff_mean": float(r["mean"]),
                         "abs_diff_max": float(r["max"]), "n_tokens": int(r["size"])}
                        for _, r in by_pos.iterrows()],
        "worst_tokens": [{"rollout": str(r.rollout), "branch": str(r.branch), "pos": int(r.pos),
                          "token_id": int(r.token_id), "logp_a": float(r.logp_a),
                          "logp_b": float(r.logp_b), "logp_reference": float(r.logp_reference)}
                         for r in worst.itertuples()],
    }
