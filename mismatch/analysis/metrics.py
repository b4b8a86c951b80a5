"""Pair metrics: how far two engines' per-token log-probs are apart, per token and per sequence.

Flow: token table (`logp_*` columns, one row per replayed token) -> pair_tokens -> span_sums (per
span, per group) -> metrics (PAIR_METRICS, the formulas) -> localize / recommend / report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pandas as pd

from mismatch.analysis.groups import Grouping, Spans, quantiles, single_group
from mismatch.analysis.pair_tokens import PairTokens, pair_tokens, pairs_tokens
from mismatch.analysis.span_sums import GroupTotals, SpanSums, pair_span_sums, token_terms
from mismatch.analysis.tokenview import DEFAULT_SEQ, TokenView
from mismatch.errors import MismatchError

# Contract names and order of `summary.json["pairs"]["A/B"]` (ARCHITECTURE.md, "Results dir").
PAIR_METRICS: tuple[str, ...] = (
    "n_tokens", "n_rollouts",
    "log_ratio_mean", "log_ratio_abs_mean", "log_ratio_abs_max",
    "ratio_mean", "ratio_std", "ratio_min", "ratio_max", "ratio_q001", "ratio_q01", "ratio_q99", "ratio_q999",
    "kl_k1", "kl_k2", "kl_k3", "chi2_token", "chi2_seq", "ppl_ratio", "ess",
    "prob_abs_diff_mean", "prob_abs_diff_max", "frac_outside_2", "bitwise_equal_frac",
)
_COUNTS = ("n_tokens", "n_rollouts")
# ratio_qXYZ is the 0.XYZ quantile: both tails at 1% and at 0.1% (the tails are what PPO feels).
RATIO_QUANTILES = {"ratio_q001": 0.001, "ratio_q01": 0.01, "ratio_q99": 0.99, "ratio_q999": 0.999}


class TokenPass(Protocol):
    """The two things a group's metrics need from its tokens, not only from span sums."""

    def quantiles(self, grouping: Grouping) -> np.ndarray:
        """[num_groups, len(RATIO_QUANTILES)] ratio quantiles."""
        ...

    def far_weights(self, grouping: Grouping, far: np.ndarray, lr_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per group where `far`: sums of w and w^2, w = exp(log_ratio - lr_max of the group)."""
        ...


class _PairTokenPass:
    """TokenPass over a pair's tokens in memory."""

    def __init__(self, pair: PairTokens, spans: Spans) -> None:
        self.pair, self.spans = pair, spans

    def quantiles(self, grouping: Grouping) -> np.ndarray:
        qs, view = list(RATIO_QUANTILES.values()), self.pair.view
        return quantiles(self.pair.ratio_into(view.scratch(1)), self.spans, grouping, qs, scratch=view.scratch(0))

    def far_weights(self, grouping: Grouping, far: np.ndarray, lr_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        token_group = self.spans.spread(grouping.span_group)
        picked = far[token_group]
        group = token_group[picked]
        weight = np.exp(self.pair.log_ratio[picked] - lr_max[group])
        return (np.bincount(group, weights=weight, minlength=grouping.num_groups),
                np.bincount(group, weights=np.square(weight), minlength=grouping.num_groups))


def _group_metrics(pair: PairTokens, spans: Spans, grouping: Grouping, *, with_quantiles: bool = True) -> pd.DataFrame:
    """PAIR_METRICS for groups 0..G-1 of the pair's spans, one row per group (group_metrics on
    the pair's tokens in memory)."""
    return group_metrics(pair_span_sums(pair, spans), grouping, _PairTokenPass(pair, spans),
                         with_quantiles=with_quantiles)


def group_metrics(data: SpanSums, grouping: Grouping, tokens: TokenPass, *,
                  with_quantiles: bool = True) -> pd.DataFrame:
    """PAIR_METRICS for groups 0..G-1 of the spans, one row per group (totals_metrics of their totals)."""
    totals = GroupTotals.of(data, grouping)
    far = totals.far()
    far_sums = tokens.far_weights(grouping, far, totals.values["log_ratio_max"]) if far.any() else None
    return totals_metrics(totals, far_sums, tokens.quantiles(grouping) if with_quantiles else None)


def totals_metrics(totals: GroupTotals, far_sums: tuple[np.ndarray, np.ndarray] | None,
                   quantile_table: np.ndarray | None) -> pd.DataFrame:
    """PAIR_METRICS from group totals (and the far groups' ESS sums, and the ratio quantiles when
    asked): the single implementation behind `pair_metrics` (one group), every breakdown and the
    chunked analysis, so they can never drift apart. Empty groups keep a row: zero counts, NaN metrics.

    chi2_seq and ppl_ratio average over sequences: no clamp (verl clamps the sum at +-20), so a
    sequence weight that overflows float64 makes chi2_seq inf; ppl_ratio is verl's
    rollout_corr/ppl_ratio, each sequence's PPL_A / PPL_B = exp(-mean log_ratio), then the mean.
    """
    v = totals.values
    n = v["n"].astype(np.int64)
    out: dict[str, np.ndarray] = {"n_tokens": n, "n_rollouts": v["n_rollouts"].astype(np.int64)}
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        log_ratio_mean = v["log_ratio"] / n
        lr_min, lr_max = v["log_ratio_min"], v["log_ratio_max"]
        ess = np.square(v["ratio"]) / (n * v["ratio_sq"])
        if far_sums is not None:
            # Scale-free: far-out groups use exp(log_ratio - group max), so a single huge ratio (a
            # -9999 placeholder log-prob) gives ESS ~ 1/n instead of inf/inf.
            ess = np.where(totals.far(), np.square(far_sums[0]) / (n * far_sums[1]), ess)
        out.update({
            "log_ratio_mean": log_ratio_mean,
            "log_ratio_abs_mean": v["abs_log_ratio"] / n,
            "log_ratio_abs_max": v["log_ratio_abs_max"],
            "ratio_mean": v["ratio"] / n,
            "ratio_std": np.sqrt(v["ratio_m2"] / n),  # population std (ddof=0)
            # exp is monotonic, so exp(max log_ratio) is max(ratio) bit for bit.
            "ratio_min": np.exp(lr_min),
            "ratio_max": np.exp(lr_max),
            # Each k1 term logp_b - logp_a is exactly -(logp_a - logp_b); 0.0 - x turns -0.0 into +0.0.
            "kl_k1": 0.0 - log_ratio_mean,
            # Halving is exact in binary floating point, so mean(x^2) / 2 == mean(x^2 / 2).
            "kl_k2": v["log_ratio_sq"] / n / 2.0,
            "kl_k3": v["k3"] / n,
            "chi2_token": v["ratio_sq"] / n - 1.0,
            "chi2_seq": v["seq_weight"] / v["num_seqs"] - 1.0,
            "ppl_ratio": v["seq_ppl"] / v["num_seqs"],
            "ess": ess,
            "prob_abs_diff_mean": v["prob_abs_diff"] / n,
            "prob_abs_diff_max": v["prob_abs_diff_max"],
            "frac_outside_2": v["outside_2"] / n,
            "bitwise_equal_frac": v["equal"] / n,
        })
        if quantile_table is not None:
            out.update({name: quantile_table[:, i] for i, name in enumerate(RATIO_QUANTILES)})
    empty = n == 0
    if empty.any():
        out.update({name: np.where(empty, np.nan, values) for name, values in out.items() if name not in _COUNTS})
    # Built from arrays, in PAIR_METRICS order: pandas' masked .loc assignment across the columns
    # took ~8 ms a frame, and the per-rollout table makes one per pair and chunk.
    return pd.DataFrame({name: out[name] for name in PAIR_METRICS if name in out})


def pair_metrics(logp_a: np.ndarray, logp_b: np.ndarray, *, seq: np.ndarray,
                 rollout: np.ndarray) -> dict[str, float]:
    """PAIR_METRICS of A against B over the given tokens, with log_ratio = logp_a - logp_b.

    `seq` and `rollout` are keys aligned with the log-probs: `seq` names each token's
    sequence (one branch of one rollout) for chi2_seq and ppl_ratio, `rollout` its rollout
    for n_rollouts. Tokens where either log-prob is NaN, or both are -inf (the log-ratio is
    undefined), are dropped before anything else.
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
    table = pd.DataFrame({"a": logp_a, "b": logp_b, "seq": np.asarray(seq), "rollout": np.asarray(rollout)})
    view = TokenView(table, trainable_only=False, seq=("seq",), rollout="rollout")
    return _one_group(pair_tokens(view, "a", "b"))


def _one_group(pair: PairTokens) -> dict[str, float]:
    spans = pair.view.spans
    row = _group_metrics(pair, spans, single_group(spans)).iloc[0]
    return {name: int(row[name]) if name in _COUNTS else float(row[name]) for name in PAIR_METRICS}


# The per-token sums (and maxima) `token_group_metrics` reduces: means, extremes and counts, no
# spreads, quantiles or sequence metrics.
_TOKEN_GROUP_SUMS = ("log_ratio", "abs_log_ratio", "k3", "outside_2", "equal")
_TOKEN_GROUP_MAXIMA = ("log_ratio_abs_max", "prob_abs_diff_max")


def token_group_sums(pair: PairTokens, token_group: np.ndarray, num_groups: int) -> dict[str, np.ndarray]:
    """Per group given per token (such as a probability bucket, which changes too often for spans
    to pay off): token and rollout counts, sums and maxima of the terms. Groups of several chunks
    of whole rollouts add up (maxima by np.maximum), rollouts counted in each chunk."""
    token_rollout = pair.view.spans.spread(pair.view.span_rollout)
    num_rollouts = max(pair.view.num_rollouts, 1)
    present = np.bincount(token_group * num_rollouts + token_rollout, minlength=num_groups * num_rollouts)
    out: dict[str, np.ndarray] = {"n_tokens": np.bincount(token_group, minlength=num_groups),
                                  "n_rollouts": (present.reshape(num_groups, -1) > 0).sum(axis=1)}
    with np.errstate(over="ignore", invalid="ignore"):
        for name, values in token_terms(pair, np.empty(len(pair.log_ratio))):
            if name in _TOKEN_GROUP_MAXIMA:
                top = np.full(num_groups, -np.inf)
                np.maximum.at(top, token_group, values)
                out[name] = top
            elif name in _TOKEN_GROUP_SUMS:
                out[name] = np.bincount(token_group, weights=values, minlength=num_groups)
    return out


def token_group_metrics(sums: dict[str, np.ndarray], num_groups: int) -> pd.DataFrame:
    """PAIR_METRICS that token_group_sums gives (one row per group; empty ones NaN but counts)."""
    if not sums:
        sums = {"n_tokens": np.zeros(num_groups, dtype=np.int64), "n_rollouts": np.zeros(num_groups, dtype=np.int64),
                **{name: np.zeros(num_groups) for name in _TOKEN_GROUP_SUMS},
                **{name: np.full(num_groups, -np.inf) for name in _TOKEN_GROUP_MAXIMA}}
    n = sums["n_tokens"]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {"n_tokens": n, "n_rollouts": sums["n_rollouts"],
               "log_ratio_mean": sums["log_ratio"] / n, "log_ratio_abs_mean": sums["abs_log_ratio"] / n,
               "log_ratio_abs_max": sums["log_ratio_abs_max"], "prob_abs_diff_max": sums["prob_abs_diff_max"],
               "kl_k3": sums["k3"] / n, "frac_outside_2": sums["outside_2"] / n,
               "bitwise_equal_frac": sums["equal"] / n}
    frame = pd.DataFrame(out)
    frame.loc[n == 0, [name for name in frame.columns if name not in _COUNTS]] = np.nan
    return frame[[name for name in PAIR_METRICS if name in frame.columns]]


def _as_list(columns: str | Sequence[str]) -> list[str]:
    return [columns] if isinstance(columns, str) else list(columns)


def grouped_view_metrics(view: TokenView, a: str, b: str, by: Sequence[str], *,
                         with_quantiles: bool = True) -> pd.DataFrame:
    """`grouped_pair_metrics` on a view: the `by` columns, then PAIR_METRICS, one row per group.

    Without quantiles the three ratio_p* columns are left out (they are the only per-token sort).
    """
    by = list(by)
    pair = pair_tokens(view, a, b)
    spans, grouping = view.grouping(by)
    if pair.keep is not None:  # the pair's spans lie inside the view's; map them to its groups
        token_group = spans.spread(grouping.span_group)[pair.keep]
        spans = pair.view.spans_for(by)
        grouping = Grouping(span_group=token_group[spans.starts], num_groups=grouping.num_groups,
                            keys=grouping.keys)
    metrics = _group_metrics(pair, spans, grouping, with_quantiles=with_quantiles)
    return pd.concat([grouping.keys.reset_index(drop=True), metrics], axis=1)


def grouped_pair_metrics(table: pd.DataFrame | TokenView, a: str, b: str, *, by: str | Sequence[str],
                         seq: Sequence[str] = DEFAULT_SEQ, rollout: str = "rollout") -> pd.DataFrame:
    """`pair_metrics` of columns `a` against `b` for every group of `by`, in one vectorized pass.

    Returns one row per group (sorted by the keys, including groups whose tokens are all
    NaN), with the `by` columns followed by PAIR_METRICS. A sequence is a distinct `seq`
    tuple within a group, so by="turn" gives each branch's tokens of that turn. A DataFrame
    is taken whole (every row); a TokenView brings its own rows and keys.
    """
    by_cols = _as_list(by)
    if isinstance(table, TokenView):
        view = table
    else:
        missing = [c for c in [a, b, rollout, *by_cols, *seq] if c not in table.columns]
        if missing:
            columns = ", ".join(map(str, table.columns))
            raise MismatchError(f"token table has no column {missing[0]!r} (columns: {columns})")
        view = TokenView(table, trainable_only=False, seq=seq, rollout=rollout)
    return grouped_view_metrics(view, a, b, by_cols)


def _pair_columns(view: TokenView, pair: tuple[str, str]) -> tuple[str, str]:
    a, b = f"logp_{pair[0]}", f"logp_{pair[1]}"
    for column in (a, b):
        if not view.has(column):
            have = sorted(str(c) for c in view.columns if str(c).startswith("logp_"))
            raise MismatchError(f"pair {pair[0]}/{pair[1]}: token table has no column {column!r} "
                                f"(log-prob columns: {', '.join(have) or 'none'})")
    return a, b


def summarize_pairs(table: pd.DataFrame | TokenView, pairs: list[tuple[str, str]], *,
                    trainable_only: bool = True) -> dict[str, dict[str, float]]:
    """`summary.json["pairs"]`: {"A/B": pair_metrics of logp_A against logp_B} for each pair.

    A sequence is one branch of one rollout; only `trainable` tokens count unless
    trainable_only=False.
    """
    view = TokenView.of(table, trainable_only=trainable_only)
    columns = [_pair_columns(view, pair) for pair in pairs]
    return {f"{pair[0]}/{pair[1]}": _one_group(tokens)
            for pair, tokens in zip(pairs, pairs_tokens(view, columns))}


def metrics_by(table: pd.DataFrame | TokenView, pairs: list[tuple[str, str]], by: str | Sequence[str], *,
               trainable_only: bool = True) -> pd.DataFrame:
    """Long-format breakdown: columns `pair` ("A/B"), the `by` keys, then PAIR_METRICS.

    One row per (pair, group); e.g. by="rollout", by="turn" or by="role" for the report.
    """
    view = TokenView.of(table, trainable_only=trainable_only)
    by_cols = _as_list(by)
    missing = [c for c in by_cols if not view.has(c)]
    if missing:
        raise MismatchError(f"token table has no column {missing[0]!r} (columns: {', '.join(map(str, view.columns))})")
    frames = []
    for pair in pairs:
        a, b = _pair_columns(view, pair)
        frame = grouped_view_metrics(view, a, b, by_cols)
        frame.insert(0, "pair", f"{pair[0]}/{pair[1]}")
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["pair", *by_cols, *PAIR_METRICS])
    return pd.concat(frames, ignore_index=True)
