"""Rollout trees as a trainer weighs them: Tree Training token weights and the QwenGyre path cap.

rollouts + token table → `weight_tree` / `weight_gyre` columns, which `analysis.trees` reads for
the weighted pair metrics next to the unweighted ones (summary.json `trees`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mismatch.errors import MismatchError
from mismatch.results.chunks import key_codes
from mismatch.rollouts.model import Rollout

DEFAULT_MAX_PATHS = 5
WEIGHTS = ("tree", "gyre")
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
                     max_paths: int = DEFAULT_MAX_PATHS, inplace: bool = False,
                     planned: bool = False) -> pd.DataFrame:
    """`table` with `weight_tree` and `weight_gyre` columns (float64), aligned row for row
    (a copy, or `table` itself with `inplace`: the replay adds them to the table it just built).

    `table` must be the token table of exactly these rollouts in `plan_replay` order (each
    branch's own tokens, rollout by rollout, branch by branch); the rollout and branch columns
    are checked against that order, unless `planned` says plan_replay just built it from these
    very rollouts (the replay's own call: a check that cannot fail, paid for on every row).
    """
    branch_keys: list[tuple[str, str, int]] = []  # (rollout id, branch id, own tokens)
    tree: list[float | np.ndarray] = []  # per branch: one weight for all its tokens, or one per token
    gyre: list[float | np.ndarray] = []
    for rollout in rollouts:
        if len(rollout.branches) == 1 and max_paths >= 1:
            # One stream (most dumps): its tokens are in the one history (tree_weights: 1/1) on the
            # one kept path (gyre_weights: 1/1); no arrays made per rollout.
            branch = rollout.branches[0]
            branch_keys.append((rollout.id, branch.id, branch.num_tokens))
            tree.append(1.0)
            gyre.append(1.0)
            continue
        by_tree, by_gyre = tree_weights(rollout), gyre_weights(rollout, max_paths)
        for branch in rollout.branches:
            branch_keys.append((rollout.id, branch.id, branch.num_tokens))
            tree.append(by_tree[branch.id])
            gyre.append(by_gyre[branch.id])
    lengths = [length for _, _, length in branch_keys]
    num_rows = sum(lengths)
    if num_rows != len(table):
        raise MismatchError(f"token table has {len(table)} rows but the rollouts have {num_rows} "
                            "own tokens; pass the table plan_replay built for these rollouts")
    if num_rows and not planned and _branch_spans(table) != branch_keys:
        raise MismatchError("token table rows are not in the rollouts' branch order; pass the table "
                            "plan_replay built for these rollouts")
    out = table if inplace else table.copy()
    out["weight_tree"] = _per_token(tree, lengths)
    out["weight_gyre"] = _per_token(gyre, lengths)
    out.attrs["gyre_max_paths"] = max_paths  # so analysis.trees.tree_summary reports the cap these weights used
    return out


def _per_token(weights: list[float | np.ndarray], lengths: list[int]) -> np.ndarray:
    """Each branch's weights over its rows, in order (float64): a float fills its `lengths` rows,
    an array is them."""
    out = np.repeat(np.asarray([w if isinstance(w, float) else 0.0 for w in weights], dtype=np.float64), lengths)
    start = 0
    for weight, length in zip(weights, lengths):
        if not isinstance(weight, float):
            out[start:start + length] = weight
        start += length
    return out


def _branch_spans(table: pd.DataFrame) -> list[tuple[str, str, int]]:
    """(rollout, branch, rows) of each stretch of equal (rollout, branch) in a non-empty table,
    read from the key codes at the stretches' starts, not from a Python string per row."""
    starts = np.zeros(len(table), dtype=bool)
    starts[0] = True
    for name in ("rollout", "branch"):
        codes = key_codes(table[name])
        starts[1:] |= codes[1:] != codes[:-1]
    first = np.flatnonzero(starts)
    lengths = np.diff(np.append(first, len(table)))
    rollout, branch = (table[name].iloc[first].astype(str).tolist() for name in ("rollout", "branch"))
    return list(zip(rollout, branch, lengths.tolist()))

