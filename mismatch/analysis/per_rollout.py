"""rollouts.parquet's metrics: PAIR_METRICS per pair and rollout, chunk by chunk (a rollout lies in
one chunk, so each rollout's metrics are its chunk's).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from mismatch.analysis.chunked import Chunk, Chunks, run_passes
from mismatch.analysis.metrics import PAIR_METRICS, grouped_view_metrics


class PerRollout:
    """rollouts.parquet: `pair`, `rollout`, PAIR_METRICS per pair and rollout, chunk by chunk (a
    rollout lies in one chunk, so each one's metrics, quantiles included, are its chunk's)."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self.pairs = list(pairs)
        self.frames: list[pd.DataFrame] = []

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        for a, b in self.pairs:
            frame = grouped_view_metrics(chunk.view(), f"logp_{a}", f"logp_{b}", ["rollout"])
            frame.insert(0, "pair", f"{a}/{b}")
            self.frames.append(frame)

    def merge(self, other: PerRollout, index: int) -> None:
        self.frames.extend(other.frames)

    def result(self) -> pd.DataFrame:
        if not self.frames:
            return pd.DataFrame(columns=["pair", "rollout", *PAIR_METRICS])
        out = pd.concat(self.frames, ignore_index=True)
        # metrics_by's order: pair by pair, rollouts sorted by key.
        pair_order = {f"{a}/{b}": index for index, (a, b) in enumerate(self.pairs)}
        rollout_codes, _ = pd.factorize(out["rollout"].astype(str), sort=True, use_na_sentinel=False)
        order = np.lexsort((rollout_codes, out["pair"].map(pair_order).to_numpy()))
        return out.iloc[order].reset_index(drop=True)


def per_rollout_metrics(chunks: Chunks, pairs: Sequence[tuple[str, str]]) -> pd.DataFrame:
    """PerRollout of a table's chunks."""
    found = PerRollout(pairs)
    run_passes(chunks, [found])
    return found.result()
