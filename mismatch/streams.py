"""What a replay sends an engine and what comes back beside the log-probs: pure data, below the
engines, the replay and the analysis alike (each of them reads these, none owns them): the streams
to replay, the routing recorded, and the sampler's processing a torch engine is asked to apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass(kw_only=True, slots=True, frozen=True)
class Sampling:
    """The sampler's logit processing, in vLLM's order: temperature, then top-k, then top-p."""

    temperature: float = 1.0
    top_k: int = -1       # -1 or 0: off
    top_p: float = 1.0    # 1.0: off

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> Sampling:
        """From `meta.sampler` (temperature, top_k, top_p; missing keys mean off)."""
        meta = meta or {}
        return cls(temperature=float(meta.get("temperature", 1.0) or 1.0),
                   top_k=int(meta.get("top_k", -1) if meta.get("top_k") is not None else -1),
                   top_p=float(meta.get("top_p", 1.0) if meta.get("top_p") is not None else 1.0))

    @property
    def is_identity(self) -> bool:
        return self.temperature == 1.0 and self.top_k <= 0 and self.top_p >= 1.0
