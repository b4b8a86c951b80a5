"""The tokens a correction is simulated on: trainable, non-NaN tokens cut into spans, with the
per-span and per-sequence terms the modes read (correction_modes.py), made from numpy arrays,
lists or torch tensors (never importing torch)."""

from __future__ import annotations

import sys
from functools import cached_property
from typing import Any

import numpy as np

from mismatch.analysis import terms
from mismatch.analysis.groups import Spans, find_spans
from mismatch.analysis.pair_tokens import PairTokens
from mismatch.errors import MismatchError

# verl's SAFETY_BOUND for rejection statistics (verl/trainer/ppo/rollout_corr_helper.py).
VERL_SAFETY_BOUND = 20.0


class CorrectionTokens:
    """Trainable, non-NaN tokens cut into spans that never cross a sequence, a rollout or a turn.

    A mode's weight is either per token or, for modes that weigh whole sequences or rollouts,
    per span (`ModeSpec.per_span`): such weights are constant over a span, and working on ~1e5
    spans instead of ~1e7 tokens is what keeps the 41 default corrections cheap.
    """

    def __init__(self, log_ratio: np.ndarray, spans: Spans, *, span_seq: np.ndarray,
                 num_seqs: int, span_rollout: np.ndarray, num_rollouts: int,
                 turn: tuple[np.ndarray, np.ndarray] | None = None,
                 span_stats: dict[str, np.ndarray] | None = None,
                 logp: tuple[np.ndarray, np.ndarray] | None = None,
                 pair: PairTokens | None = None) -> None:
        self.log_ratio = log_ratio  # log pi_train - log pi_sampler, one per token, in span order
        self.logp = logp  # (logp_train, logp_sampler) per token, for the probability-gap modes
        # The chunk's pair of these very tokens (log_ratio is its own), when the caller has one: its
        # ratio, probabilities and k3 are the ones the other analyses of the chunk made (the same bits).
        self.pair = pair
        self._verl_stats: dict[str, np.ndarray] = {}
        self.num_tokens = spans.num_tokens
        self.spans = spans
        self.span_seq, self.num_seqs = span_seq, num_seqs
        self.span_rollout, self.num_rollouts = span_rollout, num_rollouts
        self.turn = turn  # (distinct turn keys, turn code of each span), or None
        # Tokens per rollout of these tokens (N / R); a chunk's sums are rescaled to the run's
        # (_CorrectionSums, ModeSpec.balanced).
        self.balance = self.num_tokens / max(num_rollouts, 1)
        if span_stats is not None:  # the metrics' own per-span sums, when the caller has them
            self.__dict__["span_stats"] = span_stats

    @cached_property
    def ratio(self) -> np.ndarray:
        if self.pair is not None:
            return self.pair.ratio
        with np.errstate(over="ignore"):
            return np.exp(self.log_ratio)

    def per_seq(self, per_span: np.ndarray) -> np.ndarray:
        return np.bincount(self.span_seq, weights=per_span, minlength=self.num_seqs)

    @cached_property
    def seq_count(self) -> np.ndarray:
        return self.per_seq(self.spans.lengths)

    @cached_property
    def span_stats(self) -> dict[str, np.ndarray]:
        """Per span: sum, min and max of the log-ratio (keys as span_sums.span_sums)."""
        return {"log_ratio": self.spans.sum(self.log_ratio), "log_ratio_min": self.spans.min(self.log_ratio),
                "log_ratio_max": self.spans.max(self.log_ratio)}

    @property
    def span_log_ratio(self) -> np.ndarray:
        return self.span_stats["log_ratio"]

    def seq_ratio_range(self) -> tuple[np.ndarray, np.ndarray]:
        """Per span: the smallest and largest token ratio of its sequence (exp is monotonic, so
        exp(min log_ratio) is min(ratio) bit for bit)."""
        low, high = np.full(self.num_seqs, np.inf), np.full(self.num_seqs, -np.inf)
        np.minimum.at(low, self.span_seq, self.span_stats["log_ratio_min"])
        np.maximum.at(high, self.span_seq, self.span_stats["log_ratio_max"])
        with np.errstate(over="ignore"):
            return np.exp(low)[self.span_seq], np.exp(high)[self.span_seq]

    @cached_property
    def seq_sum(self) -> np.ndarray:
        """Per span: the sum of its sequence's log-ratios (TRL/verl sequence level)."""
        return self.per_seq(self.span_log_ratio)[self.span_seq]

    @cached_property
    def seq_mean(self) -> np.ndarray:
        """Per span: the mean of its sequence's log-ratios (the geometric mean, in log space)."""
        return (self.per_seq(self.span_log_ratio) / np.maximum(self.seq_count, 1))[self.span_seq]

    @cached_property
    def rollout_sum(self) -> np.ndarray:
        """Per span: the sum of its rollout's log-ratios."""
        return np.bincount(self.span_rollout, weights=self.span_log_ratio, minlength=self.num_rollouts)[self.span_rollout]

    @cached_property
    def verl_span_stats(self) -> dict[str, np.ndarray]:
        """Per span: sums (k1, k2, k3) and maxima (k1_max, k2_max, k3_max) of verl's estimators."""
        stats = {}
        for estimator in ("k1", "k2", "k3"):
            values = verl_stat(self, estimator)
            stats[estimator], stats[f"{estimator}_max"] = self.spans.sum(values), self.spans.max(values)
        return stats

    def spread(self, per_span: np.ndarray) -> np.ndarray:
        return self.spans.spread(per_span)

    @cached_property
    def prob_gap(self) -> np.ndarray:
        """pi_train - pi_sampler of each token (signed)."""
        if self.logp is None:
            raise MismatchError("probability-gap corrections (ipo_mask, dppo_*) need both log-probs, "
                                "not only their log-ratio: pass logp_train and logp_sampler")
        logp_train, logp_sampler = self.logp
        with np.errstate(over="ignore", invalid="ignore"):
            if self.pair is not None:
                return self.pair.prob_a - self.pair.prob_b
            return np.exp(logp_train) - np.exp(logp_sampler)

    @cached_property
    def verl_log_ratio(self) -> np.ndarray:
        """The log-ratio clamped at +-VERL_SAFETY_BOUND: itself when no token is past the bound
        (the span extremes say so without a pass over the tokens)."""
        stats = self.span_stats
        if self.num_tokens and -VERL_SAFETY_BOUND <= stats["log_ratio_min"].min() \
                and stats["log_ratio_max"].max() <= VERL_SAFETY_BOUND:
            return self.log_ratio
        return np.clip(self.log_ratio, -VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)

    def verl_stat(self, estimator: str) -> np.ndarray:
        """verl_stat, made once per estimator: the token modes and the span sums share it."""
        if estimator not in self._verl_stats:
            log_ratio = self.verl_log_ratio
            if estimator == "k3" and self.pair is not None and log_ratio is self.log_ratio:
                self._verl_stats[estimator] = self.pair.k3  # k3 of these very values
            else:
                self._verl_stats[estimator] = {"k1": terms.k1, "k2": terms.k2, "k3": terms.k3}[estimator](log_ratio)
        return self._verl_stats[estimator]


def verl_stat(t: CorrectionTokens, estimator: str) -> np.ndarray:
    """verl's rejection statistic (k1, k2 or k3) of each token, on the log-ratio clamped at +-20."""
    return t.verl_stat(estimator)


# --- input handling: numpy or torch, never importing torch ourselves ---

def is_tensor(values: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor cannot exist unless torch is already imported
    return torch is not None and isinstance(values, torch.Tensor)


def to_numpy(values: Any) -> np.ndarray:
    if is_tensor(values):
        values = values.detach()
        if values.is_floating_point():
            values = values.double()  # bf16 has no numpy dtype
        return values.cpu().numpy()
    return np.asarray(values)


def _codes(keys: Any) -> tuple[np.ndarray, int]:
    """Integer codes 0..n-1 for sortable keys (ints, strings), in sorted key order."""
    keys = to_numpy(keys)
    _, codes = np.unique(keys, return_inverse=True)
    codes = codes.reshape(-1).astype(np.int64)
    return codes, int(codes.max()) + 1 if len(codes) else 0


def prepare_tokens(log_ratio: Any, *, seq: Any, rollout: Any, trainable: Any | None, turn: Any | None = None,
                   logp_sampler: Any | None = None) -> tuple[CorrectionTokens, np.ndarray]:
    """The tokens to correct, and which of the given ones they are."""
    log_ratio = to_numpy(log_ratio).astype(np.float64, copy=False)
    arrays = {"seq": to_numpy(seq), "rollout": to_numpy(rollout)}
    if logp_sampler is not None:
        arrays["logp_sampler"] = to_numpy(logp_sampler).astype(np.float64, copy=False)
    if trainable is not None:
        arrays["trainable"] = to_numpy(trainable).astype(bool)
    if turn is not None:
        arrays["turn"] = to_numpy(turn)
    if log_ratio.ndim != 1 or any(a.shape != log_ratio.shape for a in arrays.values()):
        shapes = ", ".join(f"{k} {a.shape}" for k, a in arrays.items())
        raise ValueError(f"corrections need 1-D arrays of one length; got log_ratio {log_ratio.shape}, {shapes}")
    keep = ~np.isnan(log_ratio)  # no stored sampler log-prob: nothing to correct
    if "trainable" in arrays:
        keep &= arrays["trainable"]
    seq_codes, num_seqs = _codes(arrays["seq"][keep])
    rollout_codes, num_rollouts = _codes(arrays["rollout"][keep])
    keys = [seq_codes, rollout_codes]
    if turn is not None:
        turn_keys, turn_codes = np.unique(arrays["turn"][keep], return_inverse=True)
        keys.append(turn_codes.reshape(-1))
    spans = find_spans(keys, int(keep.sum()))
    logp = None
    if logp_sampler is not None:
        sampler = arrays["logp_sampler"][keep]
        logp = (sampler + log_ratio[keep], sampler)
    tokens = CorrectionTokens(log_ratio[keep], spans, span_seq=seq_codes[spans.starts], num_seqs=num_seqs,
                              span_rollout=rollout_codes[spans.starts], num_rollouts=num_rollouts,
                              turn=(turn_keys, keys[2][spans.starts]) if turn is not None else None, logp=logp)
    return tokens, keep
