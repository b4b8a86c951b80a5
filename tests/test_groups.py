"""Key spans and grouped reductions: quantiles as numpy's, and every analysis independent of row order."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from conftest import PAIRS, agentic_frame

from mismatch.advise.corrections import simulate, summary_corrections
from mismatch.results.summary_model import to_builtins
from mismatch.analysis.groups import Grouping, find_spans, quantiles, single_group
from mismatch.analysis.metrics import PAIR_METRICS, metrics_by, summarize_pairs
from mismatch.analysis.tokenview import TokenView
from mismatch.localize.turns import localize_turns

QS = [0.0, 0.01, 0.5, 0.99, 0.999, 1.0]


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_quantiles_equal_numpy_linear(n):
    rng = np.random.default_rng(n)
    values = np.exp(rng.normal(0, 0.3, n))
    spans = find_spans([np.arange(n) // 3], n)  # runs of three tokens, each in a random group of 4
    grouping = Grouping(span_group=rng.integers(0, 4, spans.num_spans), num_groups=4, keys=pd.DataFrame())
    group = spans.spread(grouping.span_group)
    got = quantiles(values, spans, grouping, QS, scratch=np.empty(n))
    for g in range(4):
        if (group == g).any():
            np.testing.assert_array_equal(got[g], np.quantile(values[group == g], QS))
        else:
            assert np.isnan(got[g]).all()
    np.testing.assert_array_equal(quantiles(values, spans, single_group(spans), QS)[0], np.quantile(values, QS))


def test_quantiles_of_large_groups_equal_numpy():
    rng = np.random.default_rng(11)
    n = 400_000
    values = np.exp(rng.standard_t(3, n) * 0.05)
    values[::1000] = 1.0  # ties
    spans = find_spans([np.arange(n) // 50], n)
    span_group = np.minimum(np.arange(spans.num_spans) // 2000, 3)  # groups of 100k tokens each
    grouping = Grouping(span_group=span_group, num_groups=5, keys=pd.DataFrame())  # group 4 is empty
    qs = [0.001, 0.01, 0.99, 0.999]
    got = quantiles(values, spans, grouping, qs)
    token_group = spans.spread(span_group)
    for g in range(4):
        np.testing.assert_array_equal(got[g], np.quantile(values[token_group == g], qs))
    assert np.isnan(got[4]).all()


def test_quantiles_of_equal_infinite_ends_are_inf_not_nan():
    values = np.array([1.0, np.inf, np.inf])
    spans = find_spans([], 3)
    assert quantiles(values, spans, single_group(spans), [0.9])[0, 0] == np.inf


def test_runs_cut_where_any_key_changes():
    spans = find_spans([np.array([0, 0, 0, 1, 1, 1]), np.array([5, 5, 6, 6, 6, 6])], 6)
    assert spans.starts.tolist() == [0, 2, 3] and spans.lengths.tolist() == [2, 1, 3]
    assert spans.sum(np.arange(6.0)).tolist() == [1.0, 2.0, 12.0]


def agentic_table(seed: int = 0) -> pd.DataFrame:
    """A token table in audit order: rollouts, branches, turns; user prompts not trainable."""
    rng = np.random.default_rng(seed)
    table = agentic_frame(rng, rollouts=30, subagent_every=3, answer_max=20)
    n = len(table)
    logp = -rng.exponential(1.0, n)
    table["logp_sampler"] = np.where(table["trainable"], logp, np.nan)
    table["logp_train"] = logp + rng.normal(0, 0.02, n)
    table["logp_infer"] = np.where(rng.random(n) < 0.5, logp, logp + rng.normal(0, 0.005, n))
    table.loc[rng.random(n) < 0.02, "logp_infer"] = np.nan  # a pair with its own dropped tokens
    return table


EXACT = {"n_tokens", "n_rollouts", "ratio_min", "ratio_max", "log_ratio_abs_max", "prob_abs_diff_max",
         "bitwise_equal_frac", "frac_outside_2", "ratio_q001", "ratio_q01", "ratio_q99", "ratio_q999"}


def assert_metrics_close(got: dict, want: dict) -> None:
    for name in PAIR_METRICS:
        if name in EXACT:
            assert got[name] == want[name], name
        else:
            assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-15), name


def test_shuffled_rows_give_the_same_analysis():
    # Sorted rows make long runs, shuffled ones runs of about one token: the numbers must not care.
    table = agentic_table()
    shuffled = table.sample(frac=1.0, random_state=1).reset_index(drop=True)
    ordered, mixed = TokenView(table), TokenView(shuffled)
    assert ordered.spans.num_spans < ordered.num_tokens / 4 and mixed.spans.num_spans > mixed.num_tokens / 2
    for pair, metrics in summarize_pairs(ordered, PAIRS).items():
        assert_metrics_close(summarize_pairs(mixed, PAIRS)[pair], metrics)
    by_turn, by_turn_mixed = metrics_by(ordered, PAIRS, "turn"), metrics_by(mixed, PAIRS, "turn")
    for (_, row), (_, other) in zip(by_turn.iterrows(), by_turn_mixed.iterrows()):
        assert (row["pair"], row["turn"]) == (other["pair"], other["turn"])
        assert_metrics_close(other.to_dict(), row.to_dict())
    located, located_mixed = localize_turns(table), localize_turns(shuffled)
    assert located["onset_turn"] == located_mixed["onset_turn"]
    for row, other in zip(located["by_turn"] + located["by_prob_bucket"],
                          located_mixed["by_turn"] + located_mixed["by_prob_bucket"]):
        assert row.keys() == other.keys()
        for key, value in row.items():
            assert other[key] == (pytest.approx(value, rel=1e-9) if isinstance(value, float) else value), key
    assert located["position_slope"]["slope_per_1k"] == pytest.approx(
        located_mixed["position_slope"]["slope_per_1k"], rel=1e-9)
    for result, other in zip(summary_corrections(table), summary_corrections(shuffled)):
        assert result.mode == other.mode and result.frac_tokens_affected == other.frac_tokens_affected
        assert result.weight_mean == pytest.approx(other.weight_mean, rel=1e-12), result.mode
        assert result.ess == pytest.approx(other.ess, rel=1e-12), result.mode


def test_corrections_on_a_view_equal_corrections_on_arrays():
    table = agentic_table(seed=2)
    from_view = [to_builtins(c) for c in summary_corrections(table)]
    seq = (table["rollout"].astype(str) + "/" + table["branch"].astype(str)).to_numpy()
    from_arrays = simulate((table["logp_train"] - table["logp_sampler"]).to_numpy(), seq=seq,
                           rollout=table["rollout"].astype(str).to_numpy(), turn=table["turn"].to_numpy(),
                           trainable=table["trainable"].to_numpy(), logp_sampler=table["logp_sampler"].to_numpy())
    assert [r["mode"] for r in from_view] == [r.mode for r in from_arrays]
    for result, other in zip(from_view, (to_builtins(r.to_record()) for r in from_arrays)):
        assert result.keys() == other.keys()
        for key in ("n_tokens", "n_sequences", "n_rollouts", "frac_tokens_affected", "frac_sequences_affected",
                    "frac_rollouts_affected", "weight_max"):
            assert result[key] == other[key], (result["mode"], key)
        for key in ("weight_mean", "weight_std", "ess"):
            assert result[key] == pytest.approx(other[key], rel=1e-12), (result["mode"], key)
        assert [row["n_tokens"] for row in result["by_turn"]] == [row["n_tokens"] for row in other["by_turn"]]


@pytest.mark.parametrize("shape", ["normal", "ties", "heavy_tail", "constant"])
def test_order_statistics_are_exact(shape):
    from mismatch.analysis.groups import order_statistics

    rng = np.random.default_rng(7)
    n = 200_003
    values = {"normal": rng.normal(size=n), "ties": rng.integers(0, 5, n).astype(float),
              "heavy_tail": np.exp(rng.standard_cauchy(n)), "constant": np.ones(n)}[shape]
    values[17] = np.inf
    ranks = np.array([0, 1, 2000, 2001, n - 201, n - 200, n - 2, n - 1])
    np.testing.assert_array_equal(order_statistics(values.copy(), ranks), np.sort(values)[ranks])
    middle = np.array([10, n // 2])  # not all in the tails: the plain partition
    np.testing.assert_array_equal(order_statistics(values.copy(), middle), np.sort(values)[middle])


def test_many_segments_sorted_at_once_give_the_partitioned_quantiles(monkeypatch) -> None:
    """segment_quantiles sorts all segments at once above _SORT_SEGMENTS of them (per rollout):
    the same numbers as a partition per segment, NaN, inf, ties and empty segments included."""
    from mismatch.analysis import groups

    rng = np.random.default_rng(0)
    qs = [0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0]
    for trial in range(100):
        counts = rng.integers(0, 30, rng.integers(1, 80))
        values = rng.normal(size=int(counts.sum()))
        if len(values) and trial % 3 == 0:
            values[rng.integers(0, len(values), 3)] = np.nan
        if len(values) and trial % 5 == 0:
            values[rng.integers(0, len(values), 3)] = np.inf
        if trial % 7 == 0:
            values = np.round(values)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        monkeypatch.setattr(groups, "_SORT_SEGMENTS", 0)
        at_once = groups.segment_quantiles(values.copy(), bounds, qs)
        monkeypatch.setattr(groups, "_SORT_SEGMENTS", 10**9)
        one_by_one = groups.segment_quantiles(values.copy(), bounds, qs)
        np.testing.assert_array_equal(at_once, one_by_one)
