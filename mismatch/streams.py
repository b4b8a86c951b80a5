"""What a replay sends an engine and what comes back beside the log-probs: pure data, below the
engines, the replay and the analysis alike (each of them reads these, none owns them): the streams
to replay, the routing recorded, and the sampler's processing a torch engine is asked to apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np


@dataclass(kw_only=True, slots=True, frozen=True)
class ReplayRequest:
    """One stream to replay: the branch's context followed by its own tokens."""

    tokens: np.ndarray     # int64 [L]
    generated: np.ndarray  # bool [L]: sampled by the model (decode path), else prompt (prefill)
    score_from: int        # log-probs are wanted for positions score_from..L-1
    # The sampler's kept set at each scored position where it was recorded (format v1
    # `sampling_mask`), and the truncation meta.sampler declares: what `sampling=replay` renormalizes over.
    kept: KeptSets | None = None
    truncation: Sampling | None = None
    # The key positions the sampler's DSA indexer selected at each position of `tokens` (format v1
    # `indexer_topk`), int32 [L, sparse layers, top-k], rows of -1 where none was recorded: what
    # index replay forces the trainer to (localize/index_flips).
    indexer_topk: np.ndarray | None = None

    @property
    def num_scored(self) -> int:
        return len(self.tokens) - self.score_from


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class KeptSets:
    """The token ids a sampler's truncation kept at each of N positions, CSR as vLLM returns them
    (vllm/v1/outputs.py SamplingMaskLists): position i kept ids[offsets[i]:offsets[i+1]]; an empty
    row is a position with no recorded set (a kept set always holds the sampled token)."""

    offsets: np.ndarray  # int64 [N + 1], offsets[0] == 0, non-decreasing
    ids: np.ndarray      # int32 [offsets[-1]]

    @property
    def num_positions(self) -> int:
        return len(self.offsets) - 1

    @property
    def recorded(self) -> np.ndarray:
        """bool [N]: positions with a recorded kept set."""
        return np.diff(self.offsets) > 0

    @classmethod
    def concat(cls, parts: list[KeptSets | None], lengths: list[int]) -> KeptSets | None:
        """Positions of consecutive parts (a part of None: `lengths[i]` positions recorded none)."""
        if all(part is None for part in parts):
            return None
        counts = [np.diff(p.offsets) if p is not None else np.zeros(n, np.int64) for p, n in zip(parts, lengths)]
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
        ids = [p.ids for p in parts if p is not None]
        return cls(offsets=offsets, ids=np.concatenate(ids).astype(np.int32))

    def slice(self, start: int, stop: int) -> KeptSets:
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return KeptSets(offsets=self.offsets[start:stop + 1] - lo, ids=self.ids[lo:hi])


@dataclass(slots=True)
class StreamRouting:
    """One stream's routing: per fed position and MoE layer, the top-k experts (sorted, so two
    passes compare as sets) and the router's score margin between the k-th and the (k+1)-th expert
    (`choice_scores`; NaN where unknown, as in routing stored by the rollout engine)."""

    experts: np.ndarray  # int16 [positions, layers, k]
    margin: np.ndarray   # float32 [positions, layers]


class _Processing(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """meta.sampler's processing keys (the rest of its keys are not the sampler's processing)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class Sampling:
    """The sampler's logit processing, in vLLM's order: temperature, then min-p (an argmax-invariant
    logits processor, vllm/v1/sample/sampler.py step 7c), then top-k, then top-p."""

    temperature: float = 1.0
    top_k: int = -1       # -1 or 0: off
    top_p: float = 1.0    # 1.0: off
    min_p: float = 0.0    # 0.0: off

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> Sampling:
        """From `meta.sampler` (temperature, top_k, top_p, min_p; missing or null keys mean off, a
        temperature of 0 too: greedy sampling's log-probs are the raw ones). Its values were held to
        these types when the rollouts were read (rollouts/sampling_rules.py)."""
        declared = msgspec.convert(meta or {}, _Processing, strict=False)
        return cls(temperature=float(declared.temperature or 1.0),
                   top_k=declared.top_k if declared.top_k is not None else -1,
                   top_p=declared.top_p if declared.top_p is not None else 1.0,
                   min_p=declared.min_p or 0.0)

    @property
    def truncates(self) -> bool:
        """Whether it drops tokens (top-k, top-p or min-p), whatever its temperature."""
        return 0 < self.top_k or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def truncation(self) -> Sampling:
        """Its truncation alone, at temperature 1."""
        return Sampling(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    @property
    def is_identity(self) -> bool:
        return self.temperature == 1.0 and not self.truncates
