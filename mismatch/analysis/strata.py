"""summary.json `strata`: each pair's gap split by the rollout's length, the token's position, its
probability and (where a torch trainer recorded it) the trainer's entropy, on fixed bucket edges.

The edges are the same in every run, so the audits of a training run's steps line up bucket for
bucket and `mismatch trend` can tell whether the gap grew because responses got longer (more tokens
in the long buckets) or within the low-probability / high-entropy buckets (Precision-RL#10), from
the summaries alone. Sums only: one pass, mergeable, bounded memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mismatch.analysis.chunked import Chunk

# Lower edges; the last bucket is open above. Powers of two for lengths and positions (a 128k-token
# rollout is bucket 17); probabilities as the field buckets them (tails apart, the middle coarse).
_POW2 = tuple(float(2**k) for k in range(18))
EDGES: dict[str, tuple[float, ...]] = {
    "length": (0.0, *_POW2),     # trained tokens of the token's rollout
    "position": (0.0, *_POW2),   # the token's position in its stream (context included)
    "prob": (0.0, 1e-3, 1e-2, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99),  # exp(logp) of the pair's B side
    "entropy": (0.0, 1e-3, 1e-2, 0.1, 0.3, 1.0, 2.0, 4.0),     # nats, the trainer's at the position
}
DIMENSIONS = tuple(EDGES)
_POW2_DIMENSIONS = frozenset({"length", "position"})  # edges 0, 1, 2, 4, …: bucketed by binary exponent
ENTROPY_COLUMN = "entropy_{source}"  # a torch engine's entropy of the distribution it normalized
NO_ENTROPY = ("no entropy column: stored log-probs, vLLM and servers give log-probs of sampled tokens only, "
              "not the distribution; the hf trainer records it (--train hf, unless entropy=false or temperature=T)")
_SUMS = ("n", "k3", "abs", "lr")  # the rows of each dimension's sums


class Strata:
    """Per pair and dimension, per bucket: tokens, Σ k3, Σ |log-ratio|, Σ log-ratio (pass 0)."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self.pairs = pairs
        self.sums: dict[str, dict[str, np.ndarray]] = {}
        self.seen: set[str] = set()  # pairs whose columns the table has

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        for a, b in self.pairs:
            if f"logp_{a}" not in chunk.table.columns or f"logp_{b}" not in chunk.table.columns:
                continue
            name = f"{a}/{b}"
            self.seen.add(name)
            tokens = chunk.pair(f"logp_{a}", f"logp_{b}")
            if tokens.view.num_tokens == 0:
                continue
            log_ratio = tokens.log_ratio
            values = (tokens.k3, tokens.abs_log_ratio, log_ratio)
            pair_sums = self.sums.setdefault(name, {})
            for dimension, (bucket, known, counts) in _bucketed(tokens, a, b).items():
                weights = values if known is None else tuple(v[known] for v in values)
                size = len(EDGES[dimension])
                found = np.stack([counts, *(np.bincount(bucket, weights=w, minlength=size) for w in weights)])
                pair_sums[dimension] = pair_sums.get(dimension, 0) + found

    def merge(self, other: Strata, index: int) -> None:
        self.seen |= other.seen
        for name, dimensions in other.sums.items():
            mine = self.sums.setdefault(name, {})
            for dimension, found in dimensions.items():
                mine[dimension] = mine.get(dimension, 0) + found

    def result(self) -> dict[str, Any]:
        return {name: {dimension: _stratum(dimension, self.sums.get(name, {}).get(dimension))
                       for dimension in DIMENSIONS}
                for name in (f"{a}/{b}" for a, b in self.pairs) if name in self.seen}


def _buckets(dimension: str, keys: np.ndarray) -> np.ndarray:
    """Each key's bucket: the last edge at or below it. Lengths and positions by their binary
    exponent (frexp: [2^(e-1), 2^e) is bucket e, 0 is bucket 0), the others by one comparison per
    edge: either is ~20x np.searchsorted's binary search per element on this machine."""
    edges = EDGES[dimension]
    if dimension in _POW2_DIMENSIONS:
        # intp, as np.bincount wants its bins: frexp's int32 exponents were cast in every weighted sum.
        return np.minimum(np.frexp(keys)[1], len(edges) - 1).astype(np.intp)
    bucket = np.zeros(len(keys), dtype=np.intp)
    for edge in edges[1:]:
        bucket += keys >= edge
    return bucket


def _bucketed(tokens: Any, a: str, b: str) -> dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
    """Per dimension: each token's bucket, which tokens have a key (None: all), and the bucket
    counts. Kept on the view: the pairs of a chunk mostly share one (every trainable token), so
    length and position are bucketed once a chunk, probability once per B side."""
    view = tokens.view
    found = {}
    for dimension, memo_key, keys_of in (
            ("length", ("strata", "length"), lambda: _rollout_lengths(view)),
            ("position", ("strata", "position"), lambda: view.column("pos").astype(np.float64)),
            ("prob", ("strata", "prob", b), lambda: tokens.prob_b),
            ("entropy", ("strata", "entropy", a), lambda: _entropy(view, a))):
        bucketed = view.memo(memo_key, lambda dimension=dimension, keys_of=keys_of: _bucket_keys(dimension, keys_of()))
        if bucketed is not None:
            found[dimension] = bucketed
    return found


def _rollout_lengths(view: Any) -> np.ndarray:
    """Each token's rollout's token count in the view (the spans lie within one rollout each)."""
    rollout_codes = view.spans.spread(view.span_rollout)
    return np.bincount(rollout_codes)[rollout_codes].astype(np.float64)


def _entropy(view: Any, a: str) -> np.ndarray | None:
    column = ENTROPY_COLUMN.format(source=a)
    if not view.has(column):
        return None
    # fp32 rounding can put a near-certain distribution a hair under 0: bucket 0 still.
    return np.maximum(view.column(column).astype(np.float64), 0.0)


def _bucket_keys(dimension: str, keys: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray] | None:
    """(buckets, known, counts) of the keys; None where no token has one (no entropy recorded, or
    a processed replay's): the dimension stays unavailable."""
    if keys is None:
        return None
    known = ~np.isnan(keys)  # an entropy a resumed block's older run did not record
    if not known.any():
        return None
    every = bool(known.all())
    bucket = _buckets(dimension, keys if every else keys[known])
    counts = np.bincount(bucket, minlength=len(EDGES[dimension])).astype(np.float64)
    return bucket, None if every else known, counts


def _stratum(dimension: str, sums: np.ndarray | None) -> dict[str, Any]:
    """One dimension's buckets: lower edges, tokens, mean k3 and mean |log-ratio| (null where empty)."""
    if sums is None:
        if dimension == "entropy":
            return {"unavailable": NO_ENTROPY}
        sums = np.zeros((len(_SUMS), len(EDGES[dimension])))
    n = sums[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums[1:] / n
    return {"edges": list(EDGES[dimension]), "n_tokens": n.astype(np.int64).tolist(),
            "kl_k3": means[0].tolist(), "log_ratio_abs_mean": means[1].tolist(),
            "log_ratio_mean": means[2].tolist()}
