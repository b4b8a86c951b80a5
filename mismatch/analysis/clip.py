"""The gap against the PPO clip range the user trains with: the share of tokens whose ratio the
mismatch alone pushes out of [1 - eps_low, 1 + eps_high], per pair, turn and branch kind.

Flow: per-span counts of tokens outside the range (analysis/grouped_metrics.py) + ClipRange ->
summary.json["clip"] -> the terminal's line and the report's banner (mismatch.present.headline).
On-policy the PPO ratio would be exactly 1; every token the mismatch moves past the clip bound
gets no gradient from the clipped side of the objective, whatever its advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from mismatch.results.chunks import table_chunks
from mismatch.analysis.grouped_metrics import OVERALL, GroupedPairMetrics, run_grouped_metrics
from mismatch.errors import MismatchError

BREAKDOWNS = {"turn": "turns", "branch_kind": "branch_kinds"}


@dataclass(kw_only=True, slots=True, frozen=True)
class ClipRange:
    """PPO's clip: ratios in [1 - low, 1 + high] are inside (DAPO-style clip-higher: high > low)."""

    low: float = 0.2
    high: float = 0.2

    @classmethod
    def parse(cls, text: str) -> ClipRange:
        """"0.2" (symmetric) or "0.2,0.28" (eps_low, eps_high)."""
        parts = [part.strip() for part in text.split(",")]
        try:
            values = [float(part) for part in parts]
        except ValueError:
            values = []
        if len(values) not in (1, 2) or not all(0 < v < 1 for v in values):
            raise MismatchError(f"--clip-eps {text!r}: expected EPS or EPS_LOW,EPS_HIGH, each in (0, 1), "
                                "e.g. 0.2 or 0.2,0.28")
        return cls(low=values[0], high=values[-1])

    def describe(self) -> str:
        return f"[{1 - self.low:g}, {1 + self.high:g}]"


def clip_summary(clip: ClipRange, found: dict[str, dict[str, pd.DataFrame]]) -> dict[str, Any]:
    """summary.json["clip"]: the clip range and, per pair, the share of tokens outside it overall,
    by turn and by branch kind, from a `GroupedPairMetrics(..., clip=...)`'s results (`found`)."""
    out: dict[str, Any] = {"eps_low": clip.low, "eps_high": clip.high, "range": [1 - clip.low, 1 + clip.high],
                           "pairs": {}, **{key: {} for key in BREAKDOWNS.values()}}
    for name, frame in found[OVERALL].items():
        n, hits = int(frame["n_tokens"].iloc[0]), int(frame["n_outside_clip"].iloc[0])
        out["pairs"][name] = hits / n if n else None
        for by, key in BREAKDOWNS.items():
            if by in found:
                out[key][name] = _by(found[by][name], by)
    return out


def _by(frame: pd.DataFrame, by: str) -> list[dict[str, Any]]:
    """Each group the pair has tokens in: its size and share outside the clip range."""
    return [{by: key.item() if hasattr(key, "item") else key, "n_tokens": int(n), "frac_outside_clip": float(hit / n)}
            for key, n, hit in zip(frame[by], frame["n_tokens"], frame["n_outside_clip"]) if n]


def table_clip_summary(table: pd.DataFrame, pairs: Sequence[tuple[str, str]], clip: ClipRange) -> dict[str, Any]:
    """`clip_summary` of a token table's trainable tokens (one pass over its chunks)."""
    chunks = table_chunks(table)
    accumulator = GroupedPairMetrics(pairs, [by for by in BREAKDOWNS if by in table.columns], trainable_only=True,
                                     clip=(clip.low, clip.high))
    (found,) = run_grouped_metrics(chunks, [accumulator])
    return clip_summary(clip, found)


