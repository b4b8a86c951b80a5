"""MoE routing agreement between two engine passes, and how much of the log-prob gap it explains.

A token's log-prob is read off the hidden state of the position before it, so a token "has a
flip" in a MoE layer when the two passes sent that position to different sets of experts there.
Per pair of passes that recorded routing (engines/routing.py): the flip rate per layer, the
share of tokens with at least one flip, the router-logit margin at flips (a flip at a near-tie
is precision noise; a wide one is a real divergence), and the gap on tokens with and without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.streams import ReplayRequest, StreamRouting


def token_routing(requests: Sequence[ReplayRequest], routed: Sequence[StreamRouting]) -> tuple[np.ndarray, np.ndarray]:
    """Per token-table row (the requests' scored tokens, in order): the experts and margins of the
    position that predicts it, [rows, layers, k] and [rows, layers]; -1 / NaN where no position
    predicts it (the first token of a stream with no context)."""
    layers, k = routed[0].experts.shape[1:] if routed else (0, 0)
    experts, margins = [], []
    for request, stream in zip(requests, routed, strict=True):
        first = request.score_from
        rows = np.full((request.num_scored, layers, k), -1, dtype=np.int16)
        margin = np.full((request.num_scored, layers), np.nan, dtype=np.float32)
        start = max(first, 1)  # token j is predicted at position j - 1
        rows[start - first:] = stream.experts[start - 1: len(request.tokens) - 1]
        margin[start - first:] = stream.margin[start - 1: len(request.tokens) - 1]
        experts.append(rows)
        margins.append(margin)
    if not experts:
        return np.empty((0, layers, k), dtype=np.int16), np.empty((0, layers), dtype=np.float32)
    return np.concatenate(experts), np.concatenate(margins)


def routing_summary(table: pd.DataFrame, pairs: Sequence[tuple[str, str]],
                    routing: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """summary.json["routing"]: per pair whose two sides both recorded routing, over trainable
    tokens where both log-probs and both routings are defined."""
    out: dict[str, Any] = {}
    trainable = table["trainable"].to_numpy(dtype=bool)
    for a, b in pairs:
        if a not in routing or b not in routing:
            continue
        experts_a, margin_a = routing[a]
        experts_b, margin_b = routing[b]
        log_ratio = table[f"logp_{a}"].to_numpy(np.float64) - table[f"logp_{b}"].to_numpy(np.float64)
        keep = trainable & ~np.isnan(log_ratio) & (experts_a[:, 0, 0] >= 0) & (experts_b[:, 0, 0] >= 0)
        flipped_TL = np.any(experts_a[keep] != experts_b[keep], axis=-1)  # [tokens, layers]
        near = np.fmin(margin_a[keep], margin_b[keep])                     # the closer call of the two
        any_flip = flipped_TL.any(axis=1)
        out[f"{a}/{b}"] = {
            "n_tokens": int(keep.sum()),
            "moe_layers": int(flipped_TL.shape[1]),
            "flip_rate_by_layer": [float(x) for x in flipped_TL.mean(axis=0)] if keep.any() else [],
            "flip_rate": float(flipped_TL.mean()) if keep.any() else None,
            "frac_tokens_with_flip": float(any_flip.mean()) if keep.any() else None,
            "margin_at_flips_median": float(np.median(near[flipped_TL])) if flipped_TL.any() else None,
            "margin_median": float(np.median(near)) if keep.any() else None,
            "with_flip": _gap(log_ratio[keep][any_flip]),
            "without_flip": _gap(log_ratio[keep][~any_flip]),
        }
    return out


def _gap(log_ratio: np.ndarray) -> dict[str, Any]:
    """The gap on a set of tokens: count, mean |log-ratio|, k3 and the share of the pair's k3 sum."""
    if not len(log_ratio):
        return {"n_tokens": 0, "log_ratio_abs_mean": None, "kl_k3": None, "k3_sum": 0.0}
    k3 = terms.k3(log_ratio)
    return {"n_tokens": len(log_ratio), "log_ratio_abs_mean": float(np.mean(np.abs(log_ratio))),
            "kl_k3": float(np.mean(k3)), "k3_sum": float(np.sum(k3))}


def routing_share(pair: dict[str, Any]) -> float | None:
    """The share of the pair's k3 (summed over tokens) carried by tokens with a routing flip."""
    total = pair["with_flip"]["k3_sum"] + pair["without_flip"]["k3_sum"]
    return pair["with_flip"]["k3_sum"] / total if total > 0 else None


def merged_routing(blocks: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The shards' routing agreement (each one's summary.json `routing`, empty where it has none) as
    one run's: counts, rates and gaps combine exactly (each is a sum over tokens); the margin medians
    do not, and are left out, said in `not_merged`."""
    pairs = dict.fromkeys(pair for block in blocks for pair in block)
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for pair in pairs:
        parts = [block[pair] for block in blocks if pair in block and block[pair]["n_tokens"]]
        n = sum(part["n_tokens"] for part in parts)
        if not n:
            continue
        layers = parts[0]["moe_layers"]
        by_layer = [sum(part["flip_rate_by_layer"][i] * part["n_tokens"] for part in parts) / n for i in range(layers)]
        out[pair] = {
            "n_tokens": n, "moe_layers": layers, "flip_rate_by_layer": by_layer,
            "flip_rate": float(np.mean(by_layer)),
            "frac_tokens_with_flip": sum(p["frac_tokens_with_flip"] * p["n_tokens"] for p in parts) / n,
            "margin_at_flips_median": None, "margin_median": None,
            "with_flip": _merged_gap([p["with_flip"] for p in parts]),
            "without_flip": _merged_gap([p["without_flip"] for p in parts]),
            "not_merged": ["margin_at_flips_median", "margin_median"],
        }
    return out


def _merged_gap(parts: list[dict[str, Any]]) -> dict[str, Any]:
    n = sum(part["n_tokens"] for part in parts)
    if not n:
        return {"n_tokens": 0, "log_ratio_abs_mean": None, "kl_k3": None, "k3_sum": 0.0}
    k3_sum = sum(part["k3_sum"] for part in parts)
    abs_sum = sum(part["log_ratio_abs_mean"] * part["n_tokens"] for part in parts if part["n_tokens"])
    return {"n_tokens": n, "log_ratio_abs_mean": abs_sum / n, "kl_k3": k3_sum / n, "k3_sum": k3_sum}
