"""The worst rollouts, token by token: ranked by their largest |log-ratio| on one pair.

Only these rollouts carry per-token detail into the page, and a long one only windows around its
worst tokens, so the page stays small however many rollouts were audited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np
import pandas as pd

from mismatch.reports.aggregate import pair_roles


@dataclass(kw_only=True, slots=True, frozen=True)
class WorstOptions:
    num_rollouts: int = 12          # rollouts with token detail
    max_tokens_per_rollout: int = 1500
    context: int = 48               # tokens kept on each side of a bad token in a long rollout


class RankedRollout(TypedDict):
    """A rollout as the digest ranks them (reports/digest.py _rollout_rank): its worst token's
    |log-ratio| on the focus pair, its mean k3 and its scored tokens."""

    rollout: str
    max_abs_log_ratio: float
    kl_k3_mean: float
    n_scored: int


class BranchRef(TypedDict):
    id: str
    kind: str


class RolloutDetail(TypedDict):
    """One worst rollout in the page's JSON (report.js draws it): its scores, then its shown rows
    as columns (`row`: their index in the rollout; branch and role as indices into `branches` and
    `roles`), each role's log-prob and each pair's log-ratio per shown row (null: not scored)."""

    rollout: str
    max_abs_log_ratio: float
    kl_k3_mean: float | None
    n_scored: int
    n_rows: int
    row: list[int]
    branches: list[BranchRef]
    branch: list[int]
    roles: list[str]
    role: list[int]
    segment: list[int]
    turn: list[int]
    pos: list[int]
    token_id: list[int]
    trainable: list[int]
    logp: dict[str, list[float | None]]  # role -> per shown row
    log_ratio: dict[str, list[float | None]]  # pair -> per shown row


class WorstBlock(TypedDict):
    """The page's `worst` data: the top rollouts token by token, how they were ranked, each pair's
    color scale (|log-ratio| at full color) and each shown token id's text (None: no tokenizer)."""

    focus: str
    pairs: list[str]
    roles: list[str]
    rank_by: str
    num_ranked: int
    rollouts: list[RolloutDetail]
    scale: dict[str, float]
    text: dict[str, str] | None


def logp_roles(tokens: pd.DataFrame) -> list[str]:
    return [str(c)[len("logp_"):] for c in tokens.columns if str(c).startswith("logp_")]


def select_rows(abs_log_ratio: np.ndarray, *, budget: int, context: int) -> np.ndarray:
    """Indices to show of one rollout: all of it if it fits, else windows around its worst tokens."""
    num = len(abs_log_ratio)
    if num <= budget:
        return np.arange(num)
    keep = np.zeros(num, dtype=bool)
    kept = 0
    # Worst first; NaN (a context token) sorts last, so windows open on scored tokens first.
    order = np.argsort(-np.nan_to_num(abs_log_ratio, nan=-1.0), kind="stable")
    for center in order:
        if kept >= budget:
            break
        # The last window shrinks to what is left of the budget rather than cutting an earlier one.
        for half in range(context, -1, -1):
            window = slice(max(0, center - half), center + half + 1)
            added = int((~keep[window]).sum())
            if kept + added <= budget:
                keep[window] = True
                kept += added
                break
    return np.flatnonzero(keep)


def _rounded(values: np.ndarray, digits: int) -> list[float | None]:
    # Display precision only: the page shows these numbers, it never recomputes metrics from them.
    return [float(f"{v:.{digits}g}") if math.isfinite(v) else None for v in values.tolist()]


def rollout_detail(rows: pd.DataFrame, *, pairs: list[str], roles: list[str],
                   ranked: RankedRollout, focus: str, options: WorstOptions) -> RolloutDetail:
    """One rollout's shown tokens as columns (JSON arrays), with its branches and scores."""
    a, b = (f"logp_{role}" for role in pair_roles(focus))
    focus_abs = np.abs(rows[a].to_numpy(np.float64) - rows[b].to_numpy(np.float64))
    focus_abs[~rows["trainable"].to_numpy(dtype=bool)] = np.nan
    shown = select_rows(focus_abs, budget=options.max_tokens_per_rollout, context=options.context)
    rows = rows.iloc[shown]
    # Python lists (tolist, one call), not the str columns iterated: that is a call per value.
    row_branches = list(zip(rows["branch"].astype(str).tolist(), rows["branch_kind"].astype(str).tolist()))
    row_roles = rows["role"].astype(str).tolist()
    branch_keys = list(dict.fromkeys(row_branches))
    branch_index = {key: i for i, key in enumerate(branch_keys)}
    role_names = sorted(set(row_roles))
    role_index = {name: i for i, name in enumerate(role_names)}
    log_ratio: dict[str, list[float | None]] = {}
    for pair in pairs:
        pa, pb = (f"logp_{role}" for role in pair_roles(pair))
        log_ratio[pair] = _rounded(rows[pa].to_numpy(np.float64) - rows[pb].to_numpy(np.float64), 4)
    return {
        "rollout": str(ranked["rollout"]),
        "max_abs_log_ratio": float(ranked["max_abs_log_ratio"]),
        "kl_k3_mean": float(ranked["kl_k3_mean"]) if math.isfinite(ranked["kl_k3_mean"]) else None,
        "n_scored": int(ranked["n_scored"]),
        "n_rows": len(focus_abs),
        "row": shown.tolist(),
        "branches": [{"id": bid, "kind": kind} for bid, kind in branch_keys],
        "branch": [branch_index[key] for key in row_branches],
        "roles": role_names,
        "role": [role_index[role] for role in row_roles],
        "segment": rows["segment"].astype(int).tolist(),
        "turn": rows["turn"].astype(int).tolist(),
        "pos": rows["pos"].astype(int).tolist(),
        "token_id": rows["token_id"].astype(int).tolist(),
        "trainable": rows["trainable"].astype(int).tolist(),
        "logp": {role: _rounded(rows[f"logp_{role}"].to_numpy(np.float64), 6) for role in roles},
        "log_ratio": log_ratio,
    }


def token_texts(token_ids: set[int], tokenizer_path: Path | None) -> dict[str, str] | None:
    """Each token id's own text, decoded alone (tokenizers only: no torch, no transformers)."""
    if tokenizer_path is None or not tokenizer_path.is_file():
        return None
    from tokenizers import Tokenizer  # the Rust tokenizer: loads in milliseconds

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = sorted(token_ids)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    known = [i for i in ids if 0 <= i < vocab_size]
    texts = tokenizer.decode_batch([[i] for i in known], skip_special_tokens=False)
    return {str(i): text for i, text in zip(known, texts)}


def color_scale(details: list[RolloutDetail], pair: str) -> float:
    """|log-ratio| that gets full color: the 99th percentile of the shown scored tokens (every
    detail has every pair of the page: rollout_detail's `pairs`)."""
    values = np.abs(np.asarray([v for d in details for v in d["log_ratio"][pair] if v is not None],
                               dtype=np.float64))
    values = values[np.isfinite(values) & (values > 0)]
    return float(np.quantile(values, 0.99)) if len(values) else 1.0
