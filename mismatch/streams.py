"""What a replay sends an engine and what comes back beside the log-probs: pure data, below the
engines, the replay and the analysis alike (each of them reads these, none owns them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(kw_only=True, slots=True, frozen=True)
class ReplayRequest:
    """One stream to replay: the branch's context followed by its own tokens."""

    tokens: np.ndarray     # int64 [L]
    generated: np.ndarray  # bool [L]: sampled by the model (decode path), else prompt (prefill)
    score_from: int        # log-probs are wanted for positions score_from..L-1

    @property
    def num_scored(self) -> int:
        return len(self.tokens) - self.score_from


@dataclass(slots=True)
class StreamRouting:
    """One stream's routing: per fed position and MoE layer, the top-k experts (sorted, so two
    passes compare as sets) and the router's score margin between the k-th and the (k+1)-th expert
    (`choice_scores`; NaN where unknown, as in routing stored by the rollout engine)."""

    experts: np.ndarray  # int16 [positions, layers, k]
    margin: np.ndarray   # float32 [positions, layers]
