"""A pair's tokens as every framework's metrics read them (PairArrays), and the terms those
metrics share: verl's and slime's +-20 clamp, both sides' probabilities."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import numpy as np

from mismatch.analysis import terms
from mismatch.analysis.pair_tokens import PairTokens


SAFETY_BOUND = 20.0  # verl and slime clamp log-ratios to +-20 before exp (rollout_corr_helper.py:75)


class PairArrays:
    """A pair's trainable tokens with both log-probs defined, and their sequence and rollout
    (codes 0..k-1 in table order); the log-ratio and the group sizes are made once."""

    def __init__(self, logp_a: np.ndarray, logp_b: np.ndarray, seq: np.ndarray, rollout: np.ndarray,
                 log_ratio: np.ndarray | None = None, tokens: PairTokens | None = None) -> None:
        self.logp_a = logp_a    # the trainer side (log pi_train in the frameworks' terms)
        self.logp_b = logp_b    # the rollout side (log pi_rollout)
        self.seq = seq          # each token's sequence (one branch of one rollout)
        self.rollout = rollout  # each token's rollout
        self.log_ratio = logp_a - logp_b if log_ratio is None else log_ratio
        # The chunk's PairTokens of these very arrays, when made from one: its ratio, k3 and
        # |pi_A - pi_B| are the ones the span sums already made.
        self.tokens = tokens
        self._counts = {id(seq): np.bincount(seq), id(rollout): np.bincount(rollout)}
        self._starts = {id(codes): _run_starts(codes, self._counts[id(codes)]) for codes in (seq, rollout)}
        self._means: dict[tuple[int, int, float], np.ndarray] = {}
        self._memo: dict[object, np.ndarray] = {}

    def memo(self, key: object, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """compute(), made once per pair and kept under `key`: a term several metrics of one
        setting share (verl's raw and applied IS weights feed eleven of its keys)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    # Terms several metrics share, made once per pair.
    @cached_property
    def ratio(self) -> np.ndarray:
        return self.tokens.ratio if self.tokens is not None else terms.ratio(self.log_ratio)

    @cached_property
    def k1(self) -> np.ndarray:
        return terms.k1(self.log_ratio)

    @cached_property
    def k3(self) -> np.ndarray:
        return self.tokens.k3 if self.tokens is not None else terms.k3(self.log_ratio)

    @cached_property
    def abs_log_ratio(self) -> np.ndarray:
        return self.tokens.abs_log_ratio if self.tokens is not None else np.abs(self.log_ratio)

    @cached_property
    def clamped_ratio(self) -> np.ndarray:
        """exp(log-ratio clamped to +-SAFETY_BOUND): verl's raw IS weight per token. Inside the
        bound the clamp changes nothing, so it is the ratio there (the same exp of the same value:
        the same bits), and exp runs again only on the few tokens past it."""
        log_ratio = self.log_ratio
        far = self.abs_log_ratio > SAFETY_BOUND
        if not far.any():
            return self.ratio
        clamped = self.ratio.copy()
        clamped[far] = np.exp(np.clip(log_ratio[far], -SAFETY_BOUND, SAFETY_BOUND))
        return clamped

    @cached_property
    def clamped_ratio_sq(self) -> np.ndarray:
        """exp(log-ratio clamped to +-SAFETY_BOUND)^2, verl's and slime's chi-square term."""
        return np.square(self.clamped_ratio)

    @cached_property
    def prob_abs_diff(self) -> np.ndarray:
        return self.tokens.prob_abs_diff if self.tokens is not None else terms.prob_abs_diff(self.logp_a, self.logp_b)

    @cached_property
    def seq_log_ratio(self) -> np.ndarray:
        """Each sequence's log-ratio summed (its sequence-level log importance ratio)."""
        return self._sums(self.seq, self.log_ratio)

    def per(self, codes: np.ndarray, values: np.ndarray, eps: float = 0.0) -> np.ndarray:
        """Mean of `values` per code (`seq` or `rollout`), `eps` added to each count (verl's
        masked_mean divides by count + 1e-8); kept for the pair's own log-prob arrays, which several
        metrics average per sequence."""
        own = values is self.logp_a or values is self.logp_b
        key = (id(codes), id(values), eps)
        if own and key in self._means:
            return self._means[key]
        means = self._sums(codes, values) / (self._counts[id(codes)] + eps)
        if own:
            self._means[key] = means
        return means

    def _sums(self, codes: np.ndarray, values: np.ndarray) -> np.ndarray:
        counts, starts = self._counts[id(codes)], self._starts[id(codes)]
        return np.bincount(codes, weights=values, minlength=len(counts)) if starts is None else \
            np.add.reduceat(values, starts)


def _run_starts(codes: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
    """Where each code's run begins when the codes are 0, 0, 1, 2, 2, ... (every code present, in
    order: a chunk's sequences and rollouts are), so a sum per code is a sum per run (reduceat,
    far faster than a weighted bincount); None otherwise."""
    if not len(codes) or not counts.all() or (len(codes) > 1 and (codes[1:] < codes[:-1]).any()):
        return None
    return np.concatenate([[0], np.cumsum(counts)[:-1]])


def clamped(p: PairArrays) -> np.ndarray:
    return np.clip(p.log_ratio, -SAFETY_BOUND, SAFETY_BOUND)


def probs(p: PairArrays) -> np.ndarray:
    """[2, tokens]: pi_train and pi_rollout (the chunk's, when the arrays are its pair's: exp once)."""
    if p.tokens is not None:
        return np.stack([p.tokens.prob_a, p.tokens.prob_b])
    return np.exp(np.stack([p.logp_a, p.logp_b]))
