"""Prefix consistency from the data: one engine config must give identical log-probs to the same
token after the same prefix, whichever request it came in (the samples of a GRPO group share their
prompt; duplicated rollouts share everything). Where it does not, the engine's numbers depend on
what else was batched with them (batch variance), or on a bug (a cache that serves stale rows).

Each replayed token is keyed by a 64-bit hash of its stream up to and including it, and its
position; tokens with the same key are the same prefix. Per log-prob column: how many tokens share
a prefix with another request, how many of those groups agree bit for bit, and the worst spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mismatch.engines import ReplayRequest

_P = np.uint64(0x100000001B3)            # the FNV-1a 64-bit prime: odd, so invertible mod 2^64
_P_INV = np.uint64(pow(0x100000001B3, -1, 2**64))


def prefix_keys(requests: Sequence[ReplayRequest]) -> np.ndarray:
    """Per token-table row (the requests' scored tokens, in order): a hash of the request's tokens
    0..position (h_i = sum_j (t_j + 1) P^(i - j) mod 2^64, computed as P^i * cumsum((t_j + 1) P^-j))."""
    keys = []
    with np.errstate(over="ignore"):
        for request in requests:
            powers = _powers(_P, len(request.tokens))
            terms = (request.tokens.astype(np.uint64) + np.uint64(1)) * _powers(_P_INV, len(request.tokens))
            keys.append((np.cumsum(terms, dtype=np.uint64) * powers)[request.score_from:])
    return np.concatenate(keys) if keys else np.empty(0, np.uint64)


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) mod 2^64 (uint64 arithmetic wraps)."""
    steps = np.full(n, base, dtype=np.uint64)
    if n:
        steps[0] = 1
    return np.cumprod(steps, dtype=np.uint64)


def prefix_consistency(table: pd.DataFrame, keys: np.ndarray, sources: Sequence[str]) -> dict[str, Any]:
    """summary.json["prefix_consistency"]: per source with a log-prob column, over the tokens whose
    prefix (key and position) occurs in more than one request of this run."""
    pos = table["pos"].to_numpy(np.int64)
    # The hash already covers the whole prefix (its length included): one hashed key, no sort.
    group, _ = pd.factorize(keys)
    sizes = np.bincount(group)
    shared = sizes[group] > 1
    out: dict[str, Any] = {}
    for source in sources:
        column = f"logp_{source}"
        if column not in table.columns:
            continue
        values = table[column].to_numpy(np.float64)
        keep = shared & ~np.isnan(values)
        if not keep.any():
            out[source] = {"n_shared_tokens": 0, "n_prefixes": 0, "frac_prefixes_bitwise_equal": None,
                           "max_abs_spread": None, "worst": None}
            continue
        g = group[keep]
        v = values[keep]
        order = np.argsort(g, kind="stable")
        g, v = g[order], v[order]
        starts = np.r_[0, np.flatnonzero(np.diff(g)) + 1]
        counts = np.diff(np.r_[starts, len(g)])
        multi = counts > 1  # a prefix whose value this column has in at least two requests
        lo, hi = np.minimum.reduceat(v, starts), np.maximum.reduceat(v, starts)
        spread = np.where(multi, hi - lo, 0.0)
        worst = int(np.argmax(spread))
        rows = np.flatnonzero(keep)[order][starts[worst]: starts[worst] + counts[worst]]
        out[source] = {
            "n_shared_tokens": int(counts[multi].sum()),
            "n_prefixes": int(multi.sum()),
            "frac_prefixes_bitwise_equal": float(np.mean(lo[multi] == hi[multi])) if multi.any() else None,
            "max_abs_spread": float(spread.max()) if multi.any() else None,
            "worst": {"rollouts": sorted({str(r) for r in table["rollout"].to_numpy()[rows]})[:5],
                      "pos": int(pos[rows[0]]), "spread": float(spread[worst])}
            if multi.any() and spread[worst] > 0 else None,
        }
    return out
