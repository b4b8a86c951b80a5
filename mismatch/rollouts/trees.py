"""Rollout trees as a trainer weighs them: Tree Training token weights and the QwenGyre path cap.

rollouts + token table → `weight_tree` / `weight_gyre` columns → weighted pair metrics next to
the unweighted ones, overall and per branch kind (summary.json `trees`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.groups import find_spans, key_codes
from mismatch.errors import MismatchError
from mismatch.rollouts import Rollout

DEFAULT_MAX_PATHS = 5
WEIGHTS = ("tree", "gyre")
WEIGHTED_METRICS = ("n_tokens", "weight_sum", "log_ratio_mean", "log_ratio_abs_mean", "ratio_mean",
                    "kl_k1", "kl_k2", "kl_k3", "chi2_token", "ess", "frac_outside_2")
GYRE_NORMALIZATION = (
    "weight_gyre = 1/|P| on every token of a kept path, 0 on dropped ones, where P is the rollout's "
    "kept paths (at most max_paths, in the order main, main's summaries, subagents, their summaries): "
    "each rollout contributes the mean of its kept paths, never their sum, so its total weight is "
    "its paths' mean token count however many branches it has")


# ---------------------------------------------------------------------------------------------
# Weights of one rollout


def _subtree_sizes(rollout: Rollout) -> dict[str, int]:
    """Branches in each branch's subtree, itself included (iterative: trees may be 1000 deep)."""
    parent_of = {b.id: b.parent for b in rollout.branches}
    depth: dict[str, int] = {}
    for branch_id in parent_of:
        path, node = [], branch_id
        while node is not None and node not in depth:
            path.append(node)
            node = parent_of[node]
        base = -1 if node is None else depth[node]
        for k, node_id in enumerate(reversed(path), start=1):
            depth[node_id] = base + k
    sizes = dict.fromkeys(parent_of, 1)
    for branch_id in sorted(parent_of, key=depth.__getitem__, reverse=True):  # leaves first
        if parent_of[branch_id] is not None:
            sizes[parent_of[branch_id]] += sizes[branch_id]
    return sizes


def tree_weights(rollout: Rollout) -> dict[str, np.ndarray]:
    """Tree Training weight of each own token, per branch id: the fraction of the rollout's
    branches whose history (context + own stream) holds that token.

    A token at offset t of branch X is in X's history and in that of every branch below a child
    of X that forked at fork_at > t (its context is X's stream up to fork_at), so its count is
    1 + the subtree sizes of those children.
    """
    sizes = _subtree_sizes(rollout)
    counts = {b.id: np.ones(b.num_tokens, dtype=np.float64) for b in rollout.branches}
    for branch in rollout.branches:
        if branch.parent is not None:
            counts[branch.parent][: branch.fork_at] += sizes[branch.id]
    return {branch_id: count / len(rollout.branches) for branch_id, count in counts.items()}


def _path_rank(branch: Any, root_id: str) -> int:
    if branch.parent is None:
        return 0
    if branch.kind == "summary":
        return 1 if branch.parent == root_id else 4  # a summary of a subagent's summary, etc.
    return {"subagent": 2, "subagent_summary": 3}.get(branch.kind, 4)


def gyre_paths(rollout: Rollout, max_paths: int = DEFAULT_MAX_PATHS) -> list[str]:
    """Ids of the branches QwenGyre trains as paths (at most max_paths), in priority order:
    main, main's summaries, subagents, their summaries, anything else; ties keep file order."""
    if max_paths < 1:
        raise MismatchError(f"max_paths must be >= 1, got {max_paths}")
    root_id = next(b.id for b in rollout.branches if b.parent is None)
    ordered = sorted(rollout.branches, key=lambda b: _path_rank(b, root_id))  # stable: file order
    return [branch.id for branch in ordered[:max_paths]]


def gyre_weights(rollout: Rollout, max_paths: int = DEFAULT_MAX_PATHS) -> dict[str, np.ndarray]:
    """QwenGyre weight of each own token, per branch id (see GYRE_NORMALIZATION)."""
    kept = set(gyre_paths(rollout, max_paths))
    return {b.id: np.full(b.num_tokens, 1.0 / len(kept) if b.id in kept else 0.0)
            for b in rollout.branches}


# ---------------------------------------------------------------------------------------------
# The token table


def add_tree_weights(table: pd.DataFrame, rollouts: Sequence[Rollout], *,
                     max_paths: int = DEFAULT_MAX_PATHS, inplace: bool = False) -> pd.DataFrame:
    """`table` with `weight_tree` and `weight_gyre` columns (float64), aligned row for row
    (a copy, or `table` itself with `inplace`: the replay adds them to the table it just built).

    `table` must be the token table of exactly these rollouts in `plan_replay` order (each
    branch's own tokens, rollout by rollout, branch by branch); the rollout and branch columns
    are checked against that order.
    """
    branch_keys, tree, gyre = [], [], []  # branch_keys: (rollout id, branch id, own tokens)
    for rollout in rollouts:
        by_tree, by_gyre = tree_weights(rollout), gyre_weights(rollout, max_paths)
        for branch in rollout.branches:
            branch_keys.append((rollout.id, branch.id, branch.num_tokens))
            tree.append(by_tree[branch.id])
            gyre.append(by_gyre[branch.id])
    num_rows = sum(length for _, _, length in branch_keys)
    if num_rows != len(table):
        raise MismatchError(f"token table has {len(table)} rows but the rollouts have {num_rows} "
                            "own tokens; pass the table plan_replay built for these rollouts")
    if num_rows and _branch_spans(table) != branch_keys:
        raise MismatchError("token table rows are not in the rollouts' branch order; pass the table "
                            "plan_replay built for these rollouts")
    out = table if inplace else table.copy()
    out["weight_tree"] = np.concatenate(tree) if tree else np.empty(0)
    out["weight_gyre"] = np.concatenate(gyre) if gyre else np.empty(0)
    out.attrs["gyre_max_paths"] = max_paths  # so tree_summary reports the cap these weights used
    return out


def _branch_spans(table: pd.DataFrame) -> list[tuple[str, str, int]]:
    """(rollout, branch, rows) of each stretch of equal (rollout, branch) in table order, read from
    the key codes at the stretches' starts, not from a Python string per row."""
    codes = [key_codes(table[name]) for name in ("rollout", "branch")]
    spans = find_spans(codes, len(table))
    rollout, branch = (table[name].iloc[spans.starts].astype(str).tolist() for name in ("rollout", "branch"))
    return list(zip(rollout, branch, spans.lengths.tolist()))


# ---------------------------------------------------------------------------------------------
# Weighted metrics


def weighted_pair_metrics(logp_a: np.ndarray, logp_b: np.ndarray, weight: np.ndarray) -> dict[str, float]:
    """WEIGHTED_METRICS of A against B (log_ratio = logp_a - logp_b), each token counting `weight`.

    Every mean is sum(w * x) / sum(w); ess = (sum w r)^2 / (sum w * sum w r^2), which is the
    unweighted (sum r)^2 / (n sum r^2) when all w = 1. Tokens with a NaN log-prob or weight 0
    are left out; n_tokens counts the rest. No tokens: n_tokens 0, the rest NaN.
    """
    return weighted_pair_metrics_by(logp_a, logp_b, {"weight": weight})["weight"]


def weighted_pair_metrics_by(logp_a: np.ndarray, logp_b: np.ndarray,
                             weights: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """`weighted_pair_metrics` under each of several weights: each per-token term is made once
    and reduced by one dot product per weight (not one temporary array per weight and term)."""
    logp_a, logp_b = np.asarray(logp_a, np.float64), np.asarray(logp_b, np.float64)
    valid = ~(np.isnan(logp_a) | np.isnan(logp_b))
    log_ratio = logp_a[valid] - logp_b[valid]
    kept = {name: np.asarray(w, np.float64)[valid] for name, w in weights.items()}
    out: dict[str, dict[str, float]] = {}
    shared = {}  # weights positive on every valid token: they share the term arrays
    for name, w in kept.items():
        if not len(w) or not (w > 0).all():
            out[name] = _weighted(log_ratio[w > 0], w[w > 0]) if len(w) else _weighted(log_ratio, w)
        else:
            shared[name] = w
    if shared:
        out.update(zip(shared, _weighted_many(log_ratio, list(shared.values()))))
    return {name: out[name] for name in weights}


def _weighted(log_ratio: np.ndarray, w: np.ndarray) -> dict[str, float]:
    if not len(w):
        return {name: 0 if name == "n_tokens" else (0.0 if name == "weight_sum" else float("nan"))
                for name in WEIGHTED_METRICS}
    return _weighted_many(log_ratio, [w])[0]


def _weighted_many(log_ratio: np.ndarray, weights: list[np.ndarray]) -> list[dict[str, float]]:
    """Weighted metrics over tokens that every weight keeps (all weights > 0, log_ratio defined)."""
    W = np.stack(weights)  # [num_weights, num_tokens]
    totals = W.sum(axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = terms.ratio(log_ratio)
        # ESS is scale-free: weigh by exp(log_ratio - max) so one huge ratio cannot overflow it.
        shifted = np.exp(log_ratio - log_ratio.max())
        sums = {"log_ratio": W @ log_ratio, "abs": W @ np.abs(log_ratio), "ratio": W @ ratio,
                "k1": W @ terms.k1(log_ratio), "k2": W @ terms.k2(log_ratio), "k3": W @ terms.k3(log_ratio),
                "ratio_sq": W @ terms.ratio_sq(ratio), "outside": W @ terms.outside(ratio).astype(np.float64),
                "shifted": W @ shifted, "shifted_sq": W @ np.square(shifted)}
        return [{
            "n_tokens": len(log_ratio), "weight_sum": float(total),
            "log_ratio_mean": float(sums["log_ratio"][i] / total),
            "log_ratio_abs_mean": float(sums["abs"][i] / total),
            "ratio_mean": float(sums["ratio"][i] / total), "kl_k1": float(sums["k1"][i] / total),
            "kl_k2": float(sums["k2"][i] / total), "kl_k3": float(sums["k3"][i] / total),
            "chi2_token": float(sums["ratio_sq"][i] / total) - 1.0,
            "ess": float(sums["shifted"][i] ** 2 / (total * sums["shifted_sq"][i])),
            "frac_outside_2": float(sums["outside"][i] / total),
        } for i, total in enumerate(totals)]


def _pair_block(columns: dict[str, np.ndarray], pair: tuple[str, str],
                rows: np.ndarray | slice) -> dict[str, dict[str, float]]:
    a, b = (columns[f"logp_{source}"][rows] for source in pair)
    weights = {"unweighted": np.ones(len(a)), **{name: columns[f"weight_{name}"][rows] for name in WEIGHTS}}
    return weighted_pair_metrics_by(a, b, weights)


def _check_columns(table: pd.DataFrame, pairs: Sequence[tuple[str, str]]) -> None:
    wanted = [f"weight_{name}" for name in WEIGHTS] + [f"logp_{source}" for pair in pairs for source in pair]
    missing = [column for column in wanted if column not in table.columns]
    if missing:
        hint = " (add them with mismatch.rollouts.trees.add_tree_weights)" if missing[0].startswith("weight_") else ""
        raise MismatchError(f"token table has no column {missing[0]!r}{hint}")


def tree_summary(table: pd.DataFrame, pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """`summary["trees"]`: weights, weighted and unweighted pair metrics, a per-branch-kind view.

    Over trainable tokens only (the PPO loss's tokens); `table` comes from `add_tree_weights`.
    Columns are read once as arrays and selected per kind by row index (no copy of the table).
    """
    _check_columns(table, pairs)
    trainable = table["trainable"].to_numpy(dtype=bool)
    names = [f"weight_{name}" for name in WEIGHTS] + list({f"logp_{r}": 0 for pair in pairs for r in pair})
    columns = {name: table[name].to_numpy()[trainable] for name in names}
    # Per branch (a stretch of equal rollout and branch): its gyre weight, the same on every row.
    branches = find_spans([key_codes(table[name]) for name in ("rollout", "branch")], len(table))
    branch_gyre = branches.max(table["weight_gyre"].to_numpy())
    branch_rollout = key_codes(table["rollout"])[branches.starts]
    kind_codes, kind_names = pd.factorize(table["branch_kind"][trainable], sort=True)
    branch_of_row = np.repeat(np.arange(branches.num_spans), branches.lengths)[trainable]
    totals = {name: float(columns[f"weight_{name}"].sum()) for name in WEIGHTS}
    num_tokens = int(trainable.sum())
    kinds = []
    for code, kind in enumerate(kind_names):
        rows = np.flatnonzero(kind_codes == code)
        kinds.append({
            "branch_kind": str(kind),
            "n_branches": int(len(np.unique(branch_of_row[rows]))),
            "n_tokens": len(rows),
            # What share of the loss each kind gets: tokens alone overstate long subagents.
            "weight_share": {"tokens": len(rows) / max(num_tokens, 1),
                             **{name: float(columns[f"weight_{name}"][rows].sum()) / totals[name]
                                if totals[name] else float("nan") for name in WEIGHTS}},
            "pairs": {f"{a}/{b}": _pair_block(columns, (a, b), rows) for a, b in pairs},
        })
    dropped = branch_gyre == 0
    return {
        "max_paths": table.attrs.get("gyre_max_paths"),  # None if the table lost its attrs
        "gyre_normalization": GYRE_NORMALIZATION,
        "num_paths": int(branches.num_spans),
        "num_paths_dropped": int(dropped.sum()),
        "num_rollouts_capped": int(len(np.unique(branch_rollout[dropped]))),
        "weight_tree_mean": float(columns["weight_tree"].mean()) if num_tokens else float("nan"),
        "pairs": {f"{a}/{b}": _pair_block(columns, (a, b), slice(None)) for a, b in pairs},
        "branch_kinds": kinds,
    }
