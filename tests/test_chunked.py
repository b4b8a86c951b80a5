"""The pieces the chunked analysis merges with: exact tails, exact radix selection, Chan moments,
rollout-aligned chunk bounds (each against numpy on the whole array)."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pytest

from mismatch.analysis import chunked, radix_select
from mismatch.analysis.moments import Moments
from mismatch.analysis.radix_select import RadixSelect
from mismatch.analysis.tails import Tails
from mismatch.results.chunks import chunk_bounds

QS = [0.001, 0.01, 0.99, 0.999]


@pytest.mark.parametrize("merged", [False, True], ids=["one", "two-halves-merged"])
@pytest.mark.parametrize("n", [1, 2, 3, 10, 999, 100_001])
def test_tails_gathered_chunk_by_chunk_give_numpys_quantiles(n, merged) -> None:
    rng = np.random.default_rng(n)
    values = rng.standard_t(2, n)
    values[::97] = 1.0  # ties
    group = rng.integers(0, 3, n)
    tails = Tails(np.bincount(group, minlength=4), QS)  # group 3 is empty
    later = Tails(np.bincount(group, minlength=4), QS)  # the second half's, when merged
    for number, part in enumerate(np.array_split(np.arange(n), 7)):
        (later if merged and number >= 4 else tails).add(values[part], group[part])
    if merged:  # sent back from a fork: pickled, each buffer trimmed to its k values
        tails.merge(pickle.loads(pickle.dumps(later)))
    got = tails.quantiles()
    for g in range(3):
        if (group == g).any():
            np.testing.assert_array_equal(got[g], np.quantile(values[group == g], QS))
    assert np.isnan(got[3]).all()


def test_tails_of_mixed_groups_keep_what_each_group_alone_keeps() -> None:
    """Tails.add sorts only the values past their group's bounds into groups: its buffers hold the
    very values, in the very order, that the group's own values added alone leave there."""
    rng = np.random.default_rng(5)
    counts = np.array([40_000, 3, 0, 25_000])  # group 1 keeps nothing on a side; group 2 is empty
    mixed, alone = Tails(counts, QS), Tails(counts, QS)
    for _ in range(9):
        group = rng.choice([0, 1, 3], 8000, p=[0.6, 0.0005, 0.3995])
        values = rng.standard_t(2, len(group))
        values[::501] = np.inf
        mixed.add(values, group)
        for g in np.unique(group).tolist():
            alone._add_group(g, values[group == g])
    for side in ("low", "high"):
        for got, expected in zip(getattr(mixed, side), getattr(alone, side)):
            np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(mixed.quantiles(), alone.quantiles())


@pytest.mark.parametrize("shape", ["normal", "near_zero", "infinities", "constant", "one"])
def test_radix_selection_is_exact_in_bounded_memory(shape, monkeypatch) -> None:
    monkeypatch.setattr(radix_select, "_COLLECT", 1000)  # forces several passes
    rng = np.random.default_rng(3)
    values = {"normal": rng.standard_normal(100_003), "near_zero": np.expm1(rng.standard_normal(50_000) * 1e-3),
              "infinities": np.r_[np.zeros(5000), -np.inf, np.inf, rng.standard_t(2, 3000)],
              "constant": np.ones(20_000), "one": np.array([3.0])}[shape]
    ranks = sorted({0, len(values) // 2, len(values) - 1, min(17, len(values) - 1)})
    select, passes = RadixSelect(), 0
    while True:
        for part in np.array_split(values, 7):
            select.add(part)
        passes += 1
        if not select.end_pass(lambda n: ranks):
            break
    assert select.values == np.sort(values)[ranks].tolist()
    assert passes <= 5


def test_moments_merged_by_chan_equal_the_whole_arrays() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 10_000)) * [[1e-3], [5.0]] + [[1.0], [-2.0]]
    moments = Moments()
    for part in np.array_split(np.arange(x.shape[1]), 9):
        moments.add(x[:, part])
    assert moments.n == x.shape[1]
    np.testing.assert_allclose(moments.mean, x.mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(moments.comoment / (x.shape[1] - 1), np.cov(x), rtol=1e-9)


def test_chunks_never_cut_a_rollout_and_a_scattered_rollout_is_one_chunk() -> None:
    table = pd.DataFrame({"rollout": pd.Categorical(np.repeat(["a", "b", "c", "d"], [5, 3, 7, 2]))})
    # About 4 rows a chunk, each cut at the first rollout start at or past the mark.
    assert chunk_bounds(table, rows=4) == [(0, 5), (5, 8), (8, 15), (15, 17)]
    assert chunk_bounds(table, rows=100) == [(0, 17)]
    scattered = pd.DataFrame({"rollout": ["a", "b", "a"]})
    assert chunk_bounds(scattered, rows=1) == [(0, 3)]
    assert chunk_bounds(table.iloc[:0], rows=4) == [(0, 0)]


def test_an_audit_split_over_two_processes_writes_the_same_results(tmp_path, monkeypatch) -> None:
    """MISMATCH_WORKERS=2 reads the second part of each pass's chunks in a fork (chunked.run_passes,
    whose one process reads both parts too): summary.json, rollouts.parquet and tokens.parquet
    as one process writes them, bit for bit."""
    import json
    from pathlib import Path

    import pyarrow.parquet as pq

    import mismatch
    from tests.test_golden import GOLDEN, stored_checkpoint

    monkeypatch.setattr("mismatch.results.chunks.DEFAULT_CHUNK_ROWS", 97)  # many chunks, both passes
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    forks: list[int] = []
    real_fork_jobs = chunked.fork_jobs
    monkeypatch.setattr(chunked, "fork_jobs", lambda jobs: forks.append(len(jobs)) or real_fork_jobs(jobs))
    found: dict[str, Path] = {}
    for workers in ("1", "2"):
        monkeypatch.setenv("MISMATCH_WORKERS", workers)
        found[workers] = tmp_path / f"out-{workers}"
        mismatch.audit(checkpoint, GOLDEN / "rollouts.jsonl", train="stored:trainer", infer="stored:engine",
                       out=found[workers], block_size=4)
    # The second run forked for each pass (the first: its second half and the prefix query);
    # the first run never did.
    assert forks == [3, 2]
    one, two = (json.loads((found[w] / "summary.json").read_text()) for w in ("1", "2"))
    one.pop("created_unix"), two.pop("created_unix")
    assert json.dumps(one, sort_keys=True) == json.dumps(two, sort_keys=True)
    for name in ("rollouts.parquet", "tokens.parquet"):  # NaN where a log-prob is absent: pandas' equality
        assert pq.read_table(found["1"] / name).to_pandas().equals(pq.read_table(found["2"] / name).to_pandas()), name


def test_a_worker_that_fails_or_dies_is_raised_with_what_happened() -> None:
    import os

    from mismatch.workers import fork_jobs

    def fails() -> None:
        raise ValueError("no such column 'logp_x'")

    assert fork_jobs([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
    with pytest.raises(RuntimeError, match=r"(?s)worker process failed.*ValueError: no such column 'logp_x'"):
        fork_jobs([lambda: 1, fails])
    with pytest.raises(RuntimeError, match=r"worker process died \(exit code 3\)"):
        fork_jobs([lambda: 1, lambda: os._exit(3)])


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_a_bad_workers_variable_is_one_line_before_any_work(value, tmp_path, monkeypatch, capsys) -> None:
    from mismatch.cli import main
    from tests.test_golden import GOLDEN, stored_checkpoint

    monkeypatch.setenv("MISMATCH_WORKERS", value)
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    code = main(["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--train", "stored:trainer",
                 "--infer", "stored:engine", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (f"mismatch: error: MISMATCH_WORKERS={value!r}: must be a whole number of processes, "
                   "1 or more\n")
    assert not (tmp_path / "out").exists()


def test_workers_follow_the_table_size_unless_told() -> None:
    from mismatch.workers import MIN_ROWS_TO_FORK, analysis_workers

    assert analysis_workers(MIN_ROWS_TO_FORK - 1, environ={}) == 1
    assert analysis_workers(MIN_ROWS_TO_FORK, environ={}) == min(2, len(__import__("os").sched_getaffinity(0)))
    assert analysis_workers(10, environ={"MISMATCH_WORKERS": "3"}) == 3


def test_prefix_consistency_runs_in_either_process_with_the_table_in_memory(tmp_path, monkeypatch) -> None:
    """Without a results dir the token table is in memory; prefix consistency (run beside the
    analysis's first pass, analysis.prefixes.PrefixConsistency) then takes it into the process that
    runs it and sends back only its finding: the same with one process or two (a fork of its own)."""
    import json
    import os

    import mismatch
    from mismatch.analysis import prefixes
    from tests.test_golden import GOLDEN, stored_checkpoint

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    # Every rollout twice, under another id: each of its prefixes is shared by two requests.
    lines = (GOLDEN / "rollouts.jsonl").read_text().splitlines()
    copies = [json.dumps({**json.loads(line), "id": json.loads(line)["id"] + "-again"}) for line in lines]
    rollouts = tmp_path / "twice.jsonl"
    rollouts.write_text("\n".join(lines + copies) + "\n")
    ran = tmp_path / "ran"  # the pid of each query, from whichever process ran it
    real_query = prefixes.prefix_consistency

    def query(*args):
        with ran.open("a") as f:
            f.write(f"{os.getpid()}\n")
        return real_query(*args)

    monkeypatch.setattr(prefixes, "prefix_consistency", query)
    found = {}
    for workers in ("1", "2"):
        monkeypatch.setenv("MISMATCH_WORKERS", workers)
        result = mismatch.audit(checkpoint, rollouts, train="stored:trainer", infer="stored:engine")
        found[workers] = result.summary["prefix_consistency"]
    here, forked = (int(pid) for pid in ran.read_text().split())
    assert here == os.getpid() != forked  # once here, once in the fork, never again to fill in
    assert found["1"] == found["2"]
    assert found["2"]["sampler"]["n_shared_tokens"] > 0
    assert found["2"]["sampler"]["frac_prefixes_bitwise_equal"] == 1.0
