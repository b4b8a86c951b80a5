"""Tree Training and QwenGyre weights on hand-built trees (exact fractions), and weighted metrics."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from mismatch.errors import MismatchError
from mismatch.analysis.metrics import pair_metrics
from mismatch.replay import plan_replay
from mismatch.rollouts import Rollout, check_rollout
from mismatch.analysis.trees import tree_summary, weighted_pair_metrics
from mismatch.rollouts.trees import GYRE_NORMALIZATION, add_tree_weights, gyre_paths, gyre_weights, tree_weights


def _segments(num_prompt: int, num_model: int, role: str = "assistant") -> list[dict]:
    segments = [{"role": "user", "tokens": list(range(10, 10 + num_prompt))}] if num_prompt else []
    return segments + [{"role": role, "tokens": list(range(20, 20 + num_model)),
                        "logprobs": [-0.5] * num_model}]


def _rollout(rollout_id: str, branches: list[dict]) -> Rollout:
    rollout, errors = check_rollout({"id": rollout_id, "meta": {}, "branches": branches},
                                    file="hand-built", line=1, vocab_size=None)
    assert not errors, errors
    return rollout


def _tree() -> Rollout:
    """main (10 tokens) ── sub-1 @6 (4) ── sub-1-sum @2 (3);  main ── compact @8 (2).

    File order puts the subagents before the summary, so the QwenGyre order is not file order.
    """
    return _rollout("tree", [
        {"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": _segments(5, 5)},
        {"id": "sub-1", "kind": "subagent", "parent": "main", "fork_at": 6, "segments": _segments(2, 2)},
        {"id": "sub-1-sum", "kind": "subagent_summary", "parent": "sub-1", "fork_at": 2,
         "segments": _segments(1, 2, role="summary")},
        {"id": "compact", "kind": "summary", "parent": "main", "fork_at": 8,
         "segments": _segments(1, 1, role="summary")},
    ])


def _plain(rollout_id: str, num_model: int) -> Rollout:
    return _rollout(rollout_id, [{"id": "main", "kind": "main", "parent": None, "fork_at": None,
                                  "segments": _segments(2, num_model)}])


def test_tree_weights_are_the_hand_computed_fractions() -> None:
    weights = tree_weights(_tree())
    # main offset t: itself, + sub-1 and sub-1-sum while t < 6, + compact while t < 8; of 4 branches.
    assert weights["main"].tolist() == [1.0] * 6 + [0.5] * 2 + [0.25] * 2
    # sub-1 offset t: itself, + sub-1-sum while t < 2.
    assert weights["sub-1"].tolist() == [0.5, 0.5, 0.25, 0.25]
    assert weights["sub-1-sum"].tolist() == [0.25] * 3
    assert weights["compact"].tolist() == [0.25] * 2


def test_a_single_branch_weighs_one_and_a_fork_at_zero_shares_nothing() -> None:
    assert tree_weights(_plain("p", 3))["main"].tolist() == [1.0] * 5
    rollout = _rollout("z", [
        {"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": _segments(1, 1)},
        {"id": "s", "kind": "subagent", "parent": "main", "fork_at": 0, "segments": _segments(1, 1)}])
    assert tree_weights(rollout)["main"].tolist() == [0.5, 0.5]


def test_a_deep_chain_needs_no_recursion() -> None:
    depth = 1000  # the validator's limit; a recursive walk would hit Python's
    branches = [{"id": "b0", "kind": "main", "parent": None, "fork_at": None,
                 "segments": [{"role": "assistant", "tokens": [5], "logprobs": [-1.0]}]}]
    branches += [{"id": f"b{i}", "kind": "subagent", "parent": f"b{i - 1}", "fork_at": 1,
                  "segments": [{"role": "assistant", "tokens": [5], "logprobs": [-1.0]}]}
                 for i in range(1, depth)]
    weights = tree_weights(_rollout("chain", branches))
    assert weights["b0"].tolist() == [1.0] and weights[f"b{depth - 1}"].tolist() == [1 / depth]


def test_gyre_keeps_main_then_summaries_then_subagents_then_their_summaries() -> None:
    tree = _tree()
    assert gyre_paths(tree, 5) == ["main", "compact", "sub-1", "sub-1-sum"]
    assert gyre_paths(tree, 2) == ["main", "compact"]
    weights = gyre_weights(tree, 2)
    assert weights["main"].tolist() == [0.5] * 10 and weights["compact"].tolist() == [0.5] * 2
    assert weights["sub-1"].tolist() == [0.0] * 4 and weights["sub-1-sum"].tolist() == [0.0] * 3
    with pytest.raises(MismatchError, match="max_paths must be >= 1, got 0"):
        gyre_paths(tree, 0)


def test_gyre_gives_a_many_branch_rollout_no_more_weight_than_a_plain_one() -> None:
    """The stated normalization: a rollout's total is the mean token count of its kept paths."""
    tree, plain = _tree(), _plain("plain", 8)  # plain: one path of 10 tokens
    totals = {r.id: sum(w.sum() for w in gyre_weights(r).values()) for r in (tree, plain)}
    assert totals["plain"] == 10.0
    assert totals["tree"] == (10 + 4 + 3 + 2) / 4  # 4.75: four paths averaged, not summed (19)
    assert "mean of its kept paths" in GYRE_NORMALIZATION


def _table(rollouts: list[Rollout]) -> pd.DataFrame:
    table = plan_replay(rollouts).table
    rng = np.random.default_rng(0)
    table["logp_train"] = table["logp_sampler"] + rng.normal(0, 0.1, len(table))
    return table


def test_add_tree_weights_aligns_with_the_token_table() -> None:
    rollouts = [_tree(), _plain("plain", 3)]
    table = add_tree_weights(_table(rollouts), rollouts, max_paths=2)
    sub = table[(table["rollout"] == "tree") & (table["branch"] == "sub-1")]
    assert sub["weight_tree"].tolist() == [0.5, 0.5, 0.25, 0.25] and (sub["weight_gyre"] == 0).all()
    main = table[(table["rollout"] == "tree") & (table["branch"] == "main")]
    assert main["weight_tree"].tolist() == [1.0] * 6 + [0.5] * 2 + [0.25] * 2
    assert (table.loc[table["rollout"] == "plain", "weight_gyre"] == 1.0).all()


def test_add_tree_weights_refuses_a_table_of_other_rollouts() -> None:
    rollouts = [_tree(), _plain("plain", 3)]
    with pytest.raises(MismatchError, match="not in the rollouts' branch order"):
        add_tree_weights(_table(rollouts[::-1]), rollouts)
    with pytest.raises(MismatchError, match="token table has 19 rows but the rollouts have 24"):
        add_tree_weights(_table([_tree()]), rollouts)


def test_unit_weights_reproduce_the_unweighted_pair_metrics() -> None:
    rng = np.random.default_rng(1)
    logp_b = -rng.exponential(1.0, 200)
    logp_a = logp_b + rng.normal(0, 0.3, 200)
    weighted = weighted_pair_metrics(logp_a, logp_b, np.ones(200))
    plain = pair_metrics(logp_a, logp_b, seq=np.zeros(200), rollout=np.zeros(200))
    for name in ("log_ratio_mean", "log_ratio_abs_mean", "ratio_mean", "kl_k1", "kl_k2", "kl_k3",
                 "chi2_token", "ess", "frac_outside_2"):
        assert math.isclose(weighted[name], plain[name], rel_tol=1e-12, abs_tol=1e-15), name
    assert weighted["n_tokens"] == 200 and weighted["weight_sum"] == 200.0


def test_weights_count_tokens_by_hand() -> None:
    # Two tokens, log-ratios 0 and ln 2, weights 1 and 3: every mean is (1*x0 + 3*x1) / 4.
    logp_b = np.array([-1.0, -2.0])
    logp_a = logp_b + np.array([0.0, math.log(2)])
    m = weighted_pair_metrics(logp_a, logp_b, np.array([1.0, 3.0]))
    assert math.isclose(m["log_ratio_mean"], 3 * math.log(2) / 4, rel_tol=1e-15)
    assert math.isclose(m["ratio_mean"], (1 + 3 * 2) / 4, rel_tol=1e-15)
    assert math.isclose(m["chi2_token"], (1 + 3 * 4) / 4 - 1, rel_tol=1e-15)
    assert math.isclose(m["ess"], (1 + 3 * 2) ** 2 / (4 * (1 + 3 * 4)), rel_tol=1e-15)  # 49/52
    # Weight 0 and NaN drop a token; nothing left gives counts 0 and NaN metrics.
    dropped = weighted_pair_metrics(np.array([-1.0, np.nan]), np.array([-1.0, -1.0]), np.array([0.0, 1.0]))
    assert dropped["n_tokens"] == 0 and math.isnan(dropped["kl_k3"])


def test_tree_summary_reports_weighted_next_to_unweighted_per_branch_kind() -> None:
    rollouts = [_tree(), _plain("plain", 3)]
    table = add_tree_weights(_table(rollouts), rollouts, max_paths=2)
    summary = tree_summary(table, [("train", "sampler")])
    assert summary["max_paths"] == 2
    pair = summary["pairs"]["train/sampler"]
    assert set(pair) == {"unweighted", "tree", "gyre"}
    assert pair["unweighted"]["n_tokens"] == 5 + 2 + 2 + 1 + 3  # trainable (model) tokens only
    assert pair["gyre"]["n_tokens"] == 5 + 1 + 3  # sub-1 and sub-1-sum are capped away
    assert summary["num_paths"] == 5 and summary["num_paths_dropped"] == 2
    assert summary["num_rollouts_capped"] == 1
    kinds = {k["branch_kind"]: k for k in summary["branch_kinds"]}
    assert set(kinds) == {"main", "subagent", "summary", "subagent_summary"}
    assert kinds["subagent"]["weight_share"]["gyre"] == 0.0
    assert kinds["subagent"]["pairs"]["train/sampler"]["gyre"]["n_tokens"] == 0
    assert math.isclose(sum(k["weight_share"]["tree"] for k in kinds.values()), 1.0)
    with pytest.raises(MismatchError, match="no column 'weight_tree'.*add_tree_weights"):
        tree_summary(_table(rollouts), [("train", "sampler")])
