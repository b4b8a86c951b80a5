"""summary.json `distribution`: each pair's whole next-token distribution gap (--distribution), from
the per-position terms the distribution pass filled into the token table (replay/distribution.py).

Read in the analysis's chunks like every other analysis: sums, maxima, a bounded list of the worst
positions, the moved mass per token (at most a vocabulary's worth) and per turn. Terms are defined
in engines/distributions.py; `kl` is the mean of KL(A‖B) over trainable positions, exact where
both sides gave their whole distribution and a lower bound where one gave its top-K.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from mismatch.analysis.chunked import Chunk

NUM_WORST = 10   # positions listed, largest KL(A‖B) first
NUM_TOKENS = 5   # tokens listed, largest share of the moved mass first
MEANS = ("kl_ab", "kl_ba", "tv", "tv_hi", "overlap", "tail_a", "tail_b", "argmax_agree")


def dist_column(a: str, b: str, term: str) -> str:
    return f"dist_{a}_{b}_{term}"


class _PairSums:
    """One pair's running sums (mergeable: every field adds, or keeps the larger)."""

    def __init__(self) -> None:
        self.n = 0
        self.sums = dict.fromkeys(MEANS, 0.0)
        self.max_kl_ab = 0.0
        self.max_tv = 0.0
        self.n_rank_differs = 0
        self.n_rank_known = 0  # positions where both sides gave the sampled token's rank
        self.n_exact = 0
        self.n_sampled_equal = 0
        self.n_row_equal = 0
        self.n_both_equal = 0
        self.sum_abs_log_ratio = 0.0
        self.moved: dict[int, float] = {}       # token -> Σ tv at positions where it moved most
        self.moved_count: dict[int, int] = {}
        self.turns: dict[int, list[float]] = {}  # turn -> [n, Σ kl_ab, Σ tv]
        self.worst: list[tuple[float, int, dict[str, Any]]] = []  # a min-heap of NUM_WORST
        self.seq = 0

    def merge(self, other: _PairSums) -> None:
        self.n += other.n
        for key in MEANS:
            self.sums[key] += other.sums[key]
        self.max_kl_ab = max(self.max_kl_ab, other.max_kl_ab)
        self.max_tv = max(self.max_tv, other.max_tv)
        for name in ("n_rank_differs", "n_rank_known", "n_exact", "n_sampled_equal", "n_row_equal", "n_both_equal"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.sum_abs_log_ratio += other.sum_abs_log_ratio
        for token, value in other.moved.items():
            self.moved[token] = self.moved.get(token, 0.0) + value
            self.moved_count[token] = self.moved_count.get(token, 0) + other.moved_count[token]
        for turn, (n, kl, tv) in other.turns.items():
            mine = self.turns.setdefault(turn, [0, 0.0, 0.0])
            mine[0] += n
            mine[1] += kl
            mine[2] += tv
        for kl, _, row in other.worst:
            self._keep(kl, row)

    def _keep(self, kl: float, row: dict[str, Any]) -> None:
        self.seq += 1
        item = (kl, -self.seq, row)  # ties: the earlier row kept
        if len(self.worst) < NUM_WORST:
            heapq.heappush(self.worst, item)
        elif kl > self.worst[0][0]:
            heapq.heapreplace(self.worst, item)


class DistributionSummary:
    """An Analysis (pass 0) of the distribution terms of each pair that has them."""

    def __init__(self, pairs: tuple[tuple[str, str], ...], passes: dict[str, Any]) -> None:
        self.pairs = pairs
        self.passes = passes  # "A/B" -> the distribution pass's account (k, views, seconds)
        self.sums = {f"{a}/{b}": _PairSums() for a, b in pairs}

    def wants(self, index: int) -> bool:
        return index == 0 and bool(self.pairs)

    def add(self, chunk: Chunk, index: int) -> None:
        table = chunk.table
        for a, b in self.pairs:
            if dist_column(a, b, "kl_ab") not in table.columns:
                continue
            frame = table[table["trainable"].to_numpy(bool)] if "trainable" in table.columns else table
            kl = frame[dist_column(a, b, "kl_ab")].to_numpy(np.float64)
            rows = frame[~np.isnan(kl)]
            if rows.empty:
                continue
            self._add(self.sums[f"{a}/{b}"], rows, a, b)

    def _add(self, sums: _PairSums, rows: Any, a: str, b: str) -> None:
        def col(term: str) -> np.ndarray:
            return rows[dist_column(a, b, term)].to_numpy(np.float64)

        kl, tv = col("kl_ab"), col("tv")
        sums.n += len(rows)
        for key in MEANS:
            sums.sums[key] += float(col(key).sum())
        sums.max_kl_ab = max(sums.max_kl_ab, float(kl.max()))
        sums.max_tv = max(sums.max_tv, float(tv.max()))
        rank_a, rank_b = col("rank_a"), col("rank_b")
        known = ~np.isnan(rank_a) & ~np.isnan(rank_b)
        sums.n_rank_known += int(known.sum())
        sums.n_rank_differs += int((rank_a[known] != rank_b[known]).sum())
        sums.n_exact += int(col("exact").sum())
        sampled_equal, row_equal = col("sampled_equal") == 1, col("row_equal") == 1
        sums.n_sampled_equal += int(sampled_equal.sum())
        sums.n_row_equal += int(row_equal.sum())
        sums.n_both_equal += int((sampled_equal & row_equal).sum())
        if f"logp_{a}" in rows.columns and f"logp_{b}" in rows.columns:
            gap = np.abs(rows[f"logp_{a}"].to_numpy(np.float64) - rows[f"logp_{b}"].to_numpy(np.float64))
            sums.sum_abs_log_ratio += float(np.nansum(gap))
        tokens = col("token").astype(np.int64)
        for token, value, count in zip(*_grouped(tokens, tv)):
            sums.moved[int(token)] = sums.moved.get(int(token), 0.0) + float(value)
            sums.moved_count[int(token)] = sums.moved_count.get(int(token), 0) + int(count)
        if "turn" in rows.columns:
            turns = rows["turn"].to_numpy(np.int64)
            for turn in np.unique(turns):
                here = turns == turn
                mine = sums.turns.setdefault(int(turn), [0, 0.0, 0.0])
                mine[0] += int(here.sum())
                mine[1] += float(kl[here].sum())
                mine[2] += float(tv[here].sum())
        for i in np.argsort(-kl, kind="stable")[:NUM_WORST]:
            record = rows.iloc[int(i)]
            sums._keep(float(kl[i]), {
                "rollout": str(record["rollout"]), "branch": str(record["branch"]), "turn": int(record["turn"]),
                "pos": int(record["pos"]), "token_id": int(record["token_id"]), "kl_ab": float(kl[i]),
                "kl_ba": float(col("kl_ba")[i]), "tv": float(tv[i]), "moved_token": int(tokens[i]),
                "rank_a": _rank(rank_a[i]), "rank_b": _rank(rank_b[i]),
                "argmax_agree": bool(col("argmax_agree")[i] == 1)})

    def merge(self, other: DistributionSummary, index: int) -> None:
        for key, sums in self.sums.items():
            sums.merge(other.sums[key])

    def result(self) -> dict[str, Any] | None:
        found = {key: pair_result(sums, self.passes.get(key, {})) for key, sums in self.sums.items() if sums.n}
        return found or None


def _rank(value: float) -> int | None:
    return None if np.isnan(value) else int(value)


def _grouped(tokens: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    unique, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
    return unique, np.bincount(inverse, weights=values, minlength=len(unique)), counts


def pair_result(sums: _PairSums, account: dict[str, Any]) -> dict[str, Any]:
    """One pair's summary.json `distribution` entry."""
    n = sums.n
    mean = {key: sums.sums[key] / n for key in MEANS}
    exact = sums.n_exact == n
    total_moved = sum(sums.moved.values()) or 1.0
    tokens = sorted(sums.moved.items(), key=lambda item: (-item[1], item[0]))[:NUM_TOKENS]
    return {
        "k": account.get("k"), "full": account.get("full"), "views": account.get("views"),
        "exact": exact, "n_positions": n,
        "kl": mean["kl_ab"], "kl_ab_mean": mean["kl_ab"], "kl_ba_mean": mean["kl_ba"], "kl_ab_max": sums.max_kl_ab,
        "tv_mean": mean["tv"], "tv_max": sums.max_tv, "tv_hi_mean": mean["tv_hi"],
        "topk_overlap_mean": mean["overlap"], "tail_a_mean": mean["tail_a"], "tail_b_mean": mean["tail_b"],
        "argmax_agree_frac": mean["argmax_agree"], "rank_differs_frac": sums.n_rank_differs / sums.n_rank_known if sums.n_rank_known else None,
        "n_rank_unknown": n - sums.n_rank_known,
        "sampled_abs_log_ratio_mean": sums.sum_abs_log_ratio / n,
        "bitwise": bitwise_claim(sums, exact),
        "tokens": [{"token_id": token, "tv_share": value / total_moved, "n_positions": sums.moved_count[token]}
                   for token, value in tokens],
        "worst": [row for _, _, row in sorted(sums.worst, key=lambda item: (-item[0], -item[1]))],
        "turns": [{"turn": turn, "n": int(n_turn), "kl_ab_mean": kl / n_turn, "tv_mean": tv / n_turn}
                  for turn, (n_turn, kl, tv) in sorted(sums.turns.items())],
        "bounded": None if exact else (
            "a side gave only its top-K: KL both ways and TV are lower bounds (the tokens outside the known "
            "set merged into one outcome), tv_hi an upper bound; overlap, tails, argmax and ranks are exact "
            "(a rank the engine did not report, n_rank_unknown, is left out of rank_differs_frac)"),
        "seconds": account.get("seconds"),
    }


def bitwise_claim(sums: _PairSums, exact: bool) -> dict[str, Any]:
    """Whether sampled-token bitwise equality carries over to the whole distribution (issue #48 3)."""
    n, sampled, both = sums.n, sums.n_sampled_equal, sums.n_both_equal
    scope = "whole distribution" if exact else "known (top-K) log-probs"
    if sampled == 0:
        claim = "no sampled token's log-prob is bitwise equal on both sides: no bitwise claim to check"
    elif both == sampled == n:
        claim = f"bitwise equal on every sampled token and on the {scope} at all {n} positions"
    else:
        claim = (f"bitwise equal on {sampled} of {n} sampled tokens; at {sampled - both} of those the {scope} "
                 f"{'is' if exact else 'are'} not: equality of the sampled tokens does not carry over")
    return {"n_sampled_equal": sampled, "n_row_equal": sums.n_row_equal, "n_both_equal": both,
            "scope": scope, "holds": both == n, "claim": claim}


def closer_on_distribution(found: dict[str, Any]) -> dict[str, Any] | None:
    """diff's answer on the whole distribution: which of a and b has the smaller mean KL(config‖reference),
    over the same positions. Two exact means are compared as they are; where either is a lower
    bound (a top-K side), a smaller bound does not make a config closer, so no side is named."""
    a, b = found.get("a/reference"), found.get("b/reference")
    if a is None or b is None:
        return None
    exact = a["exact"] and b["exact"]
    closer = ("a" if a["kl"] < b["kl"] else "b" if b["kl"] < a["kl"] else "tie") if exact else None
    return {"kl": {"a": a["kl"], "b": b["kl"]}, "tv_mean": {"a": a["tv_mean"], "b": b["tv_mean"]},
            "argmax_agree_frac": {"a": a["argmax_agree_frac"], "b": b["argmax_agree_frac"]},
            "exact": exact, "closer": closer,
            "rule": "smaller mean KL(config‖reference) over the whole vocabulary" if exact else
                    "not decided: a side gave only its top-K, so its KL is a lower bound"}
