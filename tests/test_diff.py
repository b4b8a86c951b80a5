"""`mismatch diff`: two configs against a reference, bootstrap deltas, throughput."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from mismatch.results import validate_summary
from mismatch.cli import main
from mismatch.analysis.comparison import bootstrap_deltas, compare_configs
from mismatch.results.chunks import table_chunks


def test_diff_names_the_closer_config(tiny_checkpoint, sampled_rollouts, tmp_path, capsys) -> None:
    out = tmp_path / "diff"
    code = main(["diff", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts), "--a",
                 "hf:dtype=float32", "--b", "hf-decode:dtype=bfloat16", "--out", str(out)])
    assert code == 0
    assert "closer to the reference: a" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"] == "diff" and validate_summary(summary) == []
    assert set(summary["pairs"]) == {"a/reference", "b/reference", "a/b"}
    comparison = summary["diff"]
    assert comparison["closer_to_reference"] == "a"
    kl = comparison["deltas"]["kl_k3"]
    # a is the reference's own config: its gap is exactly zero; the point estimates are the pairs'
    # (summed per rollout first, so equal to float rounding).
    assert kl["a"] == 0.0
    np.testing.assert_allclose(kl["b"], summary["pairs"]["b/reference"]["kl_k3"], rtol=1e-12)
    assert kl["ci95"][0] > 0
    assert all(v > 0 for v in comparison["throughput_tokens_per_s"].values())
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert {"logp_a", "logp_b", "logp_reference", "logp_sampler"} <= set(tokens.columns)
    assert comparison["where"]["worst_tokens"][0]["logp_a"] != comparison["where"]["worst_tokens"][0]["logp_b"]


def test_bootstrap_matches_hand_computation_and_brackets_the_point() -> None:
    rng = np.random.default_rng(0)
    n = 400
    table = pd.DataFrame({"rollout": np.repeat(np.arange(40), 10), "logp_reference": -rng.random(n)})
    table["logp_a"] = table["logp_reference"] + 0.01 * rng.standard_normal(n)
    table["logp_b"] = table["logp_reference"] + 0.05 * rng.standard_normal(n)
    deltas = bootstrap_deltas(table, seed=0, num_bootstrap=500)
    lr_a = table["logp_a"] - table["logp_reference"]
    lr_b = table["logp_b"] - table["logp_reference"]
    expected = np.mean(np.expm1(lr_b) - lr_b) - np.mean(np.expm1(lr_a) - lr_a)
    kl = deltas["kl_k3"]
    np.testing.assert_allclose(kl["delta"], expected, rtol=1e-12)
    assert kl["ci95"][0] < kl["delta"] < kl["ci95"][1] and kl["ci95"][0] > 0
    same = bootstrap_deltas(table.assign(logp_b=table["logp_a"]), seed=0, num_bootstrap=200)
    assert same["kl_k3"]["delta"] == 0.0 and same["kl_k3"]["ci95"] == [0.0, 0.0]


def test_the_comparison_read_in_chunks_equals_it_read_whole() -> None:
    """diff holds no token table: its comparison is summed per rollout and per turn a chunk at a
    time, and the worst tokens kept a chunk's top at a time. Read in chunks of a few rollouts, it
    gives what one chunk of the whole table gives (means up to reassociation)."""
    rng = np.random.default_rng(3)
    n = 2_000
    rollout_ids = np.repeat([f"r-{i:03d}" for i in range(50)], n // 50)
    table = pd.DataFrame({"rollout": pd.Categorical(rollout_ids), "branch": pd.Categorical(["main"] * n),
                          "turn": np.tile(np.repeat(np.arange(4), 10), 50), "pos": np.tile(np.arange(40) * 17, 50),
                          "token_id": rng.integers(0, 1000, n), "trainable": rng.random(n) < 0.7,
                          "logp_reference": -rng.exponential(1.0, n)})
    table["logp_a"] = table["logp_reference"] + 0.01 * rng.standard_normal(n)
    table["logp_b"] = table["logp_reference"] + 0.05 * rng.standard_normal(n)
    table.loc[5, "logp_b"] = np.nan  # a token one side has no value for
    whole = compare_configs(table_chunks(table), seed=1, num_bootstrap=300)
    chunked = compare_configs(table_chunks(table, rows=97), seed=1, num_bootstrap=300)
    assert chunked["deltas"] == whole["deltas"] and chunked["closer_to_reference"] == whole["closer_to_reference"]
    assert chunked["where"]["worst_tokens"] == whole["where"]["worst_tokens"]
    for key in ("by_turn", "by_position"):
        assert [row["n_tokens"] for row in chunked["where"][key]] == [row["n_tokens"] for row in whole["where"][key]]
        np.testing.assert_allclose([row["abs_diff_mean"] for row in chunked["where"][key]],
                                   [row["abs_diff_mean"] for row in whole["where"][key]], rtol=1e-12)
    trainable = table[table["trainable"]]
    worst = np.nanmax(np.abs(trainable["logp_a"] - trainable["logp_b"]))
    assert whole["where"]["worst_tokens"][0]["logp_a"] - whole["where"]["worst_tokens"][0]["logp_b"] in (worst, -worst)
