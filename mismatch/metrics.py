"""Pair metrics: how far two engines' per-token log-probs are apart, per token and per sequence.

Flow: token table (`logp_*` columns, one row per replayed token) -> metrics -> localize / recommend / report.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from mismatch.errors import MismatchError

# Contract names and order of `summary.json["pairs"]["A/B"]` (ARCHITECTURE.md, "Results directory").
PAIR_METRICS: tuple[str, ...] = (
    "n_tokens", "n_rollouts",
    "log_ratio_mean", "log_ratio_abs_mean", "log_ratio_abs_max",
    "ratio_mean", "ratio_std", "ratio_min", "ratio_max", "ratio_p01", "ratio_p99", "ratio_p999",
    "kl_k1", "kl_k2", "kl_k3", "chi2_token", "chi2_seq", "ppl_ratio", "ess",
    "prob_abs_diff_mean", "prob_abs_diff_max", "frac_outside_2", "bitwise_equal_frac",
)
_COUNTS = ("n_tokens", "n_rollouts")
_QUANTILES = {"ratio_p01": 0.01, "ratio_p99": 0.99, "ratio_p999": 0.999}
DEFAULT_SEQ = ("rollout", "branch")


def _token_terms(logp_a: np.ndarray, logp_b: np.ndarray) -> dict[str, np.ndarray]:
    """Per-token values whose plain mean over a group is the metric of the same name.

    `chi2_token` holds r^2 here; the caller subtracts 1 after averaging.
    """
    log_ratio = logp_a - logp_b
    # A ratio that overflows is reported as inf, not hidden by a clamp: that is the finding.
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(log_ratio)
        return {
            "log_ratio_mean": log_ratio,
            "log_ratio_abs_mean": np.abs(log_ratio),
            "ratio_mean": ratio,
            # logp_b - logp_a, not -log_ratio: equal log-probs then give +0.0, never -0.0.
            "kl_k1": logp_b - logp_a,
            # Halving is exact in binary floating point, so mean(x^2 / 2) == mean(x^2) / 2.
            "kl_k2": 0.5 * np.square(log_ratio),
            # r - 1 - log r without cancellation near r = 1, and exactly 0 at log_ratio = 0.
            "kl_k3": np.expm1(log_ratio) - log_ratio,
            "chi2_token": np.square(ratio),
            "prob_abs_diff_mean": np.abs(np.exp(logp_a) - np.exp(logp_b)),
            "frac_outside_2": ((ratio > 2.0) | (ratio < 0.5)).astype(np.float64),
            "bitwise_equal_frac": (logp_a == logp_b).astype(np.float64),
        }


def _group_metrics(group_id: np.ndarray, num_groups: int, logp_a: np.ndarray, logp_b: np.ndarray,
                   seq_id: np.ndarray, rollout_id: np.ndarray) -> pd.DataFrame:
    """All PAIR_METRICS for groups 0..num_groups-1 of integer-coded tokens, one row per group.

    The single implementation behind `pair_metrics` (one group) and `grouped_pair_metrics`,
    so the two can never drift apart. Every reduction is a groupby aggregation: no Python
    loop over tokens or groups.
    """
    logp_a = np.asarray(logp_a, dtype=np.float64)
    logp_b = np.asarray(logp_b, dtype=np.float64)
    valid = ~(np.isnan(logp_a) | np.isnan(logp_b))
    logp_a, logp_b = logp_a[valid], logp_b[valid]
    group_id, seq_id, rollout_id = group_id[valid], seq_id[valid], rollout_id[valid]
    if not valid.any():
        return _empty_metrics(num_groups)

    terms = pd.DataFrame(_token_terms(logp_a, logp_b))
    # Token means as bincount sums / counts: one pass per term, no groupby machinery (the hot
    # spot of the analysis benchmark). Only groups with tokens get a row, as groupby would.
    counts = np.bincount(group_id, minlength=num_groups)
    present = np.flatnonzero(counts)
    with np.errstate(over="ignore", invalid="ignore"):
        out = pd.DataFrame({name: np.bincount(group_id, weights=values.to_numpy(), minlength=num_groups)[present]
                            / counts[present] for name, values in terms.items()},
                           index=pd.Index(present))
    out["chi2_token"] -= 1.0
    out["n_tokens"] = counts[present]
    out["n_rollouts"] = pd.Series(rollout_id).groupby(group_id).nunique()

    log_ratio = terms["log_ratio_mean"]
    lr_by_group = log_ratio.groupby(group_id)
    lr_min, lr_max = lr_by_group.min(), lr_by_group.max()
    out["log_ratio_abs_max"] = terms["log_ratio_abs_mean"].groupby(group_id).max()
    out["prob_abs_diff_max"] = terms["prob_abs_diff_mean"].groupby(group_id).max()
    with np.errstate(over="ignore", invalid="ignore"):
        # exp is monotonic, so exp(max log_ratio) is max(ratio) bit for bit.
        out["ratio_min"] = np.exp(lr_min)
        out["ratio_max"] = np.exp(lr_max)

        # Two passes (deviations from the group mean) rather than E[r^2] - E[r]^2, which
        # cancels to noise for the ratio ~ 1 +- 1e-8 that good engine pairs produce. ddof=0.
        ratio = terms["ratio_mean"].to_numpy()
        deviation = ratio - out["ratio_mean"].to_numpy()[_positions(out.index, group_id)]
        out["ratio_std"] = np.sqrt(pd.Series(np.square(deviation)).groupby(group_id).mean())

        # ESS is scale-free, so weigh by exp(log_ratio - group max): same number, but a single
        # huge ratio (a -9999 placeholder log-prob) gives ESS ~ 1/n instead of inf/inf = NaN.
        weight = np.exp(log_ratio.to_numpy() - lr_max.to_numpy()[_positions(out.index, group_id)])
        weights = pd.DataFrame({"w": weight, "w2": np.square(weight)}).groupby(group_id).sum()
        out["ess"] = np.square(weights["w"]) / (out["n_tokens"] * weights["w2"])

        quantiles = pd.Series(ratio).groupby(group_id).quantile(list(_QUANTILES.values()))
        quantiles = quantiles.unstack()
        for name, q in _QUANTILES.items():
            out[name] = quantiles[q]

        # Sequence level: sum log-ratios first, exponentiate once per sequence. No clamp (verl
        # clamps the sum at +-20): a sequence weight that overflows float64 makes chi2_seq inf.
        per_seq = log_ratio.groupby([group_id, seq_id]).agg(["sum", "count"])
        seq_group = per_seq.index.get_level_values(0)
        out["chi2_seq"] = pd.Series(np.exp(2.0 * per_seq["sum"].to_numpy())).groupby(seq_group).mean() - 1.0
        # verl's rollout_corr/ppl_ratio: each sequence's PPL_A / PPL_B = exp(-mean log_ratio),
        # then the mean over sequences.
        seq_ppl_ratio = np.exp(-(per_seq["sum"] / per_seq["count"]).to_numpy())
        out["ppl_ratio"] = pd.Series(seq_ppl_ratio).groupby(seq_group).mean()

    # Groups whose tokens were all NaN still get a row: zero counts, NaN metrics.
    out = out.reindex(pd.RangeIndex(num_groups))
    for name in _COUNTS:
        out[name] = out[name].fillna(0).astype(np.int64)
    return out[list(PAIR_METRICS)]


def _empty_metrics(num_groups: int) -> pd.DataFrame:
    out = pd.DataFrame(np.nan, index=pd.RangeIndex(num_groups), columns=list(PAIR_METRICS))
    for name in _COUNTS:
        out[name] = np.zeros(num_groups, dtype=np.int64)
    return out


def _positions(group_index: pd.Index, group_id: np.ndarray) -> np.ndarray:
    """Row of each token's group in a per-group frame indexed by the sorted present group ids."""
    return np.searchsorted(group_index.to_numpy(), group_id)


def _codes(keys: np.ndarray | pd.Series) -> np.ndarray:
    """Integer code per distinct key (ints, strings, categoricals); NaN is a key of its own."""
    if not isinstance(keys, (pd.Series, pd.Index, pd.Categorical)):
        keys = np.asarray(keys)
    codes, _ = pd.factorize(keys, use_na_sentinel=False)
    return codes


def pair_metrics(logp_a: np.ndarray, logp_b: np.ndarray, *, seq: np.ndarray,
                 rollout: np.ndarray) -> dict[str, float]:
    """PAIR_METRICS of A against B over the given tokens, with log_ratio = logp_a - logp_b.

    `seq` and `rollout` are keys aligned with the log-probs: `seq` names each token's
    sequence (one branch of one rollout) for chi2_seq and ppl_ratio, `rollout` its rollout
    for n_rollouts. Tokens where either log-prob is NaN are dropped before anything else.
    Everything is computed in float64 (float32 inputs are upcast).

    Sequence-level metrics follow verl (`verl/trainer/ppo/rollout_corr_helper.py`,
    `compute_offpolicy_metrics`): chi2_seq = mean over sequences of exp(2 * sum log_ratio) - 1;
    ppl_ratio = mean over sequences of exp(-mean log_ratio), i.e. each sequence's
    perplexity under A over its perplexity under B, then averaged. Unlike verl nothing is
    clamped: an overflowing ratio or sequence weight shows up as inf. ratio_std is the
    population std (ddof=0); quantiles use numpy's default linear interpolation.

    No tokens: n_tokens = n_rollouts = 0 and every other metric is NaN.
    """
    logp_a, logp_b = np.asarray(logp_a), np.asarray(logp_b)
    if not (logp_a.shape == logp_b.shape == np.shape(seq) == np.shape(rollout)) or logp_a.ndim != 1:
        raise ValueError(f"pair_metrics needs 1-D arrays of one length; got shapes {logp_a.shape}, "
                         f"{logp_b.shape}, seq {np.shape(seq)}, rollout {np.shape(rollout)}")
    group_id = np.zeros(len(logp_a), dtype=np.int64)
    row = _group_metrics(group_id, 1, logp_a, logp_b, _codes(seq), _codes(rollout)).iloc[0]
    return {name: int(row[name]) if name in _COUNTS else float(row[name]) for name in PAIR_METRICS}


def _as_list(columns: str | Sequence[str]) -> list[str]:
    return [columns] if isinstance(columns, str) else list(columns)


def grouped_pair_metrics(table: pd.DataFrame, a: str, b: str, *, by: str | Sequence[str],
                         seq: Sequence[str] = DEFAULT_SEQ, rollout: str = "rollout") -> pd.DataFrame:
    """`pair_metrics` of columns `a` against `b` for every group of `by`, in one vectorized pass.

    Returns one row per group (sorted by the keys, including groups whose tokens are all
    NaN), with the `by` columns followed by PAIR_METRICS. A sequence is a distinct `seq`
    tuple within a group, so by="turn" gives each branch's tokens of that turn.
    """
    by_cols, seq_cols = _as_list(by), _as_list(seq)
    missing = [c for c in [a, b, rollout, *by_cols, *seq_cols] if c not in table.columns]
    if missing:
        columns = ", ".join(map(str, table.columns))
        raise MismatchError(f"token table has no column {missing[0]!r} (columns: {columns})")
    groups = table.groupby(by_cols, sort=True, observed=True, dropna=False)
    group_id = groups.ngroup().to_numpy(dtype=np.int64)
    seq_groups = table.groupby(seq_cols, sort=False, observed=True, dropna=False)
    seq_id = seq_groups.ngroup().to_numpy(dtype=np.int64)
    metrics = _group_metrics(group_id, groups.ngroups, table[a].to_numpy(), table[b].to_numpy(),
                             seq_id, _codes(table[rollout]))
    # Keys from each group's first row: ngroup numbers groups in sorted-key order.
    _, first_row = np.unique(group_id, return_index=True)
    keys = table[by_cols].iloc[first_row].reset_index(drop=True)
    return pd.concat([keys, metrics.reset_index(drop=True)], axis=1)


def _pair_columns(table: pd.DataFrame, pair: tuple[str, str]) -> tuple[str, str]:
    a, b = f"logp_{pair[0]}", f"logp_{pair[1]}"
    for column in (a, b):
        if column not in table.columns:
            have = sorted(str(c) for c in table.columns if str(c).startswith("logp_"))
            raise MismatchError(f"pair {pair[0]}/{pair[1]}: token table has no column {column!r} "
                                f"(log-prob columns: {', '.join(have) or 'none'})")
    return a, b


def _trainable(table: pd.DataFrame, trainable_only: bool) -> pd.DataFrame:
    # Only trainable tokens enter the PPO loss, so only their ratio matters (contract).
    return table[table["trainable"].to_numpy(dtype=bool)] if trainable_only else table


def summarize_pairs(table: pd.DataFrame, pairs: list[tuple[str, str]], *,
                    trainable_only: bool = True) -> dict[str, dict[str, float]]:
    """`summary.json["pairs"]`: {"A/B": pair_metrics of logp_A against logp_B} for each pair.

    A sequence is one branch of one rollout; only `trainable` tokens count unless
    trainable_only=False.
    """
    tokens = _trainable(table, trainable_only)
    seq_id = tokens.groupby(list(DEFAULT_SEQ), sort=False, observed=True, dropna=False).ngroup().to_numpy()
    summary = {}
    for pair in pairs:
        a, b = _pair_columns(tokens, pair)
        summary[f"{pair[0]}/{pair[1]}"] = pair_metrics(tokens[a].to_numpy(), tokens[b].to_numpy(),
                                                       seq=seq_id, rollout=tokens["rollout"].to_numpy())
    return summary


def metrics_by(table: pd.DataFrame, pairs: list[tuple[str, str]], by: str | Sequence[str], *,
               trainable_only: bool = True) -> pd.DataFrame:
    """Long-format breakdown: columns `pair` ("A/B"), the `by` keys, then PAIR_METRICS.

    One row per (pair, group); e.g. by="rollout", by="turn" or by="role" for the report.
    """
    tokens = _trainable(table, trainable_only)
    frames = []
    for pair in pairs:
        a, b = _pair_columns(tokens, pair)
        frame = grouped_pair_metrics(tokens, a, b, by=by)
        frame.insert(0, "pair", f"{pair[0]}/{pair[1]}")
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["pair", *_as_list(by), *PAIR_METRICS])
    return pd.concat(frames, ignore_index=True)
