"""Correction simulator: what each framework's importance-sampling fix would do to the measured ratios.

Flow: token table (train/sampler `log_ratio` per trainable token) -> simulate -> summary.json["corrections"].
The modes themselves are correction_modes.py's; the tokens they read, correction_tokens.py's.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mismatch.results import summary_model as model
from mismatch.results.summary_model import CorrectionTurn
from mismatch.advise.correction_modes import DEFAULT_CORRECTIONS, MODES, PROB_GAP_MODES, Correction
from mismatch.advise.correction_tokens import CorrectionTokens, is_tensor, prepare_tokens, to_numpy
from mismatch.analysis.chunked import Chunk, Chunks, run_passes
from mismatch.results.chunks import table_chunks
from mismatch.analysis.groups import dot
from mismatch.analysis.span_sums import span_sums
from mismatch.errors import MismatchError


@dataclass(kw_only=True, slots=True, frozen=True)
class CorrectionResult:
    """What one correction does to the measured tokens (one item of summary.json["corrections"])."""

    mode: str
    params: dict[str, float]
    level: str  # token | sequence | rollout: the unit whose weight the mode decides
    n_tokens: int
    n_sequences: int
    n_rollouts: int
    frac_tokens_affected: float
    frac_sequences_affected: float
    frac_rollouts_affected: float
    weight_mean: float
    weight_std: float
    weight_max: float
    ess: float
    by_turn: list[CorrectionTurn]  # per turn: its tokens, the share touched, their mean weight

    def to_record(self) -> model.Correction:
        """As summary.json's `corrections` lists it: contract keys first (ARCHITECTURE.md, "Results
        dir"), then the extras."""
        return model.Correction(
            mode=self.mode, params=dict(self.params), frac_tokens_affected=self.frac_tokens_affected,
            frac_rollouts_affected=self.frac_rollouts_affected, weight_mean=self.weight_mean,
            weight_max=self.weight_max, ess=self.ess, weight_std=self.weight_std, level=self.level,
            n_tokens=self.n_tokens, n_sequences=self.n_sequences, n_rollouts=self.n_rollouts,
            frac_sequences_affected=self.frac_sequences_affected, by_turn=list(self.by_turn))


def _apply(tokens: CorrectionTokens, correction: Correction) -> tuple[np.ndarray, np.ndarray]:
    """(weight, affected) per token."""
    spec = MODES[correction.mode]
    weight, affected = spec.fn(tokens, **correction.params)
    if spec.per_span:
        weight, affected = tokens.spread(weight), tokens.spread(affected)
    return weight, affected


def correction_weights(log_ratio: Any, correction: Correction, *, seq: Any,
                       rollout: Any | None = None, logp_sampler: Any | None = None) -> tuple[Any, Any]:
    """(weight, affected) per token for one correction, for use inside a trainer.

    `log_ratio`, `seq` (and `rollout`, for the rollout modes) are 1-D and aligned; pass only the
    tokens that enter the loss. Given torch tensors, returns tensors on the same device (weight in
    log_ratio's dtype); given arrays, numpy arrays. NaN log-ratios get weight NaN, affected False.
    The probability-gap modes (PROB_GAP_MODES) also need the sampler's log-probs, `logp_sampler`.
    """
    values = to_numpy(log_ratio).astype(np.float64, copy=False)
    rollout = seq if rollout is None else rollout
    tokens, valid = prepare_tokens(values, seq=seq, rollout=rollout, trainable=None, logp_sampler=logp_sampler)
    weight = np.full(values.shape, np.nan)
    affected = np.zeros(values.shape, dtype=bool)
    weight[valid], affected[valid] = _apply(tokens, correction)
    if is_tensor(log_ratio):
        torch = sys.modules["torch"]
        return (torch.from_numpy(weight).to(device=log_ratio.device, dtype=log_ratio.dtype),
                torch.from_numpy(affected).to(device=log_ratio.device))
    return weight, affected


def effective_sample_size(weight: np.ndarray, counts: np.ndarray | None = None) -> float:
    """(sum w)^2 / (n sum w^2), scale-free; 0 when every weight is 0, NaN with no tokens.

    `counts`: how many tokens carry each weight (one each by default). Infinite weights
    dominate: k of them among n give k/n (the limit), not inf/inf.
    """
    weight = np.asarray(weight, dtype=np.float64)
    n = len(weight) if counts is None else int(counts.sum())
    if n == 0:
        return math.nan
    sums = _EssSums()
    sums.add(weight, counts)
    return sums.value(n)


class _EssSums:
    """The sums behind an ESS, added chunk by chunk: the infinite weights' count, and the finite
    ones' sums scaled by the largest weight so far (so sum w^2 of big sequence ratios cannot
    overflow; a larger weight in a later chunk rescales what came before)."""

    def __init__(self) -> None:
        self.infinite, self.scale, self.total, self.total_sq = 0, 0.0, 0.0, 0.0

    def add(self, weight: np.ndarray, counts: np.ndarray | None) -> None:
        infinite = np.isinf(weight)
        if infinite.any():
            self.infinite += int(infinite.sum() if counts is None else counts[infinite].sum())
            weight, counts = weight[~infinite], None if counts is None else counts[~infinite]
        top = float(weight.max()) if len(weight) else 0.0
        if top <= 0:
            return
        scale = max(self.scale, top)
        shrink = self.scale / scale
        scaled = weight / scale
        if counts is None:
            total, total_sq = scaled.sum(), dot(scaled, scaled)
        else:
            total, total_sq = dot(counts, scaled), dot(counts, np.square(scaled))
        self.total = self.total * shrink + float(total)
        self.total_sq = self.total_sq * shrink * shrink + float(total_sq)
        self.scale = scale

    def merge(self, other: _EssSums) -> None:
        self.infinite += other.infinite
        scale = max(self.scale, other.scale)
        if scale <= 0:
            return
        mine, theirs = self.scale / scale, other.scale / scale
        self.total = self.total * mine + other.total * theirs
        self.total_sq = self.total_sq * mine * mine + other.total_sq * theirs * theirs
        self.scale = scale

    def value(self, n: int) -> float:
        if self.infinite:
            return self.infinite / n
        if self.scale <= 0:
            return 0.0
        return float(np.float64(self.total) ** 2 / (n * np.float64(self.total_sq)))


class _CorrectionSums:
    """One correction's weights over the tokens, summed chunk by chunk (a sequence and a rollout lie
    in one chunk): the counts, the touched tokens, sequences and rollouts, the weight's mean and
    spread (Chan's merge), its maximum, the sums behind its ESS, and the per-turn sums."""

    def __init__(self, correction: Correction) -> None:
        self.correction, self.spec = correction, MODES[correction.mode]
        self.n = self.n_seqs = self.n_rollouts = self.hits = self.seqs_hit = self.rollouts_hit = 0
        self.total, self.m2, self.top = 0.0, 0.0, -math.inf
        self.ess = _EssSums()
        self.turns: dict[Any, np.ndarray] = {}  # turn -> [tokens, touched, weight sum]

    def add(self, tokens: CorrectionTokens) -> None:
        n = tokens.num_tokens
        if not n:
            return
        spans = tokens.spans
        weight, affected = self.spec.fn(tokens, **self.correction.params)
        if self.spec.balanced:
            weight = weight / tokens.balance
        counts = spans.lengths if self.spec.per_span else None
        with np.errstate(invalid="ignore", over="ignore"):
            if self.spec.per_span:
                span_weight, span_hits = weight * counts, affected * counts
            else:
                span_weight, span_hits = spans.sum(weight), spans.sum(affected, dtype=np.int64)
            total = float(span_weight.sum())
            mean = total / n
            deviation = weight - mean
            m2 = dot(deviation, deviation) if counts is None else dot(counts, np.square(deviation))
            merged = self.n + n
            delta = mean - (self.total / self.n if self.n else 0.0)
            self.m2 = self.m2 + m2 + (delta * delta * self.n * n / merged if self.n else 0.0)
        self.total += total
        self.n, self.n_seqs, self.n_rollouts = merged, self.n_seqs + tokens.num_seqs, self.n_rollouts + tokens.num_rollouts
        self.hits += int(span_hits.sum())
        self.seqs_hit += int((tokens.per_seq(span_hits) > 0).sum())
        self.rollouts_hit += int((np.bincount(tokens.span_rollout, weights=span_hits,
                                              minlength=tokens.num_rollouts) > 0).sum())
        self.top = max(self.top, float(weight.max()))
        self.ess.add(weight, counts)
        if tokens.turn is not None:
            self._add_turns(tokens, span_weight, span_hits)

    def merge(self, other: _CorrectionSums) -> None:
        """Take in the sums of later tokens (add's arithmetic, their sums as one chunk's)."""
        if not other.n:
            return
        with np.errstate(invalid="ignore", over="ignore"):
            merged = self.n + other.n
            delta = other.total / other.n - (self.total / self.n if self.n else 0.0)
            self.m2 = self.m2 + other.m2 + (delta * delta * self.n * other.n / merged if self.n else 0.0)
        self.total += other.total
        self.n, self.n_seqs, self.n_rollouts = merged, self.n_seqs + other.n_seqs, self.n_rollouts + other.n_rollouts
        self.hits, self.seqs_hit = self.hits + other.hits, self.seqs_hit + other.seqs_hit
        self.rollouts_hit += other.rollouts_hit
        self.top = max(self.top, other.top)
        self.ess.merge(other.ess)
        for key, row in other.turns.items():
            self.turns[key] = self.turns[key] + row if key in self.turns else row

    def _add_turns(self, tokens: CorrectionTokens, span_weight: np.ndarray, span_hits: np.ndarray) -> None:
        assert tokens.turn is not None
        keys, span_turn = tokens.turn
        counts = np.bincount(span_turn, weights=tokens.spans.lengths, minlength=len(keys))
        hits = np.bincount(span_turn, weights=span_hits, minlength=len(keys))
        with np.errstate(invalid="ignore", over="ignore"):
            sums = np.bincount(span_turn, weights=span_weight, minlength=len(keys))
        for key, row in zip(keys.tolist(), np.stack([counts, hits, sums], axis=1)):
            self.turns[key] = self.turns[key] + row if key in self.turns else row

    def result(self) -> CorrectionResult:
        n, nan = self.n, math.nan
        base = {"mode": self.correction.mode, "params": dict(self.correction.params), "level": self.spec.level}
        if n == 0:
            return CorrectionResult(**base, n_tokens=0, n_sequences=0, n_rollouts=0, frac_tokens_affected=nan,
                                    frac_sequences_affected=nan, frac_rollouts_affected=nan, weight_mean=nan,
                                    weight_std=nan, weight_max=nan, ess=nan, by_turn=[])
        scale = n / self.n_rollouts if self.spec.balanced else 1.0  # the run's N / R
        mean = self.total / n * scale
        return CorrectionResult(
            **base, n_tokens=n, n_sequences=self.n_seqs, n_rollouts=self.n_rollouts,
            frac_tokens_affected=self.hits / n, frac_sequences_affected=self.seqs_hit / self.n_seqs,
            frac_rollouts_affected=self.rollouts_hit / self.n_rollouts, weight_mean=mean,
            weight_std=math.sqrt(self.m2 / n) * scale if math.isfinite(mean) else nan, weight_max=self.top * scale,
            ess=self.ess.value(n), by_turn=self._by_turn(scale))

    def _by_turn(self, scale: float) -> list[CorrectionTurn]:
        """Per turn: how many tokens, the share the correction touched, and their mean weight."""
        with np.errstate(invalid="ignore", over="ignore"):
            return [CorrectionTurn(turn=key, n_tokens=int(count), frac_tokens_affected=float(hit / count),
                                   weight_mean=float(total / count * scale))
                    for key, (count, hit, total) in sorted(self.turns.items())]


def _results(tokens: CorrectionTokens, corrections: Sequence[Correction]) -> list[CorrectionResult]:
    """Every correction's result on tokens in memory (one chunk)."""
    sums = [_CorrectionSums(correction) for correction in corrections]
    for found in sums:
        found.add(tokens)
    return [found.result() for found in sums]


def simulate(log_ratio: Any, corrections: Sequence[Correction] | None = None, *, seq: Any,
             rollout: Any, turn: Any | None = None, trainable: Any | None = None,
             logp_sampler: Any | None = None) -> list[CorrectionResult]:
    """Apply each correction to the measured tokens and describe the result.

    All inputs are 1-D and aligned (numpy arrays, lists or torch tensors): `log_ratio` =
    log pi_train - log pi_sampler; `seq` names each token's sequence (one branch of one rollout:
    its ids must differ across rollouts), `rollout` its rollout, `turn` its turn (for by_turn),
    `trainable` which tokens enter the loss, `logp_sampler` the sampler's log-probs (needed by the
    probability-gap modes). NaN log-ratios and non-trainable tokens are dropped. By default every
    DEFAULT_CORRECTIONS item, less the probability-gap ones when `logp_sampler` is not given.
    """
    if corrections is None:
        corrections = [c for c in DEFAULT_CORRECTIONS if logp_sampler is not None or c.mode not in PROB_GAP_MODES]
    tokens, _ = prepare_tokens(log_ratio, seq=seq, rollout=rollout, trainable=trainable, turn=turn,
                               logp_sampler=logp_sampler)
    return _results(tokens, corrections)


class CorrectionSimulator:
    """Every correction simulated over a table's chunks (an Analysis of one pass)."""

    def __init__(self, corrections: Sequence[Correction] = DEFAULT_CORRECTIONS, *,
                 pair: tuple[str, str] = ("train", "sampler")) -> None:
        self.columns = (f"logp_{pair[0]}", f"logp_{pair[1]}")
        self.sums = [_CorrectionSums(correction) for correction in corrections]

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        tokens = _chunk_tokens(chunk, self.columns)
        for found in self.sums:
            found.add(tokens)

    def merge(self, other: CorrectionSimulator, index: int) -> None:
        for found, theirs in zip(self.sums, other.sums):
            found.merge(theirs)

    def result(self) -> list[CorrectionResult]:
        return [found.result() for found in self.sums]


def simulate_table(table: pd.DataFrame | Chunks, corrections: Sequence[Correction] = DEFAULT_CORRECTIONS, *,
                   pair: tuple[str, str] = ("train", "sampler")) -> list[CorrectionResult]:
    """`simulate` on a token table (tokens.parquet as a DataFrame), or on its chunks of whole
    rollouts (analysis/chunked.py), chunk by chunk.

    Reads columns `rollout`, `branch`, `turn`, `trainable`, `logp_<A>` and `logp_<B>` of the pair;
    log_ratio = logp_A - logp_B, a sequence is a (rollout, branch).
    """
    found = CorrectionSimulator(corrections, pair=pair)
    run_passes(table if callable(table) else table_chunks(table), [found])
    return found.result()


def _chunk_tokens(chunk: Chunk, columns: tuple[str, str]) -> CorrectionTokens:
    """One chunk's trainable tokens of the pair, cut into spans per turn."""
    needed = ["rollout", "branch", "turn", "trainable", *columns]
    missing = [name for name in needed if name not in chunk.table.columns]
    if missing:
        raise MismatchError(f"token table has no column {missing[0]!r} (columns: "
                            f"{', '.join(map(str, chunk.table.columns))})")
    # The metrics' own pair: its log-ratio, ratio and spans are computed once for both.
    pair_view = chunk.pair(*columns)
    tokens_view = pair_view.view
    spans, turns = tokens_view.grouping(["turn"])
    return CorrectionTokens(pair_view.log_ratio, spans, span_seq=tokens_view.span_seq,
                            num_seqs=tokens_view.num_seqs, span_rollout=tokens_view.span_rollout,
                            num_rollouts=tokens_view.num_rollouts,
                            turn=(turns.keys["turn"].to_numpy(), turns.span_group),
                            span_stats=span_sums(pair_view, spans), logp=(pair_view.logp_a, pair_view.logp_b),
                            pair=pair_view)


def summary_corrections(table: pd.DataFrame | Chunks,
                        corrections: Sequence[Correction] = DEFAULT_CORRECTIONS) -> list[model.Correction]:
    """summary.json's `corrections`: every correction simulated over train/sampler trainable tokens."""
    return [result.to_record() for result in simulate_table(table, corrections)]
