"""Tree metrics: pair metrics under the trainer's tree weights, overall and per branch kind.

The token table's `weight_tree` / `weight_gyre` columns (rollouts.trees.add_tree_weights) ->
weighted pair metrics next to the unweighted ones (summary.json `trees`), an Analysis of pass 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.chunked import Chunk, Chunks, run_passes
from mismatch.results.chunks import key_codes, table_chunks
from mismatch.analysis.groups import dot, find_spans
from mismatch.analysis.pair_tokens import PairTokens
from mismatch.errors import MismatchError
from mismatch.rollouts.trees import DEFAULT_MAX_PATHS, GYRE_NORMALIZATION, WEIGHTS

WEIGHTED_METRICS = ("n_tokens", "weight_sum", "log_ratio_mean", "log_ratio_abs_mean", "ratio_mean",
                    "kl_k1", "kl_k2", "kl_k3", "chi2_token", "ess", "frac_outside_2")


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
        if "shifted" not in terms_of:  # kept with the terms: the weights that share them share these
            top = float(terms_of["log_ratio"].max())
            with np.errstate(over="ignore", invalid="ignore"):
                shifted = np.exp(terms_of["log_ratio"] - top)
                terms_of.update(top=np.array(top), shifted=shifted, shifted_sq=np.square(shifted))
        top = float(terms_of["top"])
        with np.errstate(over="ignore", invalid="ignore"):
            new_top = max(self.top, top)
            old, new = np.exp(self.top - new_top), np.exp(top - new_top)
            self.shifted = self.shifted * old + dot(w, terms_of["shifted"]) * new
            self.shifted_sq = self.shifted_sq * old * old + dot(w, terms_of["shifted_sq"]) * new * new
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


def _terms_of(log_ratio: np.ndarray, tokens: PairTokens | None = None) -> dict[str, np.ndarray]:
    """The terms of these log-ratios; `tokens`: the chunk's pair on exactly these tokens, whose
    ratio, k3 and |log-ratio| (the same bits, made once per chunk) the span sums have already made."""
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = terms.ratio(log_ratio) if tokens is None else tokens.ratio
        k3 = terms.k3(log_ratio) if tokens is None else tokens.k3
        abs_log_ratio = np.abs(log_ratio) if tokens is None else tokens.abs_log_ratio
        return {"log_ratio": log_ratio, "abs": abs_log_ratio, "ratio": ratio, "k1": terms.k1(log_ratio),
                "k2": terms.k2(log_ratio), "k3": k3, "ratio_sq": terms.ratio_sq(ratio),
                "outside": terms.outside(ratio).astype(np.float64)}


def _add_weighted(sums: dict[str, _WeightedSums], logp_a: np.ndarray, logp_b: np.ndarray,
                  weights: dict[str, np.ndarray], tokens: PairTokens | None = None) -> None:
    """Each weight's sums over these tokens: the terms are made once for the weights that keep
    every token with a defined log-ratio, and once more for each weight that drops some.
    `tokens`: the chunk's pair on exactly these tokens, every log-ratio defined (its own terms)."""
    if tokens is None:
        valid: np.ndarray | slice = ~(np.isnan(logp_a) | np.isnan(logp_b))
        log_ratio = logp_a[valid] - logp_b[valid]
    else:
        valid, log_ratio = slice(None), tokens.log_ratio
    shared = None
    for name, weight in weights.items():
        w = weight[valid]
        keep = w > 0
        if keep.all():
            shared = shared if shared is not None else _terms_of(log_ratio, tokens)
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

    def add(self, columns: dict[str, np.ndarray], rows: np.ndarray | slice, n_branches: int,
            tokens: dict[tuple[str, str], PairTokens] | None = None) -> None:
        """`tokens`: each pair's tokens in the chunk where they are exactly these rows."""
        self.n_branches += n_branches
        weights = {name: columns[f"weight_{name}"][rows] for name in WEIGHTS}
        self.n_tokens += len(weights["tree"])
        for name, weight in weights.items():
            self.weight_totals[name] += float(weight.sum())
        weights = {"unweighted": np.ones(len(weights["tree"])), **weights}
        for (a, b), sums in self.pairs.items():
            _add_weighted(sums, columns[f"logp_{a}"][rows], columns[f"logp_{b}"][rows], weights,
                          (tokens or {}).get((a, b)))

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
        # A chunk of one kind: its rows are all trainable tokens, where a pair with every log-ratio
        # defined is the chunk's own pair tokens (log-ratio, ratio and k3 made once per chunk).
        tokens = {(a, b): pair for a, b in self.pairs
                  if (pair := chunk.pair(f"logp_{a}", f"logp_{b}")).keep is None} if len(kind_names) == 1 else {}
        for code, kind in enumerate(kind_names):
            # Each kind's sums once; all trainable tokens are the kinds' sums together.
            rows = np.flatnonzero(kind_codes == code) if len(kind_names) > 1 else slice(None)
            part = _KindSums(self.pairs)
            part.add(columns, rows, len(np.unique(branch_of_row[rows])), tokens)
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
