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
from mismatch.analysis.chunked import Chunk, Chunks, run_passes, table_chunks
from mismatch.analysis.groups import dot, find_spans, key_codes
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
                     max_paths: int = DEFAULT_MAX_PATHS, inplace: bool = False,
                     planned: bool = False) -> pd.DataFrame:
    """`table` with `weight_tree` and `weight_gyre` columns (float64), aligned row for row
    (a copy, or `table` itself with `inplace`: the replay adds them to the table it just built).

    `table` must be the token table of exactly these rollouts in `plan_replay` order (each
    branch's own tokens, rollout by rollout, branch by branch); the rollout and branch columns
    are checked against that order, unless `planned` says plan_replay just built it from these
    very rollouts (the replay's own call: a check that cannot fail, ~0.1 s per 10^6 rows).
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
    if num_rows and not planned and _branch_spans(table) != branch_keys:
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
    sums = {"weight": _WeightedSums()}
    _add_weighted(sums, np.asarray(logp_a, np.float64), np.asarray(logp_b, np.float64),
                  {"weight": np.asarray(weight, np.float64)})
    return sums["weight"].metrics()


_TERMS = ("log_ratio", "abs", "ratio", "k1", "k2", "k3", "ratio_sq", "outside")


class _WeightedSums:
    """The weighted sums behind WEIGHTED_METRICS under one weight, added chunk by chunk."""

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0
        self.sums = np.zeros(len(_TERMS))
        # ESS is scale-free: sums of w exp(log_ratio - top) and its square, so one huge ratio
        # cannot overflow it; a chunk with a larger top rescales what came before.
        self.top, self.shifted, self.shifted_sq = -np.inf, 0.0, 0.0

    def add(self, terms_of: dict[str, np.ndarray], w: np.ndarray) -> None:
        """Tokens that the weight keeps (w > 0, log_ratio defined), with their terms."""
        if not len(w):
            return
        self.n += len(w)
        self.total += float(w.sum())
        self.sums += np.array([dot(w, terms_of[name]) for name in _TERMS])
        top = float(terms_of["log_ratio"].max())
        with np.errstate(over="ignore", invalid="ignore"):
            shifted = np.exp(terms_of["log_ratio"] - top)
            new_top = max(self.top, top)
            old, new = np.exp(self.top - new_top), np.exp(top - new_top)
            self.shifted = self.shifted * old + dot(w, shifted) * new
            self.shifted_sq = self.shifted_sq * old * old + dot(w, np.square(shifted)) * new * new
        self.top = new_top

    def merge(self, other: _WeightedSums) -> None:
        """Add another chunk's (or kind's) sums."""
        if not other.n:
            return
        with np.errstate(over="ignore", invalid="ignore"):
            new_top = max(self.top, other.top)
            old, new = np.exp(self.top - new_top), np.exp(other.top - new_top)
            self.shifted = self.shifted * old + other.shifted * new
            self.shifted_sq = self.shifted_sq * old * old + other.shifted_sq * new * new
        self.n, self.total, self.top = self.n + other.n, self.total + other.total, new_top
        self.sums = self.sums + other.sums

    def metrics(self) -> dict[str, float]:
        if not self.n:
            return {name: 0 if name == "n_tokens" else (0.0 if name == "weight_sum" else float("nan"))
                    for name in WEIGHTED_METRICS}
        total, sums = self.total, dict(zip(_TERMS, self.sums.tolist()))
        with np.errstate(over="ignore", invalid="ignore"):
            return {
                "n_tokens": self.n, "weight_sum": float(total),
                "log_ratio_mean": sums["log_ratio"] / total, "log_ratio_abs_mean": sums["abs"] / total,
                "ratio_mean": sums["ratio"] / total, "kl_k1": sums["k1"] / total,
                "kl_k2": sums["k2"] / total, "kl_k3": sums["k3"] / total,
                "chi2_token": sums["ratio_sq"] / total - 1.0,
                "ess": float(np.float64(self.shifted) ** 2 / (total * np.float64(self.shifted_sq))),
                "frac_outside_2": sums["outside"] / total,
            }


def _terms_of(log_ratio: np.ndarray) -> dict[str, np.ndarray]:
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = terms.ratio(log_ratio)
        return {"log_ratio": log_ratio, "abs": np.abs(log_ratio), "ratio": ratio, "k1": terms.k1(log_ratio),
                "k2": terms.k2(log_ratio), "k3": terms.k3(log_ratio), "ratio_sq": terms.ratio_sq(ratio),
                "outside": terms.outside(ratio).astype(np.float64)}


def _add_weighted(sums: dict[str, _WeightedSums], logp_a: np.ndarray, logp_b: np.ndarray,
                  weights: dict[str, np.ndarray]) -> None:
    """Each weight's sums over these tokens: the terms are made once for the weights that keep
    every token with a defined log-ratio, and once more for each weight that drops some."""
    valid = ~(np.isnan(logp_a) | np.isnan(logp_b))
    log_ratio = logp_a[valid] - logp_b[valid]
    shared = None
    for name, weight in weights.items():
        w = weight[valid]
        keep = w > 0
        if keep.all():
            shared = shared if shared is not None else _terms_of(log_ratio)
            sums[name].add(shared, w)
        else:
            sums[name].add(_terms_of(log_ratio[keep]), w[keep])


def _check_columns(table: pd.DataFrame, pairs: Sequence[tuple[str, str]]) -> None:
    wanted = [f"weight_{name}" for name in WEIGHTS] + [f"logp_{source}" for pair in pairs for source in pair]
    missing = [column for column in wanted if column not in table.columns]
    if missing:
        hint = " (add them with mismatch.rollouts.trees.add_tree_weights)" if missing[0].startswith("weight_") else ""
        raise MismatchError(f"token table has no column {missing[0]!r}{hint}")


class _KindSums:
    """One branch kind's (or all trainable tokens') counts and weighted sums, chunk by chunk."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self.n_branches, self.n_tokens = 0, 0
        self.weight_totals = dict.fromkeys(WEIGHTS, 0.0)
        self.pairs = {pair: {name: _WeightedSums() for name in ("unweighted", *WEIGHTS)} for pair in pairs}

    def add(self, columns: dict[str, np.ndarray], rows: np.ndarray | slice, n_branches: int) -> None:
        self.n_branches += n_branches
        weights = {name: columns[f"weight_{name}"][rows] for name in WEIGHTS}
        self.n_tokens += len(weights["tree"])
        for name, weight in weights.items():
            self.weight_totals[name] += float(weight.sum())
        weights = {"unweighted": np.ones(len(weights["tree"])), **weights}
        for (a, b), sums in self.pairs.items():
            _add_weighted(sums, columns[f"logp_{a}"][rows], columns[f"logp_{b}"][rows], weights)

    def merge(self, other: _KindSums) -> None:
        self.n_branches += other.n_branches
        self.n_tokens += other.n_tokens
        for name in WEIGHTS:
            self.weight_totals[name] += other.weight_totals[name]
        for pair, sums in self.pairs.items():
            for name, found in sums.items():
                found.merge(other.pairs[pair][name])

    def pair_metrics(self) -> dict[str, dict[str, dict[str, float]]]:
        return {f"{a}/{b}": {name: found.metrics() for name, found in sums.items()}
                for (a, b), sums in self.pairs.items()}


class TreeSums:
    """Everything summary.json `trees` says, added a chunk of whole rollouts at a time (an Analysis
    of one pass)."""

    def __init__(self, pairs: Sequence[tuple[str, str]], max_paths: int | None = DEFAULT_MAX_PATHS) -> None:
        self.pairs = list(pairs)
        self.all = _KindSums(pairs)
        self.kinds: dict[Any, _KindSums] = {}
        self.kind_names: list[pd.Series] = []
        self.num_paths = self.num_paths_dropped = self.num_rollouts_capped = 0
        self.max_paths = max_paths

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        table = chunk.table
        _check_columns(table, self.pairs)
        trainable = table["trainable"].to_numpy(dtype=bool)
        names = [f"weight_{name}" for name in WEIGHTS] + list({f"logp_{r}": 0 for pair in self.pairs for r in pair})
        columns = {name: table[name].to_numpy(np.float64)[trainable] for name in names}
        # Per branch (a stretch of equal rollout and branch): its gyre weight, the same on every row.
        branches = find_spans([key_codes(table[name]) for name in ("rollout", "branch")], len(table))
        branch_gyre = branches.max(table["weight_gyre"].to_numpy())
        branch_rollout = key_codes(table["rollout"])[branches.starts]
        dropped = branch_gyre == 0
        self.num_paths += int(branches.num_spans)
        self.num_paths_dropped += int(dropped.sum())
        self.num_rollouts_capped += len(np.unique(branch_rollout[dropped]))
        branch_of_row = np.repeat(np.arange(branches.num_spans), branches.lengths)[trainable]
        kinds = table["branch_kind"][trainable]
        kind_codes, kind_names = pd.factorize(kinds, sort=True)
        self.kind_names.append(pd.Series(kind_names))  # dtype kept: categoricals stay categorical
        for code, kind in enumerate(kind_names):
            # Each kind's sums once; all trainable tokens are the kinds' sums together.
            rows = np.flatnonzero(kind_codes == code) if len(kind_names) > 1 else slice(None)
            part = _KindSums(self.pairs)
            part.add(columns, rows, len(np.unique(branch_of_row[rows])))
            self.kinds.setdefault(kind, _KindSums(self.pairs)).merge(part)
            self.all.merge(part)

    def merge(self, other: TreeSums, index: int) -> None:
        self.num_paths += other.num_paths
        self.num_paths_dropped += other.num_paths_dropped
        self.num_rollouts_capped += other.num_rollouts_capped
        self.kind_names.extend(other.kind_names)
        for kind, part in other.kinds.items():
            self.kinds.setdefault(kind, _KindSums(self.pairs)).merge(part)
        self.all.merge(other.all)

    def result(self) -> dict[str, Any]:
        total_tokens, totals = self.all.n_tokens, self.all.weight_totals
        # Kinds in the order pd.factorize(sort=True) gives them (category order for categoricals).
        ordered = pd.factorize(pd.concat(self.kind_names, ignore_index=True), sort=True)[1] if self.kind_names else []
        kinds = []
        for kind in ordered:
            found = self.kinds[kind]
            kinds.append({
                "branch_kind": str(kind),
                "n_branches": found.n_branches,
                "n_tokens": found.n_tokens,
                # What share of the loss each kind gets: tokens alone overstate long subagents.
                "weight_share": {"tokens": found.n_tokens / max(total_tokens, 1),
                                 **{name: found.weight_totals[name] / totals[name]
                                    if totals[name] else float("nan") for name in WEIGHTS}},
                "pairs": found.pair_metrics(),
            })
        return {
            "max_paths": self.max_paths,  # None if the table lost its attrs
            "gyre_normalization": GYRE_NORMALIZATION,
            "num_paths": self.num_paths,
            "num_paths_dropped": self.num_paths_dropped,
            "num_rollouts_capped": self.num_rollouts_capped,
            "weight_tree_mean": totals["tree"] / total_tokens if total_tokens else float("nan"),
            "pairs": self.all.pair_metrics(),
            "branch_kinds": kinds,
        }


def tree_summary(table: pd.DataFrame | Chunks, pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """`summary["trees"]`: weights, weighted and unweighted pair metrics, a per-branch-kind view.

    Over trainable tokens only (the PPO loss's tokens); `table` comes from `add_tree_weights`, or
    is its chunks of whole rollouts (a branch, and its rollout, lies in one chunk), read one at
    a time. A table in memory reports the path cap its weights used (its attrs); chunks read
    back, the replay's (DEFAULT_MAX_PATHS).
    """
    chunks = table if callable(table) else table_chunks(table)
    found = TreeSums(pairs, DEFAULT_MAX_PATHS if callable(table) else table.attrs.get("gyre_max_paths"))
    run_passes(chunks, [found])
    return found.result()
