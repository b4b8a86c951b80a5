"""What the pair metrics are made of: a pair's per-token terms, summed per span of its view
(`SpanSums`) and per group of spans (`GroupTotals`, merged chunk by chunk). metrics turns them into
PAIR_METRICS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from mismatch.analysis import terms
from mismatch.analysis.groups import Grouping, Spans
from mismatch.analysis.pair_tokens import PairTokens
from mismatch.analysis.tokenview import TokenView

# Beyond this |log_ratio| the sums of r and r^2 behind ESS could overflow or underflow float64.
_ESS_DIRECT_LIMIT = 300.0


def token_terms(pair: PairTokens, scratch: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """Per-token values whose group sums (`name`) or group maxima (`name_max`) the metrics are made of.

    Each value is written into `scratch` (or is an array the pair already holds) and is valid until
    the next one is asked for: one buffer instead of a dozen fresh arrays, whose page faults cost
    more than the arithmetic.
    """
    log_ratio, ratio = pair.log_ratio, pair.ratio
    yield "log_ratio", log_ratio
    yield "ratio", ratio
    yield "log_ratio_sq", np.square(log_ratio, out=scratch)
    yield "ratio_sq", terms.ratio_sq(ratio, out=scratch)
    # k3 is the pair's own, made once by whichever analysis asks first: strata reads it on every
    # pair, so made here into the scratch buffer it was made again (an expm1 per token).
    yield "k3", pair.k3
    flags = scratch.view(np.bool_)[:len(log_ratio)]  # the same buffer, read as flags
    yield "outside_2", terms.outside(ratio, out=flags)
    yield "equal", np.equal(pair.logp_a, pair.logp_b, out=flags)
    # Cheap terms (an abs, a subtraction of the pair's kept probabilities) are the pair's when an
    # analysis made them already, else made into the scratch buffer: a fresh array per pair and
    # chunk costs more in page faults than recomputing them for the few analyses that read them.
    abs_log_ratio = _kept(pair, "abs_log_ratio", lambda: np.abs(log_ratio, out=scratch))
    yield "abs_log_ratio", abs_log_ratio
    yield "log_ratio_abs_max", abs_log_ratio
    prob_abs_diff = _kept(pair, "prob_abs_diff", lambda: terms.prob_gap(pair.prob_a, pair.prob_b, out=scratch))
    yield "prob_abs_diff", prob_abs_diff
    yield "prob_abs_diff_max", prob_abs_diff


def _kept(pair: PairTokens, name: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The pair's cached term `name` when an analysis made it already, else compute() (the same bits)."""
    kept = vars(pair.terms_of).get(name)
    return kept if kept is not None else compute()


def span_sums(pair: PairTokens, spans: Spans) -> dict[str, np.ndarray]:
    """Per span of the pair's view: the sums and extremes behind every metric (kept on the view)."""
    # Keyed by the pair that holds the arrays: a pair cut from a parent view sums as its `same`.
    return pair.view.memo(("span_sums", id(pair.terms_of), id(spans)), lambda: _span_sums(pair, spans))


def _span_sums(pair: PairTokens, spans: Spans) -> dict[str, np.ndarray]:
    """Per span of the pair's view: every sum, extreme and spread the metrics are made of."""
    scratch = np.empty(len(pair.log_ratio))
    sums = {name: (spans.max(values) if name.endswith("_max") else
                   spans.sum(values, dtype=np.int64 if values.dtype == bool else None))
            for name, values in token_terms(pair, scratch)}
    sums["log_ratio_min"], sums["log_ratio_max"] = spans.min(pair.log_ratio), spans.max(pair.log_ratio)
    with np.errstate(over="ignore", invalid="ignore"):
        # Each span's squared deviations from its own mean (two passes, no E[r^2] - E[r]^2, which
        # cancels to noise for the ratio ~ 1 +- 1e-8 of good engine pairs); spans merge by Chan's rule.
        deviation = np.subtract(pair.ratio, spans.spread(sums["ratio"] / spans.lengths), out=scratch)
        sums["ratio_m2"] = spans.sum(np.square(deviation, out=scratch))
    return sums


@dataclass(frozen=True, slots=True, eq=False)
class SpanSums:
    """A pair's tokens reduced per span: everything the metrics of any grouping of the spans are
    made of, except what only the tokens themselves give (metrics.TokenPass). Each chunk of a
    table has its own; their GroupTotals merge (analysis/grouped_metrics.py)."""

    spans: Spans
    sums: dict[str, np.ndarray]  # per span: _span_sums's keys
    span_seq: np.ndarray         # per span: its sequence, 0..num_seqs-1
    num_seqs: int
    span_rollout: np.ndarray     # per span: its rollout, 0..num_rollouts-1
    num_rollouts: int


def pair_span_sums(pair: PairTokens, spans: Spans) -> SpanSums:
    """The pair's SpanSums over `spans` (cut on the pair's view, at least as fine as its base spans)."""
    view = pair.view
    base = _span_of(view, spans)
    return SpanSums(spans=spans, sums=span_sums(pair, spans), span_seq=view.span_seq[base], num_seqs=view.num_seqs,
                    span_rollout=view.span_rollout[base], num_rollouts=view.num_rollouts)


def _span_of(view: TokenView, spans: Spans) -> np.ndarray:
    """For spans cut finer than the view's base spans: the base span each one lies in."""
    if spans is view.spans:
        return np.arange(spans.num_spans)
    return np.searchsorted(view.spans.starts, spans.starts, side="right") - 1


def far_groups(lr_min: np.ndarray, lr_max: np.ndarray) -> np.ndarray:
    """Groups whose ESS needs the rescaled sums (TokenPass.far_weights)."""
    return (lr_max > _ESS_DIRECT_LIMIT) | (lr_min < -_ESS_DIRECT_LIMIT)


# GroupTotals' sums (added), maxima and minima, per group.
_SUMMED = ("n", "n_rollouts", "num_seqs", "log_ratio", "abs_log_ratio", "ratio", "ratio_sq", "log_ratio_sq", "k3",
           "prob_abs_diff", "outside_2", "equal", "seq_weight", "seq_ppl")
_MAXED = ("log_ratio_abs_max", "prob_abs_diff_max", "log_ratio_max")
_MINNED = ("log_ratio_min",)


@dataclass(slots=True, eq=False)
class GroupTotals:
    """What PAIR_METRICS of groups 0..G-1 are made of, summed over their spans: additive sums,
    extremes, and the ratio's spread around the group mean (`ratio_m2`). Totals of chunks of
    whole rollouts merge (`merge`: Chan's rule for the spread), since neither a sequence nor a
    rollout crosses a chunk."""

    values: dict[str, np.ndarray]

    @classmethod
    def empty(cls, num_groups: int) -> GroupTotals:
        values = {name: np.zeros(num_groups) for name in (*_SUMMED, "ratio_m2")}
        values.update({name: np.full(num_groups, -np.inf) for name in _MAXED})
        values.update({name: np.full(num_groups, np.inf) for name in _MINNED})
        return cls(values)

    @classmethod
    def of(cls, data: SpanSums, grouping: Grouping) -> GroupTotals:
        spans, sums, total = data.spans, data.sums, grouping.sum
        n = grouping.count(spans)
        pair_group, span_pair = grouping.pairs_with(data.span_seq, data.num_seqs)
        seq_sum = np.bincount(span_pair, weights=sums["log_ratio"], minlength=len(pair_group))
        seq_count = np.bincount(span_pair, weights=spans.lengths, minlength=len(pair_group))
        values = {"n": n.astype(np.float64), "n_rollouts": grouping.distinct(data.span_rollout, data.num_rollouts)
                  .astype(np.float64), "num_seqs": np.bincount(pair_group, minlength=grouping.num_groups).astype(np.float64)}
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for name in _SUMMED[3:-2]:
                values[name] = total(sums[name])
            # Sequence metrics: each sequence's log-ratios summed first (within the group).
            values["seq_weight"] = np.bincount(pair_group, weights=np.exp(2.0 * seq_sum), minlength=grouping.num_groups)
            values["seq_ppl"] = np.bincount(pair_group, weights=np.exp(-seq_sum / seq_count), minlength=grouping.num_groups)
            values.update({name: grouping.max(sums[name]) for name in _MAXED})
            values.update({name: grouping.min(sums[name]) for name in _MINNED})
            # Each span's squared deviations from its own mean (two passes, no E[r^2] - E[r]^2,
            # which cancels to noise for the ratio ~ 1 +- 1e-8 of good engine pairs), merged by Chan's rule.
            mean = values["ratio"] / n
            span_mean = sums["ratio"] / spans.lengths
            values["ratio_m2"] = total(sums["ratio_m2"] + spans.lengths * np.square(span_mean - mean[grouping.span_group]))
        if "outside_clip" in sums:
            values["outside_clip"] = total(sums["outside_clip"])
        return cls(values)

    def merge(self, other: GroupTotals, into: np.ndarray) -> None:
        """Add `other` (whose group g is this one's group into[g])."""
        values = self.values
        n_a, n_b = values["n"][into], other.values["n"]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            n = n_a + n_b
            delta = other.values["ratio"] / n_b - values["ratio"][into] / n_a
            m2 = values["ratio_m2"][into] + other.values["ratio_m2"] + np.square(delta) * n_a * n_b / n
            values["ratio_m2"][into] = np.where(n_a == 0, other.values["ratio_m2"],
                                                np.where(n_b == 0, values["ratio_m2"][into], m2))
        for name, found in other.values.items():
            if name == "ratio_m2":
                continue
            if name not in values:
                values[name] = np.zeros(len(values["n"]))
            if name in _MAXED:
                values[name][into] = np.maximum(values[name][into], found)
            elif name in _MINNED:
                values[name][into] = np.minimum(values[name][into], found)
            else:
                values[name][into] = values[name][into] + found

    def grown(self, num_groups: int) -> GroupTotals:
        """The same totals with room for `num_groups` groups (the new ones empty)."""
        size = len(self.values["n"])
        if num_groups <= size:
            return self
        more = GroupTotals.empty(num_groups - size).values
        return GroupTotals({name: np.concatenate([found, more.get(name, np.zeros(num_groups - size))])
                            for name, found in self.values.items()})

    def far(self) -> np.ndarray:
        """Groups whose ESS needs the rescaled sums (TokenPass.far_weights)."""
        return far_groups(self.values["log_ratio_min"], self.values["log_ratio_max"])
