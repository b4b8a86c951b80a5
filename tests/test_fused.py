"""The fused (numba) loops against the numpy reference paths: same analysis, switched by MISMATCH_NO_JIT."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from conftest import PAIRS, agentic_frame

from mismatch import fused
from mismatch.corrections import MODES, Correction, simulate, summary_corrections
from mismatch.localize.turns import localize_turns
from mismatch.metrics import PAIR_METRICS, metrics_by, summarize_pairs
from mismatch.tokenview import TokenView

pytestmark = pytest.mark.skipif(not fused.available(), reason="numba is not installed")

def table(seed: int = 0) -> pd.DataFrame:
    """Agentic token table with wide log-prob tails, ties, a placeholder log-prob and dropped tokens."""
    rng = np.random.default_rng(seed)
    frame = agentic_frame(rng, rollouts=25, subagent_every=4, answer_max=25)
    n = len(frame)
    logp = -rng.exponential(1.5, n)
    frame["logp_sampler"] = np.where(frame["trainable"], logp, np.nan)
    frame["logp_train"] = logp + rng.normal(0, 0.3, n) * rng.random(n)
    frame["logp_infer"] = np.where(rng.random(n) < 0.5, logp, logp + rng.normal(0, 0.01, n))
    frame.loc[rng.random(n) < 0.03, "logp_infer"] = np.nan
    frame.loc[frame.index[frame["trainable"]][7], "logp_sampler"] = -9999.0  # a placeholder: ratio inf
    return frame


def close(got, want, name: str) -> None:
    if isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), name
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), name
    else:
        assert got == want, name


def analysis(frame: pd.DataFrame) -> dict:
    view = TokenView(frame)
    return {"pairs": summarize_pairs(view, PAIRS),
            "turns": metrics_by(view, PAIRS, "turn").to_dict("records"),
            "roles": metrics_by(TokenView.of(view, trainable_only=False), PAIRS, "role").to_dict("records"),
            "localization": localize_turns(view),
            "corrections": summary_corrections(view)}


def assert_same(got, want, path: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        close(got, want, path)


def test_fused_analysis_equals_numpy_reference(monkeypatch):
    frame = table()
    fast = analysis(frame)
    monkeypatch.setenv("MISMATCH_NO_JIT", "1")
    assert not fused.available()
    slow = analysis(frame)
    assert_same(fast, slow)
    # The placeholder really is in there: an infinite ratio, reported as such by both paths.
    assert fast["pairs"]["train/sampler"]["ratio_max"] == math.inf
    assert set(fast["pairs"]["train/sampler"]) == set(PAIR_METRICS)


STAT_HIGH = {"rs_token_k2": {"high": 0.05}, "rs_token_k3": {"high": 0.05}, "rs_seq_sum_k2": {"high": 0.8},
             "rs_seq_sum_k3": {"high": 0.8}, "rs_seq_mean_k2": {"high": 0.08}, "rs_seq_mean_k3": {"high": 0.08},
             "rs_seq_max_k2": {"high": 0.3}, "rs_seq_max_k3": {"high": 0.3}, "rs_seq_sum_k1": {"low": 0.5, "high": 2.0},
             "geometric_icepop": {"low": 0.9, "high": 1.1}, "seq_mask_tis": {"low": 0.9, "high": 1.1},
             "geometric_truncate": {"cap": 1.05}, "rollout_clip": {"low": 0.5, "high": 2.0}}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_equal_fused_and_numpy(mode, monkeypatch):
    rng = np.random.default_rng(3)
    n = 400
    log_ratio = rng.normal(0, 0.4, n)
    log_ratio[5] = 30.0  # a huge ratio: ESS and the caps must handle it the same way
    seq = np.repeat(np.arange(40), 10)
    rollout = seq // 4
    turn = np.tile(np.repeat(np.arange(2), 5), 40)
    params = {name: {"cap": 1.5, "low": 0.7, "high": 1.5}[name] for name in MODES[mode].params}
    # Thresholds of verl's rejection statistics where some sequences pass and some do not.
    params.update(STAT_HIGH.get(mode, {}))
    correction = [Correction(mode=mode, params=params)]
    [fast] = simulate(log_ratio, correction, seq=seq, rollout=rollout, turn=turn)
    monkeypatch.setenv("MISMATCH_NO_JIT", "1")
    [slow] = simulate(log_ratio, correction, seq=seq, rollout=rollout, turn=turn)
    assert_same(fast.to_dict(), slow.to_dict())
    assert 0.0 < fast.frac_tokens_affected < 1.0  # the case exercises both branches of the rule


@pytest.mark.parametrize("margin", [64, -3000])  # -3000: every cut too tight, each group collected again whole
def test_ratio_quantiles_from_tails_equal_numpy(margin, monkeypatch):
    from mismatch import groups
    from mismatch.groups import Grouping, find_runs, ratio_quantiles

    monkeypatch.setattr(groups, "_MARGIN", margin)
    rng = np.random.default_rng(11)
    n = 400_000
    logp_b = -rng.exponential(1.0, n)
    logp_a = logp_b + rng.standard_t(3, n) * 0.05
    logp_a[::1000] = logp_b[::1000]  # ties at ratio 1
    runs = find_runs([np.arange(n) // 50], n)
    run_group = np.minimum(np.arange(runs.num_runs) // 2000, 3)  # groups of 100k, 100k, 100k, 100k
    grouping = Grouping(run_group=run_group, num_groups=5, keys=pd.DataFrame())  # group 4 is empty
    qs = [0.001, 0.01, 0.99, 0.999]
    got = ratio_quantiles(logp_a - logp_b, runs, grouping, qs)
    token_group = runs.spread(run_group)
    for g in range(4):
        want = np.quantile(np.exp(logp_a - logp_b)[token_group == g], qs)
        np.testing.assert_array_equal(got[g], want)
    assert np.isnan(got[4]).all()


def small_table(seed: int) -> pd.DataFrame:
    """Shuffled rows, missing and -inf log-probs, placeholders: the corners of both paths."""
    r = np.random.default_rng(seed)
    n = int(r.integers(0, 40))
    frame = pd.DataFrame({
        "rollout": pd.Categorical(r.choice(["a", "b", "c"], n)), "branch": pd.Categorical(r.choice(["main", "s"], n)),
        "branch_kind": pd.Categorical(r.choice(["main", "subagent"], n)), "turn": r.integers(0, 3, n),
        "pos": r.integers(0, 50, n), "role": pd.Categorical(r.choice(["assistant", "user"], n)),
        "trainable": r.random(n) < 0.7})
    for name in ("logp_sampler", "logp_train", "logp_infer"):
        values = -r.exponential(1.0, n)
        values[r.random(n) < 0.1] = np.nan
        values[r.random(n) < 0.05] = -np.inf
        values[r.random(n) < 0.05] = -9999.0
        frame[name] = values
    return frame


@pytest.mark.parametrize("seed", range(12))
def test_fused_equals_numpy_on_small_odd_tables(seed, monkeypatch):
    frame = small_table(seed)
    with np.errstate(all="ignore"):
        fast = analysis(frame)
        monkeypatch.setenv("MISMATCH_NO_JIT", "1")
        slow = analysis(frame)
    assert_same(fast, slow)


def test_corrections_in_several_sweeps_equal_one(monkeypatch):
    # Huge tables split the corrections into sweeps that fit a memory budget; the numbers must not move.
    rng = np.random.default_rng(5)
    log_ratio, seq = rng.normal(0, 0.3, 5000), np.arange(5000) // 20
    one = [r.to_dict() for r in simulate(log_ratio, seq=seq, rollout=seq // 3, turn=seq % 2)]
    monkeypatch.setattr(fused, "_WEIGHT_STATS_BUDGET", 1)  # one correction per sweep
    assert [r.to_dict() for r in simulate(log_ratio, seq=seq, rollout=seq // 3, turn=seq % 2)] == one


def test_two_threads_analysing_at_once_get_the_same_numbers():
    # numba's workqueue layer aborts the process when two threads enter parallel loops at once
    # ("Concurrent access has been detected"); fused serializes them.
    import threading

    rng = np.random.default_rng(9)
    log_ratio, seq = rng.normal(0, 0.3, 1_000_000), np.arange(1_000_000) // 50
    want = [r.to_dict() for r in simulate(log_ratio, seq=seq, rollout=seq // 3, turn=seq % 2)]
    got: list = [None, None]

    def run(i: int) -> None:
        got[i] = [r.to_dict() for r in simulate(log_ratio, seq=seq, rollout=seq // 3, turn=seq % 2)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == [want, want]


def test_simd_exp_expm1_match_libm_across_the_double_range():
    # The vectorizable exp/expm1 the fused loops use, against numpy's on every regime: tiny
    # arguments (expm1's reason to exist), the polynomial's range edges, overflow and underflow
    # into subnormals, and inf/NaN.
    import numba

    from mismatch.simd import exp_expm1

    @numba.njit
    def both(x, e, m):
        for i in range(len(x)):
            e[i], m[i] = exp_expm1(x[i])

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1e-9, 20_000), rng.normal(0, 1e-3, 20_000), rng.normal(0, 1, 20_000),
                        rng.uniform(-60, 60, 20_000), rng.uniform(-750, 715, 20_000),
                        [0.0, -0.0, math.inf, -math.inf, math.nan, 709.78, 709.79, -745.13, -745.14, 5e-324,
                         math.log(2) / 2, -math.log(2) / 2]])
    e, m = np.empty_like(x), np.empty_like(x)
    both(x, e, m)
    with np.errstate(all="ignore"):
        want_e, want_m = np.exp(x), np.expm1(x)
    for got, want, max_ulps in ((e, want_e, 1), (m, want_m, 2)):
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        ulps = np.abs(got - want) / np.spacing(np.abs(want))
        assert np.all(same | (ulps <= max_ulps)), x[~(same | (ulps <= max_ulps))][:5]


def test_order_keys_sort_like_floats():
    import numba

    from mismatch.simd import from_order_key, order_key

    @numba.njit
    def keys(x, out, back):
        for i in range(len(x)):
            out[i] = order_key(x[i])
            back[i] = from_order_key(out[i])

    x = np.array([-math.inf, -1e300, -1.0, -5e-324, -0.0, 0.0, 5e-324, 1e-300, 1.0, 2.0, 1e308, math.inf])
    out, back = np.empty(len(x), dtype=np.int64), np.empty_like(x)
    keys(x, out, back)
    assert np.all(np.diff(out) > 0)  # strictly increasing, -0.0 below +0.0
    np.testing.assert_array_equal(back.view(np.int64), x.view(np.int64))  # the same bits back


def test_pairs_swept_together_equal_pairs_one_at_a_time():
    frame = table(4)
    together = summarize_pairs(TokenView(frame), PAIRS)
    alone = {f"{a}/{b}": summarize_pairs(TokenView(frame), [(a, b)])[f"{a}/{b}"] for a, b in PAIRS}
    # Bit for bit (NaN included): each pair's loop is the same, only the sweep is shared.
    assert together.keys() == alone.keys()
    for pair in together:
        assert np.array_equal(list(together[pair].values()), list(alone[pair].values()), equal_nan=True), pair


def test_pair_sums_do_not_depend_on_where_the_arrays_lie():
    # A vectorized loop that stores is guarded by a runtime check that its stores cannot overlap
    # its loads; where the output lay just below an input column, LLVM took the unvectorized path
    # and the reordered sums came out different in the last bits (a shard merge then differed
    # from one run, now and then). The sweep sums in loops without stores.
    rng = np.random.default_rng(0)
    n, m = 64, 64
    for length in range(8, 64):
        for gap in range(8):
            buffer = np.empty(n + gap + m)
            logp_a, logp_b = buffer[n + gap:], -rng.exponential(1.0, m)
            logp_a[:] = -rng.exponential(1.0, m)
            run = (np.array([0]), np.array([n - length]), np.array([length]))  # rows, starts, lengths
            [(close, _)] = fused.pair_run_stats([logp_a, logp_b], [(0, 1)], *run, buffer[:n].reshape(1, -1))
            [(apart, _)] = fused.pair_run_stats([logp_a.copy(), logp_b], [(0, 1)], *run, np.empty((1, n)))
            for name in fused.PAIR_STATS:
                assert np.array_equal(close[name], apart[name]), (length, gap, name)
