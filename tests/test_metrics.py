"""Pair metrics against plain-Python formulas, their identities, and grouped == per-group."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch.errors import MismatchError
from mismatch.analysis.metrics import PAIR_METRICS, grouped_pair_metrics, metrics_by, pair_metrics, summarize_pairs

CONTRACT_NAMES = """n_tokens n_rollouts log_ratio_mean log_ratio_abs_mean log_ratio_abs_max
ratio_mean ratio_std ratio_min ratio_max ratio_q001 ratio_q01 ratio_q99 ratio_q999 kl_k1 kl_k2 kl_k3
chi2_token chi2_seq ppl_ratio ess prob_abs_diff_mean prob_abs_diff_max frac_outside_2
bitwise_equal_frac""".split()


def quantile(values: list[float], q: float) -> float:
    """numpy's default ('linear') quantile, written out."""
    ordered = sorted(values)
    h = q * (len(ordered) - 1)
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def reference(logp_a: list[float], logp_b: list[float], seq: list, rollout: list) -> dict[str, float]:
    """The contract's formulas in plain Python, one line each."""
    keep = [i for i in range(len(logp_a)) if not (math.isnan(logp_a[i]) or math.isnan(logp_b[i]))]
    a = [logp_a[i] for i in keep]
    b = [logp_b[i] for i in keep]
    n = len(a)
    lr = [x - y for x, y in zip(a, b)]
    r = [math.exp(x) for x in lr]
    mean = lambda xs: math.fsum(xs) / len(xs)  # noqa: E731
    seq_lr: dict = {}
    for i, x in zip(keep, lr):
        seq_lr.setdefault(seq[i], []).append(x)
    r_mean = mean(r)
    return {
        "n_tokens": n,
        "n_rollouts": len({rollout[i] for i in keep}),
        "log_ratio_mean": mean(lr),
        "log_ratio_abs_mean": mean([abs(x) for x in lr]),
        "log_ratio_abs_max": max(abs(x) for x in lr),
        "ratio_mean": r_mean,
        "ratio_std": math.sqrt(mean([(x - r_mean) ** 2 for x in r])),
        "ratio_min": min(r),
        "ratio_max": max(r),
        "ratio_q001": quantile(r, 0.001),
        "ratio_q01": quantile(r, 0.01),
        "ratio_q99": quantile(r, 0.99),
        "ratio_q999": quantile(r, 0.999),
        "kl_k1": mean([y - x for x, y in zip(a, b)]),
        "kl_k2": mean([x * x for x in lr]) / 2,
        "kl_k3": mean([x - 1 - math.log(x) for x in r]),
        "chi2_token": mean([x * x for x in r]) - 1,
        "chi2_seq": mean([math.exp(math.fsum(v)) ** 2 for v in seq_lr.values()]) - 1,
        "ppl_ratio": mean([math.exp(mean([-y for y in v])) for v in seq_lr.values()]),
        "ess": math.fsum(r) ** 2 / (n * math.fsum(x * x for x in r)),
        "prob_abs_diff_mean": mean([abs(math.exp(x) - math.exp(y)) for x, y in zip(a, b)]),
        "prob_abs_diff_max": max(abs(math.exp(x) - math.exp(y)) for x, y in zip(a, b)),
        "frac_outside_2": sum(1 for x in r if x > 2 or x < 0.5) / n,
        "bitwise_equal_frac": sum(1 for x, y in zip(a, b) if x == y) / n,
    }


# Two rollouts, three sequences; log-ratios 0, +0.1, -0.5, +0.9, -0.8, 0: both tails of
# frac_outside_2 (exp(0.9) > 2, exp(-0.8) < 0.5), two exact ties, one NaN row.
LOGP_A = [-0.1, -1.0, -2.0, -0.3, -3.0, -0.7, -0.2]
LOGP_B = [-0.1, -1.1, -1.5, -1.2, -2.2, -0.7, float("nan")]
SEQ = ["r0/main", "r0/main", "r0/sub", "r0/sub", "r1/main", "r1/main", "r1/main"]
ROLLOUT = ["r0", "r0", "r0", "r0", "r1", "r1", "r1"]


def test_names_are_the_contract_names_in_order():
    assert PAIR_METRICS == tuple(CONTRACT_NAMES)


def test_every_metric_matches_its_formula():
    got = pair_metrics(np.array(LOGP_A), np.array(LOGP_B), seq=np.array(SEQ), rollout=np.array(ROLLOUT))
    want = reference(LOGP_A, LOGP_B, SEQ, ROLLOUT)
    assert list(got) == list(PAIR_METRICS)
    for name in PAIR_METRICS:
        assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-15), name
    # A few written out by hand, so the reference itself is checked.
    assert got["n_tokens"] == 6 and got["n_rollouts"] == 2
    assert got["frac_outside_2"] == pytest.approx(2 / 6)
    assert got["bitwise_equal_frac"] == pytest.approx(2 / 6)
    assert got["log_ratio_abs_max"] == pytest.approx(0.9)
    # Sequences: r0/main {0, 0.1}, r0/sub {-0.5, 0.9}, r1/main {-0.8, 0}.
    assert got["ppl_ratio"] == pytest.approx((math.exp(-0.05) + math.exp(-0.2) + math.exp(0.4)) / 3)
    assert got["chi2_seq"] == pytest.approx((math.exp(0.2) + math.exp(0.8) + math.exp(-1.6)) / 3 - 1)


def test_values_are_python_numbers():
    got = pair_metrics(np.array(LOGP_A), np.array(LOGP_B), seq=np.array(SEQ), rollout=np.array(ROLLOUT))
    assert all(type(got[name]) is int for name in ("n_tokens", "n_rollouts"))
    assert all(type(got[name]) is float for name in PAIR_METRICS[2:])


def test_ppl_ratio_averages_per_sequence_like_verl():
    # One long sequence at log-ratio 0 and one short at -1: per-sequence mean is
    # (1 + e) / 2; pooling all tokens would give exp(1/11) instead.
    logp_a = np.array([-1.0] * 10 + [-2.0])
    logp_b = np.array([-1.0] * 10 + [-1.0])
    seq = np.array([0] * 10 + [1])
    got = pair_metrics(logp_a, logp_b, seq=seq, rollout=seq)
    assert got["ppl_ratio"] == pytest.approx((1 + math.e) / 2, rel=1e-14)


def test_zero_log_ratio_gives_exact_identities():
    logp = np.array([-0.25, -3.5, -1e-9, -17.0])
    got = pair_metrics(logp, logp.copy(), seq=np.array([0, 0, 1, 1]), rollout=np.array([0, 0, 0, 0]))
    assert got["ratio_mean"] == 1.0 and got["ratio_std"] == 0.0
    assert got["ratio_min"] == got["ratio_max"] == got["ratio_q001"] == got["ratio_q999"] == 1.0
    for name in ("kl_k1", "kl_k2", "kl_k3", "chi2_token", "chi2_seq", "log_ratio_mean",
                 "prob_abs_diff_max", "frac_outside_2"):
        assert got[name] == 0.0 and math.copysign(1, got[name]) == 1, name
    assert got["ess"] == 1.0 and got["ppl_ratio"] == 1.0 and got["bitwise_equal_frac"] == 1.0


logps = st.lists(st.floats(-40.0, 0.0), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_divergences_nonnegative_and_ess_in_unit_interval(data):
    logp_a = data.draw(logps)
    logp_b = data.draw(st.lists(st.floats(-40.0, 0.0), min_size=len(logp_a), max_size=len(logp_a)))
    seq = np.arange(len(logp_a)) // 3
    got = pair_metrics(np.array(logp_a), np.array(logp_b), seq=seq, rollout=seq)
    assert got["kl_k3"] >= 0.0
    assert got["kl_k2"] >= 0.0
    assert 0.0 < got["ess"] <= 1.0 + 1e-12
    assert got["chi2_token"] >= -1.0


def test_nan_rows_are_dropped_before_anything():
    a = np.array([-1.0, np.nan, -0.5, -2.0, -0.1])
    b = np.array([-1.2, -0.3, np.nan, -2.5, -0.1])
    seq = np.array([0, 0, 1, 2, 2])
    rollout = np.array(["x", "x", "y", "z", "z"])  # rollout "y" has only a NaN token
    got = pair_metrics(a, b, seq=seq, rollout=rollout)
    keep = [0, 3, 4]
    assert got == pair_metrics(a[keep], b[keep], seq=seq[keep], rollout=rollout[keep])
    assert got["n_tokens"] == 3 and got["n_rollouts"] == 2
    # Sequence 1 (all NaN) does not enter chi2_seq as an empty sequence with weight 1.
    assert got["chi2_seq"] == pytest.approx((math.exp(0.4) + math.exp(1.0)) / 2 - 1)


@pytest.mark.parametrize("n", [0, 3])
def test_no_tokens_gives_zero_counts_and_nan(n):
    nan = np.full(n, np.nan)
    got = pair_metrics(nan, nan, seq=np.zeros(n), rollout=np.zeros(n))
    assert got["n_tokens"] == 0 and got["n_rollouts"] == 0
    assert all(math.isnan(got[name]) for name in PAIR_METRICS[2:])


def test_float32_is_upcast_before_arithmetic():
    # In float32 these log-ratios (~1e-4) keep only ~3 digits; in float64 all of them.
    logp_a = np.array([-1.0001, -2.00003, -0.50007], dtype=np.float32)
    logp_b = np.array([-1.0, -2.0, -0.5], dtype=np.float32)
    seq = np.array([0, 0, 1])
    got = pair_metrics(logp_a, logp_b, seq=seq, rollout=seq)
    want = reference([float(x) for x in logp_a], [float(x) for x in logp_b], list(seq), list(seq))
    for name in ("log_ratio_mean", "kl_k2", "kl_k3", "chi2_token", "ratio_std"):
        assert got[name] == pytest.approx(want[name], rel=1e-12), name


def test_overflow_is_reported_not_clamped():
    # A -9999 placeholder log-prob: the ratio is inf, and the report says so.
    logp_a = np.array([-0.5, -0.5, -0.5, -0.5])
    logp_b = np.array([-9999.0, -0.5, -0.5, -0.5])
    seq = np.array([0, 0, 1, 1])
    got = pair_metrics(logp_a, logp_b, seq=seq, rollout=seq)
    assert got["ratio_max"] == math.inf and got["chi2_token"] == math.inf and got["chi2_seq"] == math.inf
    # ESS is computed scale-free: one token carries all the weight.
    assert got["ess"] == pytest.approx(1 / 4)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="1-D arrays of one length"):
        pair_metrics(np.zeros(3), np.zeros(2), seq=np.zeros(3), rollout=np.zeros(3))


def token_table(num_rollouts: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n = num_rollouts * 40
    table = pd.DataFrame({
        "rollout": rng.choice([f"r{i}" for i in range(num_rollouts)], n),
        "branch": rng.choice(["main", "sub-1"], n),
        "turn": rng.integers(0, 4, n),
        "role": rng.choice(["assistant", "tool", "user"], n),
        "trainable": rng.random(n) < 0.7,
        "logp_sampler": rng.normal(-1.5, 1.0, n).clip(max=0.0),
    })
    table["logp_train"] = table["logp_sampler"] + rng.normal(0, 0.05, n)
    table.loc[rng.random(n) < 0.2, "logp_train"] = table["logp_sampler"]  # exact ties
    table.loc[rng.random(n) < 0.05, "logp_sampler"] = np.nan
    # A group whose tokens are all NaN still gets a row.
    table.loc[table["turn"] == 3, "logp_train"] = np.nan
    return table


@pytest.mark.parametrize("by", ["turn", "rollout", ["rollout", "branch"], "role", ["role", "turn"]])
def test_grouped_equals_pair_metrics_per_group(by):
    table = token_table(12, seed=1)
    grouped = grouped_pair_metrics(table, "logp_train", "logp_sampler", by=by)
    by_cols = [by] if isinstance(by, str) else by
    assert list(grouped.columns) == [*by_cols, *PAIR_METRICS]
    assert len(grouped) == len(table.groupby(by_cols))
    seq_key = (table["rollout"] + "/" + table["branch"]).to_numpy()
    for _, row in grouped.iterrows():
        rows = np.logical_and.reduce([table[c].to_numpy() == row[c] for c in by_cols])
        want = pair_metrics(table["logp_train"].to_numpy()[rows], table["logp_sampler"].to_numpy()[rows],
                            seq=seq_key[rows], rollout=table["rollout"].to_numpy()[rows])
        for name in PAIR_METRICS:
            if name in ("n_tokens", "n_rollouts", "ratio_min", "ratio_max", "log_ratio_abs_max",
                        "prob_abs_diff_max", "bitwise_equal_frac", "frac_outside_2"):
                np.testing.assert_array_equal(row[name], want[name], err_msg=name)
            else:
                np.testing.assert_allclose(row[name], want[name], rtol=1e-12, atol=0, err_msg=name)
    empty = grouped[grouped["n_tokens"] == 0]
    if "turn" in by_cols:
        assert len(empty) > 0 and empty[list(PAIR_METRICS[2:])].isna().all().all()


def test_grouped_over_a_million_tokens():
    rng = np.random.default_rng(0)
    n = 1_000_000
    logp_sampler = rng.normal(-1.0, 0.5, n)
    table = pd.DataFrame({
        "rollout": rng.integers(0, 10_000, n),
        "branch": rng.integers(0, 2, n),
        "logp_sampler": logp_sampler,
        "logp_train": logp_sampler + rng.normal(0, 0.01, n),
    })
    grouped = grouped_pair_metrics(table, "logp_train", "logp_sampler", by="rollout")
    assert grouped.shape == (10_000, 1 + len(PAIR_METRICS))
    assert grouped["n_tokens"].sum() == n and (grouped["n_rollouts"] == 1).all()


def test_summarize_pairs_counts_only_trainable_tokens():
    table = token_table(6, seed=2)
    # Wild values on non-trainable tokens: any leak would move every metric.
    table.loc[~table["trainable"], "logp_train"] = -50.0
    summary = summarize_pairs(table, [("train", "sampler")])
    assert list(summary) == ["train/sampler"]
    tokens = table[table["trainable"]]
    seq = (tokens["rollout"] + "/" + tokens["branch"]).to_numpy()
    want = pair_metrics(tokens["logp_train"].to_numpy(), tokens["logp_sampler"].to_numpy(),
                        seq=seq, rollout=tokens["rollout"].to_numpy())
    assert summary["train/sampler"] == pytest.approx(want, rel=1e-12)
    assert summary["train/sampler"]["log_ratio_abs_max"] < 10
    everything = summarize_pairs(table, [("train", "sampler")], trainable_only=False)["train/sampler"]
    valid = table["logp_train"].notna() & table["logp_sampler"].notna()
    assert everything["n_tokens"] == int(valid.sum()) > summary["train/sampler"]["n_tokens"]


def test_summarize_pairs_names_a_missing_column():
    table = token_table(2, seed=3)
    with pytest.raises(MismatchError, match=r"pair train/infer: token table has no column 'logp_infer' "
                                            r"\(log-prob columns: logp_sampler, logp_train\)"):
        summarize_pairs(table, [("train", "infer")])


def test_metrics_by_is_long_format_per_pair():
    table = token_table(4, seed=4)
    table["logp_infer"] = table["logp_sampler"]
    long = metrics_by(table, [("train", "sampler"), ("infer", "sampler")], "turn")
    assert list(long.columns) == ["pair", "turn", *PAIR_METRICS]
    assert list(long["pair"].unique()) == ["train/sampler", "infer/sampler"]
    infer = long[long["pair"] == "infer/sampler"]
    assert (infer.loc[infer["n_tokens"] > 0, "bitwise_equal_frac"] == 1.0).all()
    trainable = table[table["trainable"]]
    want = grouped_pair_metrics(trainable, "logp_train", "logp_sampler", by="turn")
    got = long[long["pair"] == "train/sampler"].drop(columns="pair").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want)


def test_both_minus_inf_is_an_undefined_log_ratio_and_dropped():
    # Both engines give the token probability 0: the ratio is 0/0, not a measurement.
    a, b = np.array([-1.0, -np.inf, -0.5, -np.inf]), np.array([-1.2, -np.inf, -0.5, -3.0])
    seq, rollout = np.array([0, 0, 1, 1]), np.array([0, 0, 0, 0])
    got = pair_metrics(a, b, seq=seq, rollout=rollout)
    keep = [0, 2, 3]
    assert got["n_tokens"] == 3
    assert got == pair_metrics(a[keep], b[keep], seq=seq[keep], rollout=rollout[keep])
    assert got["ratio_min"] == 0.0  # -inf against a finite log-prob stays: ratio 0


def test_pairs_summarized_together_equal_each_alone():
    # Pairs of one view share its float64 columns; each pair's numbers must not depend on the others.
    table = token_table(6, seed=5)
    table["logp_infer"] = (table["logp_sampler"] + 0.01).astype(np.float32)  # in two pairs, upcast once
    table.loc[::7, "logp_infer"] = np.nan  # a pair with dropped tokens of its own
    pairs = [("train", "sampler"), ("train", "infer"), ("infer", "sampler")]
    together = summarize_pairs(table, pairs)
    for a, b in pairs:
        alone = summarize_pairs(table, [(a, b)])[f"{a}/{b}"]
        assert np.array_equal(list(together[f"{a}/{b}"].values()), list(alone.values()), equal_nan=True), (a, b)
