"""Framework-named metrics against plain-Python transcriptions of each framework's formula (sources in
mismatch/frameworks/), and against our own metric wherever the framework's is the same number. The
releases' own functions are the reference for verl, TRL, OpenRLHF and AReaL (tests/test_releases.py);
these transcriptions also cover slime and prime-rl, whose loss code needs Megatron or a GPU."""

from __future__ import annotations

import math
import re
import statistics

import numpy as np
import pandas as pd
import pytest
from conftest import REPO

from mismatch.frameworks.metrics import (
    FRAMEWORK_METRICS,
    crosswalk_rows,
    table_framework_metrics,
)
from mismatch.analysis.metrics import summarize_pairs


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    """Three rollouts of two branches each, some untrainable and missing log-probs, a heavy tail."""
    rng = np.random.default_rng(3)
    n = 600
    table = pd.DataFrame({"rollout": np.repeat(["r0", "r1", "r2"], n // 3),
                          "branch": np.tile(np.repeat(["main", "sub"], n // 6), 3),
                          "trainable": rng.random(n) < 0.8, "logp_sampler": np.log(rng.uniform(0.001, 1.0, n))})
    gap = rng.standard_t(2, n) * 0.05
    gap[::97] = 30.0  # past verl's +-20 clamp
    table["logp_train"] = np.minimum(table["logp_sampler"] + gap, 0.0)
    table.loc[::50, "logp_sampler"] = np.nan
    return table


def rows(table: pd.DataFrame) -> list[tuple[str, str, float, float]]:
    """(rollout, sequence, logp_train, logp_rollout) of each trainable token with both log-probs."""
    out = []
    for r, b, t, a, s in zip(table["rollout"], table["branch"], table["trainable"], table["logp_train"],
                             table["logp_sampler"]):
        if t and not (math.isnan(a) or math.isnan(s)):
            out.append((r, f"{r}/{b}", a, s))
    return out


def by(items: list[tuple[str, float]]) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for key, value in items:
        groups.setdefault(key, []).append(value)
    return groups


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def transcribed(table: pd.DataFrame) -> dict[str, float]:
    """Each formula as the framework's source writes it, token by token."""
    tokens = rows(table)
    lr = [a - s for _, _, a, s in tokens]
    clamp = [max(-20.0, min(20.0, x)) for x in lr]
    seq_sum = {k: sum(v) for k, v in by([(q, a - s) for _, q, a, s in tokens]).items()}
    d_s = [mean(v) for v in by([(q, s) for _, q, _, s in tokens]).values()]
    d_s = [m_b - m_a for m_b, m_a in zip(d_s, [mean(v) for v in by([(q, a) for _, q, a, _ in tokens]).values()])]
    # verl 0.9.1 decoupled_token_is (T 2): weights min(exp, T), clamped to [0, T] for the ESS, whose
    # masked means divide by n + 1e-8 (tests/test_releases.py holds this to the release itself)
    w = [min(2.0, math.exp(c)) for c in clamp]
    w_mean = sum(w) / (len(w) + 1e-8)
    trl = [math.exp(v) if math.exp(v) <= 3.0 else 0.0 for v in seq_sum.values()]  # sequence_mask, clip_max 3
    per_rollout = lambda f: mean(mean(v) for v in by([(r, f(a, s)) for r, _, a, s in tokens]).values())
    return {
        "verl/rollout_corr/kl": mean(s - a for _, _, a, s in tokens),
        "verl/rollout_corr/k3_kl": mean(math.exp(x) - x - 1 for x in lr),
        "verl/rollout_corr/log_ppl_diff": mean(d_s),
        "verl/rollout_corr/ppl_ratio": mean(math.exp(d) for d in d_s),
        "verl/rollout_corr/chi2_token": mean(math.exp(c) ** 2 for c in clamp) - 1.0,
        "verl/rollout_corr/chi2_seq": mean(math.exp(2 * max(-20.0, min(20.0, v))) for v in seq_sum.values()) - 1.0,
        "verl/rollout_corr/rollout_is_eff_sample_size":
            1.0 / (sum((x / (w_mean + 1e-8)) ** 2 for x in w) / (len(w) + 1e-8)),
        "trl/sampling/importance_sampling_ratio/mean": mean(trl),
        "trl/sampling/sampling_logp_difference/max": max(abs(x) for x in lr),
        "slime/train/tis_clipfrac": per_rollout(lambda a, s: float(math.exp(a - s) > 2.0)),
        "slime/train/mis_chi2_token": mean(
            mean(v) - 1.0 for v in by([(r, math.exp(max(-20.0, min(20.0, a - s))) ** 2)
                                       for r, _, a, s in tokens]).values()),
        "prime-rl/mismatch_kl/all/max": max(math.exp(x) - x - 1 for x in lr),
        "prime-rl/mismatch_kl/all/median": statistics.median(math.exp(x) - x - 1 for x in lr),
        "openrlhf/train/vllm_kl": mean(s - a for _, _, a, s in tokens),
    }


def test_framework_metrics_equal_the_frameworks_formulas(table) -> None:
    got = table_framework_metrics(table, [("train", "sampler")])["train/sampler"]
    flat = {f"{framework}/{key}": value for framework, keys in got.items() for key, value in keys.items()}
    for name, want in transcribed(table).items():
        assert flat[name] == pytest.approx(want, rel=1e-9), name


def test_chunks_of_a_few_rows_give_the_numbers_of_one_chunk(table, monkeypatch) -> None:
    """Rollout-aligned chunks of ~40 rows (every rollout its own chunk): sums, extremes, Chan-merged
    moments and the median's radix passes (forced to several by a tiny collect bound) agree."""
    whole = table_framework_metrics(table, [("train", "sampler")])["train/sampler"]
    monkeypatch.setattr("mismatch.results.chunks.DEFAULT_CHUNK_ROWS", 40)
    monkeypatch.setattr("mismatch.analysis.radix_select._COLLECT", 16)
    chunked = table_framework_metrics(table, [("train", "sampler")])["train/sampler"]
    for framework, keys in whole.items():
        for key, value in keys.items():
            assert chunked[framework][key] == pytest.approx(value, rel=1e-9), f"{framework}/{key}"


def test_same_named_metrics_equal_ours_and_the_clamp_is_what_differs(table) -> None:
    ours = summarize_pairs(table, [("train", "sampler")])["train/sampler"]
    got = table_framework_metrics(table, [("train", "sampler")])["train/sampler"]
    for metric in FRAMEWORK_METRICS:
        if metric.ours is not None and not metric.note:
            assert got[metric.framework][metric.key] == pytest.approx(ours[metric.ours], rel=1e-9), metric.key
    # A log-ratio of 30 overflows nothing in float64 but verl clamps it at 20: verl's chi2 is smaller.
    assert got["verl"]["rollout_corr/chi2_token"] < ours["chi2_token"]


def test_docs_crosswalk_is_the_table_in_the_code() -> None:
    page = (REPO / "docs/crosswalk.md").read_text()
    block = re.search(r"<!-- crosswalk -->\n(.*?)<!-- /crosswalk -->", page, re.DOTALL)
    assert block is not None, "docs/crosswalk.md has no crosswalk block"
    assert block.group(1) == crosswalk_markdown()


def crosswalk_markdown() -> str:
    lines = ["| framework | logged as | mismatch's metric | how it differs |", "|---|---|---|---|"]
    for row in crosswalk_rows():
        lines.append(f"| {row['framework']} | `{row['key']}` | {('`' + row['ours'] + '`') if row['ours'] else '—'} "
                     f"| {row['note'] or 'same number'} |")
    return "\n".join(lines) + "\n"


def test_a_mean_per_sequence_is_the_same_whether_the_codes_come_in_runs_or_not() -> None:
    """PairArrays.per sums runs of codes (reduceat) when a chunk's codes are 0, 0, 1, 2, 2, ...,
    and falls back to a weighted bincount when they are not in order or one is missing."""
    from mismatch.frameworks.pair_arrays import PairArrays

    rng = np.random.default_rng(3)
    runs = np.repeat(np.arange(50), rng.integers(1, 40, 50))
    logp_a, logp_b = -rng.random(len(runs)), -rng.random(len(runs))
    expected = [np.mean(logp_a[runs == code]) for code in range(50)]
    for seq in (runs, rng.permutation(runs), np.where(runs == 7, 8, runs)):
        arrays = PairArrays(logp_a, logp_b, seq=seq, rollout=np.zeros(len(runs), dtype=np.int64))
        with np.errstate(invalid="ignore"):  # a missing code's mean is 0 / 0
            found = arrays.per(arrays.seq, arrays.logp_a)
        want = [np.mean(logp_a[seq == code]) if (seq == code).any() else np.nan for code in range(50)]
        np.testing.assert_allclose(found, want, rtol=1e-12)
    np.testing.assert_allclose(PairArrays(logp_a, logp_b, seq=runs, rollout=runs).per(runs, logp_a), expected,
                               rtol=1e-12)
