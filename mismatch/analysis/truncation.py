"""Truncated sampling read from the token table: does every stored log-prob sit above the replay's
by the −log of a kept mass, as top-p / top-k / min-p processed log-probs do? (summary
`alignment.truncation`, gathered by the alignment check's pass.)

Terms. Per trainable token, d = stored − replayed (nats). A sampler that truncates to a kept set S
and stores processed log-probs stores log p(t) − log m, m = p(S) ≤ 1 (vLLM `processed_logprobs`), so
d = −log m ≥ 0 for every token, whatever its probability: the ratio p/q is the kept mass m. A
temperature T < 1 instead raises likely tokens and lowers unlikely ones (log q = log p / T − log Z),
T > 1 the reverse; raw log-probs scatter d around 0 both ways. So truncation is: almost no token
lowered, a good share raised, and no unlikely token lowered. Its parameter needs the replay's whole
distribution at each position (`mismatch.replay.truncation`), not one token's log-prob.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MOVED = 1e-4            # nats: |d| beyond this is a move, not rounding of one precision's replay
UNLIKELY_LOGP = math.log(0.2)  # tokens a temperature < 1 lowers (their share is small on a peaky model)
RAISED_MIN = 0.2        # share of tokens raised that can be a truncation's (the rest kept almost all the mass)
LOWERED_MAX = 0.05      # share of tokens lowered a truncation leaves (rounding where m ~ 1)
UNLIKELY_LOWERED_MAX = 0.1
MIN_TOKENS = 20
MASS_BINS = np.linspace(0.0, 1.0, 1001)  # kept mass histogram (mergeable quantiles, 0.001 wide)


class TruncationEvidence:
    """Counts of tokens raised and lowered, unlikely ones lowered, and the kept mass m = exp(−d)
    of the raised ones (sum and histogram), added chunk by chunk and merged."""

    def __init__(self) -> None:
        self.n = self.raised = self.lowered = self.unlikely = self.unlikely_lowered = 0
        self.mass_sum = 0.0  # over all n tokens, m clipped to 1 (a lowered token kept everything)
        self.mass_hist = np.zeros(len(MASS_BINS) - 1, dtype=np.int64)

    def add(self, stored: np.ndarray, replayed: np.ndarray) -> None:
        ok = np.isfinite(stored) & np.isfinite(replayed) & (stored <= 0)
        d = stored[ok] - replayed[ok]
        raised, lowered = d > MOVED, d < -MOVED
        unlikely = replayed[ok] < UNLIKELY_LOGP
        self.n += len(d)
        self.raised += int(raised.sum())
        self.lowered += int(lowered.sum())
        self.unlikely += int(unlikely.sum())
        self.unlikely_lowered += int((unlikely & lowered).sum())
        mass = np.exp(-np.maximum(d, 0.0))
        self.mass_sum += float(mass.sum())
        self.mass_hist += np.histogram(mass[raised], bins=MASS_BINS)[0]

    def merge(self, other: TruncationEvidence) -> None:
        for name in ("n", "raised", "lowered", "unlikely", "unlikely_lowered", "mass_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.mass_hist += other.mass_hist

    def result(self) -> dict[str, Any]:
        """{truncated, n_tokens, frac_raised, frac_lowered, frac_unlikely_lowered, kept_mass_mean,
        kept_mass_q01 (of raised tokens: a top-p's p lies at or under it)}."""
        n = max(self.n, 1)
        frac_raised, frac_lowered = self.raised / n, self.lowered / n
        unlikely_lowered = self.unlikely_lowered / self.unlikely if self.unlikely else 0.0
        truncated = (self.n >= MIN_TOKENS and frac_raised >= RAISED_MIN and frac_lowered <= LOWERED_MAX
                     and unlikely_lowered <= UNLIKELY_LOWERED_MAX)
        return {"truncated": truncated, "n_tokens": self.n, "frac_raised": frac_raised,
                "frac_lowered": frac_lowered, "frac_unlikely_lowered": unlikely_lowered,
                "kept_mass_mean": self.mass_sum / n if self.n else None,
                "kept_mass_q01": _quantile(self.mass_hist, 0.01)}


def _quantile(hist: np.ndarray, q: float) -> float | None:
    """The lower edge of the bin holding the q-quantile of a MASS_BINS histogram."""
    total = int(hist.sum())
    if not total:
        return None
    index = int(np.searchsorted(np.cumsum(hist), q * total, side="left"))
    return float(MASS_BINS[min(index, len(hist) - 1)])


RATIO_BAND = (0.9, 1.1)  # TRL #7269 reports the share of tokens outside it, before and after replay
RATIO_PAIRS = {"without_replay": ("train", "sampler"), "with_replay": ("train_processed", "sampler")}


class KeptMassRatios:
    """An Analysis of pass 0: per pair, the token ratio's mean and its share outside RATIO_BAND
    over trainable tokens, for the trainer raw (`without_replay`: the ratio carries the kept mass)
    and renormalized over the sampler's kept set (`with_replay`, the train_processed column)."""

    def __init__(self) -> None:
        self.sums = {name: np.zeros(3) for name in RATIO_PAIRS}  # [n, sum ratio, n outside]

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Any, index: int) -> None:
        table = chunk.table
        trainable = table["trainable"].to_numpy()
        for name, (a, b) in RATIO_PAIRS.items():
            if f"logp_{a}" not in table or f"logp_{b}" not in table:
                continue
            log_ratio = table[f"logp_{a}"].to_numpy()[trainable] - table[f"logp_{b}"].to_numpy()[trainable]
            ratio = np.exp(log_ratio[np.isfinite(log_ratio)])
            outside = (ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])
            self.sums[name] += [len(ratio), ratio.sum(), outside.sum()]

    def merge(self, other: KeptMassRatios, index: int) -> None:
        for name in self.sums:
            self.sums[name] += other.sums[name]

    def result(self) -> dict[str, Any]:
        return {name: {"pair": "/".join(RATIO_PAIRS[name]), "n_tokens": int(n), "ratio_mean": total / n,
                       "frac_outside_0.9_1.1": outside / n}
                for name, (n, total, outside) in self.sums.items() if n}
