"""Alignment sanity: is the stored log-prob column the same quantity, at the same positions, as
the replayed one? Checked on the token table before any metric is trusted (summary `alignment`).

Finds shifted-by-one log-probs, padded zeros and constant placeholders, missing log-probs on
trainable tokens, and temperature/top-p/top-k "processed" log-probs; `mismatch.replay.recompute_processed`
then replays the trainer side under the sampler's own processing so the comparison is like for like.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from mismatch.analysis.chunked import Chunk, Chunks, run_passes
from mismatch.results.chunks import key_codes, table_chunks
from mismatch.results.section_records import SamplerDeclaration
from mismatch.analysis.moments import Moments
from mismatch.analysis.groups import find_spans
from mismatch.analysis.truncation import TruncationEvidence
from mismatch.streams import Sampling  # the sampler's declared processing
from mismatch.errors import MismatchError

SHIFTS = (-1, 0, 1)
SHIFT_FACTOR = 4.0     # a shift must fit at least this many times better than no shift
SHIFT_MIN_GAP = 0.01   # nats of mean |Δ| at shift 0 below which there is nothing to explain
LIKELY_LOGP = math.log(0.5)    # tokens the replay finds likely: temperature < 1 raises them all
SURE_LOGP = math.log(0.99)     # a stored 0.0 is padding when the replay says p < 0.99
MIN_RUN = 4                    # identical stored values in a row that make a constant placeholder
RUN_SPREAD = 0.05              # ... while the replayed values in that run spread at least this much
ONE_SIDED = 0.9                # fraction of likely tokens moved one way that means "processed"
RAW_SLOPE_TOL = 0.05           # |log slope| under this (T within ~5% of 1) reads as raw
MIN_TOKENS = 20                # fewer likely tokens than this: semantics "unknown"


def _span_ids(table: pd.DataFrame, keys: Sequence[str]) -> np.ndarray:
    """One id per stretch of equal `keys` in table order (0, 1, ...): per branch or per segment,
    as every token table mismatch writes keeps each branch's rows together. Shifts never cross
    a segment."""
    spans = find_spans([key_codes(table[name]) for name in keys], len(table))
    return np.repeat(np.arange(spans.num_spans, dtype=np.int64), spans.lengths)


def _shift_sums(stored: np.ndarray, replayed: np.ndarray, segment: np.ndarray,
                group: np.ndarray) -> tuple[pd.Index, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Per group (in order of first appearance) and shift k: the sum and count of
    |stored[i] - replayed[i + k]| over pairs inside one segment (a shift never borrows a neighbour
    segment's token)."""
    n = len(stored)
    steps = np.diff(group)
    if n and group[0] == 0 and ((steps == 0) | (steps == 1)).all():
        # _span_ids' codes are already 0, 1, ... in order of first appearance: factorize's answer.
        codes, uniques = group, np.arange(group[-1] + 1, dtype=group.dtype)
    else:
        codes, uniques = pd.factorize(group)
    num_groups = len(uniques)
    sums = {}
    for k in SHIFTS:
        here, there = slice(max(0, -k), n - max(0, k)), slice(max(0, k), n - max(0, -k))
        ok = np.isfinite(stored[here]) & np.isfinite(replayed[there])
        if k:  # unshifted, a token is always in its own segment
            ok &= segment[here] == segment[there]
        gap = np.abs(stored[here][ok] - replayed[there][ok])
        kept = codes[here][ok]
        sums[k] = (np.bincount(kept, weights=gap, minlength=num_groups), np.bincount(kept, minlength=num_groups))
    return pd.Index(uniques), sums


def _fits(index: pd.Index, sums: dict[int, tuple[np.ndarray, np.ndarray]]) -> pd.DataFrame:
    """Mean |stored[i] - replayed[i + k]| per group (rows) and shift k (columns), from _shift_sums."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return pd.DataFrame({k: np.where(count > 0, total / count, np.nan) for k, (total, count) in sums.items()},
                            index=index)


def _best_shift(fits: dict[int, float]) -> int:
    """The shift that fits clearly better than none (SHIFT_FACTOR), else 0."""
    base = fits[0]
    if not math.isfinite(base) or base < SHIFT_MIN_GAP:
        return 0
    better = [k for k in (-1, 1) if math.isfinite(fits[k]) and fits[k] * SHIFT_FACTOR <= base]
    return min(better, key=lambda k: fits[k]) if better else 0


def _constant_spans(stored: np.ndarray, replayed: np.ndarray, segment: np.ndarray) -> np.ndarray:
    """Rows inside a run of >= MIN_RUN identical stored values whose replay clearly varies."""
    flagged = np.zeros(len(stored), dtype=bool)
    if not len(stored):
        return flagged
    starts = np.flatnonzero(np.r_[True, (stored[1:] != stored[:-1]) | (segment[1:] != segment[:-1])])
    stops = np.r_[starts[1:], len(stored)]
    first = stored[starts]
    # Zeros are counted as padding, not as a constant.
    candidate = (stops - starts >= MIN_RUN) & np.isfinite(first) & (first != 0.0)
    starts, stops = starts[candidate], stops[candidate]
    if not len(starts):
        return flagged
    finite = np.isfinite(replayed)
    # The spread of each candidate run's finite replayed values (-inf where it has none): reduceat
    # over [start, stop) pairs, keeping every other result.
    bounds = np.column_stack([starts, stops]).reshape(-1)
    bounds = bounds[:-1] if bounds[-1] == len(stored) else bounds
    high = np.maximum.reduceat(np.where(finite, replayed, -np.inf), bounds)[::2]
    low = np.minimum.reduceat(np.where(finite, replayed, np.inf), bounds)[::2]
    with np.errstate(invalid="ignore"):
        varies = high - low >= RUN_SPREAD
    marks = np.zeros(len(stored) + 1, dtype=np.int64)
    np.add.at(marks, starts[varies], 1)
    np.add.at(marks, stops[varies], -1)
    return np.cumsum(marks[:-1]) > 0


def _finding(kind: str, message: str, fix: str, rollout: str | None = None) -> dict[str, Any]:
    return {"kind": kind, **({"rollout": rollout} if rollout is not None else {}),
            "message": message, "fix": fix}


@dataclass(kw_only=True, slots=True, frozen=True)
class _Columns:
    """The token table as the checks read it: one array per column, table order."""

    stored: np.ndarray     # float64
    replayed: np.ndarray   # float64
    trainable: np.ndarray  # bool
    rollout: np.ndarray    # int code per rollout
    rollout_names: np.ndarray  # str per rollout code
    branch: np.ndarray     # int code per (rollout, branch)
    segment: np.ndarray    # int code per (rollout, branch, segment)


def _columns(table: pd.DataFrame, stored: str, replayed: str) -> _Columns:
    needed = [f"logp_{stored}", f"logp_{replayed}", "rollout", "branch", "segment", "trainable"]
    missing = [c for c in needed if c not in table.columns]
    if missing:
        raise MismatchError(f"alignment: token table has no column {missing[0]!r}")
    # Codes, not a Python string per row: names are looked up only for the rows a finding names.
    rollout_codes, rollout_names = pd.factorize(table["rollout"])
    return _Columns(stored=table[needed[0]].to_numpy(np.float64),
                    replayed=table[needed[1]].to_numpy(np.float64),
                    trainable=table["trainable"].to_numpy(dtype=bool),
                    rollout=rollout_codes, rollout_names=np.asarray(rollout_names.astype(str), dtype=object),
                    branch=_span_ids(table, ["rollout", "branch"]),
                    segment=_span_ids(table, ["rollout", "branch", "segment"]))


def _missing(cols: _Columns) -> tuple[int, float, str | None]:
    """Trainable tokens without a stored log-prob: how many, and the rollout with the largest
    share of them (the first such, in table order) with that share."""
    missing = cols.trainable & np.isnan(cols.stored)
    if not missing.any():
        return 0, 0.0, None
    shares = pd.Series(missing[cols.trainable]).groupby(cols.rollout[cols.trainable]).mean()
    return int(missing.sum()), float(shares.max()), str(cols.rollout_names[shares.idxmax()])


def _branch_shifts(cols: _Columns, fits: pd.DataFrame, branch_column: pd.Series,
                   findings: list[dict[str, Any]]) -> dict[str, int]:
    """The rollouts with a branch whose own best shift is not 0 (a finding for each such branch).

    Per branch, not per rollout: an exporter bug may hit one branch kind and not another. The
    shift test runs on every branch's fits at once; only a shifted branch is named.
    """
    shifted = np.flatnonzero(_best_shifts(fits))
    if not len(shifted):
        return {}
    codes, first_row = np.unique(cols.branch, return_index=True)
    row_of = dict(zip(codes.tolist(), first_row.tolist()))
    by_rollout: dict[str, int] = {}
    for code, row in fits.iloc[shifted].iterrows():
        k = _best_shift({k: float(row[k]) for k in SHIFTS})
        first = row_of[code]
        rollout_id, branch_id = cols.rollout_names[cols.rollout[first]], str(branch_column.iloc[first])
        by_rollout.setdefault(rollout_id, k)
        findings.append(_finding(
            "shift", f"rollout {rollout_id!r} branch {branch_id!r}: stored log-probs fit the replay "
            f"shifted by {k:+d} (stored[i] is the log-prob of token i{k:+d}; mean |Δ| {row[k]:.3g} "
            f"vs {row[0]:.3g} unshifted)",
            "realign the log-probs with their tokens in the exporter (an off-by-one between the "
            "logits row and the token it scores); do not trust this rollout's ratios until then",
            rollout=rollout_id))
    return by_rollout


def _best_shifts(fits: pd.DataFrame) -> np.ndarray:
    """Per row of fits: whether _best_shift would pick a shift other than 0."""
    base = fits[0].to_numpy()
    with np.errstate(invalid="ignore"):
        candidate = np.isfinite(base) & (base >= SHIFT_MIN_GAP)
        better = np.zeros(len(fits), dtype=bool)
        for k in (-1, 1):
            fit = fits[k].to_numpy()
            better |= np.isfinite(fit) & (fit * SHIFT_FACTOR <= base)
    return candidate & better


def _placeholders(cols: _Columns) -> tuple[int, int, float | None]:
    """Trainable tokens storing 0.0 where the replay is unsure, tokens in runs of one repeated
    stored value while the replay varies, and the first such value."""
    zero_rows = cols.trainable & (cols.replayed < SURE_LOGP) & (cols.stored == 0.0)
    constant_rows = _constant_spans(cols.stored, cols.replayed, cols.segment) & cols.trainable
    value = float(cols.stored[constant_rows][0]) if constant_rows.any() else None
    return int(zero_rows.sum()), int(constant_rows.sum()), value


def _semantics_finding(semantics: dict[str, Any], declared: dict[str, Any], stored: str, replayed: str,
                       findings: list[dict[str, Any]]) -> None:
    sampling = Sampling.from_meta(declared)
    declaration = msgspec.convert(declared, SamplerDeclaration, strict=False)
    if semantics["semantics"] == "processed":
        # The declared settings are exact where given; the estimate is only a fallback.
        temperature = semantics["estimated_temperature"] if sampling.is_identity else sampling.temperature
        raised = semantics["frac_likely_raised"] >= ONE_SIDED
        share = max(semantics["frac_likely_raised"], semantics["frac_likely_lowered"])
        declared_text = (f"; meta.sampler declares logprobs={declaration.logprobs!r}"
                         if declaration.logprobs else "")
        findings.append(_finding(
            "processed_logprobs", f"stored {stored} log-probs are processed (likely tokens "
            f"{'raised' if raised else 'lowered'} in {share:.0%} of cases; temperature ~ "
            f"{semantics['estimated_temperature']}) while {replayed} computes raw ones{declared_text}",
            f"compare like for like: recompute the {replayed} side under the sampler's processing "
            f"(mismatch.replay.recompute_processed, temperature={temperature}, top_k={sampling.top_k}, "
            f"top_p={sampling.top_p}), or store raw log-probs (vLLM: logprobs_mode='raw_logprobs')"))
    elif semantics["semantics"] == "truncated":
        findings.append(_finding(
            "truncated_logprobs", f"stored {stored} log-probs sit above {replayed}'s by a kept mass on every token "
            "(none lowered): top-p/top-k/min-p processed log-probs against raw ones"
            + (f"; meta.sampler declares top_p={sampling.top_p}, top_k={sampling.top_k}, min_p={sampling.min_p}"
               if sampling.truncates else "; meta.sampler declares no truncation"),
            f"replay {replayed} on the sampler's kept set (engine option sampling=replay, with meta.sampler's "
            "top_p/top_k/min_p or each segment's sampling_mask), or sample training rollouts untruncated"))
    elif semantics["semantics"] == "raw" and declaration.logprobs == "processed" and not sampling.is_identity:
        findings.append(_finding("semantics_mismatch",
                                 "meta.sampler declares processed log-probs but they read as raw",
                                 "fix meta.sampler.logprobs so corrections use the right semantics"))


class AlignmentCheck:
    """check_alignment as an Analysis of one pass: a chunk of whole rollouts at a time (a segment,
    a branch and a rollout lie in one chunk), it adds counts, the shift fits' sums, the findings
    per branch, and the semantics evidence (counts and the moments of its log-log fit)."""

    def __init__(self, stored: str = "sampler", replayed: str = "train",
                 sampler_meta: dict[str, Any] | None = None) -> None:
        self.stored, self.replayed, self.declared = stored, replayed, dict(sampler_meta or {})
        self.trainable = self.missing = self.padded = self.constant = 0
        self.worst_missing: tuple[float, str | None] = (-1.0, None)
        self.constant_value: float | None = None
        self.shift_sums = {k: np.zeros(2) for k in SHIFTS}  # overall [sum, count] per shift
        self.shift_findings: list[dict[str, Any]] = []
        self.by_rollout: dict[str, int] = {}
        self.likely = self.raised = self.lowered = 0
        self.loglog = Moments()  # of (log -replayed, log -stored) over likely tokens
        self.x_range = (math.inf, -math.inf)
        self.truncation = TruncationEvidence()

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        table = chunk.table
        cols = _columns(table, self.stored, self.replayed)
        self.trainable += int(cols.trainable.sum())
        missing, share, worst = _missing(cols)
        self.missing += missing
        if worst is not None and share > self.worst_missing[0]:
            self.worst_missing = (share, worst)
        index, sums = _shift_sums(cols.stored, cols.replayed, cols.segment, cols.branch)
        for k, (total, count) in sums.items():  # over all rows: the branches' sums together
            self.shift_sums[k] += [total.sum(), count.sum()]
        shifted = _branch_shifts(cols, _fits(index, sums), table["branch"], self.shift_findings)
        for rollout_id, k in shifted.items():
            self.by_rollout.setdefault(rollout_id, k)
        padded, constant, value = _placeholders(cols)
        self.padded, self.constant = self.padded + padded, self.constant + constant
        if self.constant_value is None:
            self.constant_value = value
        # Rollouts with a shift are left out of the semantics, whose evidence they would scramble.
        shifted_codes = np.flatnonzero(np.isin(cols.rollout_names, list(shifted)))
        keep = cols.trainable & ~np.isin(cols.rollout, shifted_codes) & (cols.stored != 0.0)
        self._add_semantics(cols.stored[keep], cols.replayed[keep])
        self.truncation.add(cols.stored[keep], cols.replayed[keep])

    def merge(self, other: AlignmentCheck, index: int) -> None:
        """Take in the later chunks' findings (the earlier chunk's first, as `add` keeps them)."""
        self.trainable, self.missing = self.trainable + other.trainable, self.missing + other.missing
        self.padded, self.constant = self.padded + other.padded, self.constant + other.constant
        if other.worst_missing[0] > self.worst_missing[0]:
            self.worst_missing = other.worst_missing
        if self.constant_value is None:
            self.constant_value = other.constant_value
        for k, sums in other.shift_sums.items():
            self.shift_sums[k] += sums
        self.shift_findings.extend(other.shift_findings)
        for rollout_id, k in other.by_rollout.items():
            self.by_rollout.setdefault(rollout_id, k)
        self.likely, self.raised, self.lowered = (self.likely + other.likely, self.raised + other.raised,
                                                  self.lowered + other.lowered)
        self.loglog.merge(other.loglog)
        self.truncation.merge(other.truncation)
        self.x_range = (min(self.x_range[0], other.x_range[0]), max(self.x_range[1], other.x_range[1]))

    def _add_semantics(self, stored: np.ndarray, replayed: np.ndarray) -> None:
        likely = (np.isfinite(stored) & np.isfinite(replayed) & (replayed > LIKELY_LOGP)
                  & (replayed < 0) & (stored < 0))
        s, r = stored[likely], replayed[likely]
        if not len(s):
            return
        self.likely += len(s)
        self.raised += int((s > r).sum())
        self.lowered += int((s < r).sum())
        x = np.log(-r)
        self.loglog.add(np.stack([x, np.log(-s)]))
        self.x_range = (min(self.x_range[0], float(x.min())), max(self.x_range[1], float(x.max())))

    def semantics(self) -> dict[str, Any]:
        """Raw, processed or truncated, from tokens the replay finds likely (stored 0.0 left to the
        padding check); truncated first, from every such token (analysis/truncation.py).

        Temperature T < 1 raises every likely token (log q = log p / T + log-normalizer, both
        pushing toward 0), T > 1 lowers them all; raw log-probs only scatter around the replay.
        For likely tokens -log q ~ (-log p)^(1/T), so the slope of log(-stored) on log(-replayed)
        estimates 1/T (biased toward lower T when several tokens compete; an estimate, not a fit).
        """
        out: dict[str, Any] = {"n_likely": self.likely, "frac_likely_raised": None,
                               "frac_likely_lowered": None, "loglog_slope": None}
        # Truncation first: its kept mass raises every token, which the log-log slope would read
        # as a temperature below 1 (analysis/truncation.py says how the two differ).
        if self.truncation.result()["truncated"]:
            return {**out, "semantics": "truncated", "estimated_temperature": 1.0}
        if self.likely < MIN_TOKENS:
            return {**out, "semantics": "unknown", "estimated_temperature": None}
        raised, lowered = self.raised / self.likely, self.lowered / self.likely
        comoment = self.loglog.comoment
        assert comoment is not None
        slope = float(comoment[0, 1] / comoment[0, 0]) if self.x_range[1] > self.x_range[0] else 1.0
        out.update(frac_likely_raised=raised, frac_likely_lowered=lowered, loglog_slope=slope)
        if max(raised, lowered) >= ONE_SIDED and abs(math.log(max(slope, 1e-9))) >= RAW_SLOPE_TOL:
            return {**out, "semantics": "processed", "estimated_temperature": round(1.0 / slope, 3)}
        if max(raised, lowered) < ONE_SIDED and abs(math.log(max(slope, 1e-9))) < RAW_SLOPE_TOL:
            return {**out, "semantics": "raw", "estimated_temperature": 1.0}
        return {**out, "semantics": "unknown", "estimated_temperature": None}

    def result(self) -> dict[str, Any]:
        with np.errstate(invalid="ignore", divide="ignore"):
            fits = {k: float(total / count) if count else float("nan") for k, (total, count) in self.shift_sums.items()}
        findings = self.findings()
        semantics = self.semantics()
        _semantics_finding(semantics, self.declared, self.stored, self.replayed, findings)
        num_trainable = max(self.trainable, 1)
        return {
            "stored": self.stored, "replayed": self.replayed,
            "shift": _best_shift(fits), "shift_fit": {str(k): v for k, v in fits.items()},
            "shift_by_rollout": self.by_rollout,
            "padded_zero_frac": self.padded / num_trainable, "constant_frac": self.constant / num_trainable,
            "missing_trainable_frac": self.missing / num_trainable,
            "logprob_semantics": semantics["semantics"],
            "estimated_temperature": semantics["estimated_temperature"],
            "semantics": semantics, "declared": self.declared,
            "truncation": self.truncation.result(),
            "findings": findings,
        }

    def findings(self) -> list[dict[str, Any]]:
        """Missing log-probs, shifted branches, placeholders, in that order (semantics after)."""
        found = []
        if self.missing:
            worst = self.worst_missing[1]
            found.append(_finding("missing_logprobs", f"{self.missing} trainable tokens have no stored "
                                  f"{self.stored} log-prob (most in rollout {worst!r})",
                                  "store the sampler's log-prob of every generated token; a ratio "
                                  "needs both sides", rollout=worst))
        found += self.shift_findings
        if self.padded:
            found.append(_finding("padded_zero", f"{self.padded} trainable tokens store log-prob 0.0 "
                                  "where the replay gives p < 0.99",
                                  "zeros are padding or a placeholder: store real log-probs, or mask "
                                  "these tokens out of the ratio (unless the sampler used top-p/top-k, "
                                  "which legitimately gives 0.0 to a lone surviving token)"))
        if self.constant:
            found.append(_finding("constant_logprobs", f"{self.constant} trainable tokens sit in runs "
                                  f"of one repeated stored log-prob (e.g. {self.constant_value!r}) while the "
                                  "replay varies", "a placeholder was stored instead of log-probs: fix the "
                                  "exporter or mask these tokens"))
        return found


def check_alignment(table: pd.DataFrame | Chunks, *, stored: str = "sampler", replayed: str = "train",
                    sampler_meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """`summary["alignment"]`: do `logp_<stored>` and `logp_<replayed>` measure the same thing?

    `table` is a token table or its chunks of whole rollouts (analysis/chunked.py), read once.
    Contract keys: `shift` (-1, 0, +1: stored[i] is the log-prob of token i + shift, over all
    rollouts), `padded_zero_frac`, `logprob_semantics` ("raw" | "processed" | "unknown"); also
    `estimated_temperature`, `missing_trainable_frac`, `constant_frac`, `shift_fit` (mean |Δ|
    per shift), `shift_by_rollout` (rollouts with a branch whose own best shift is not 0),
    `semantics` (the evidence), `declared` (from `sampler_meta`), and `findings`: [{kind,
    rollout?, message, fix}]. Fractions are over trainable tokens. Rollouts with a shift are
    left out of the semantics check, whose evidence they would scramble.
    """
    found = AlignmentCheck(stored, replayed, sampler_meta)
    run_passes(table if callable(table) else table_chunks(table), [found])
    return found.result()


def like_for_like(table: pd.DataFrame, recomputed: np.ndarray, *, stored: str = "sampler",
                  replayed: str = "train", name: str | None = None,
                  pairs: Sequence[tuple[str, str]] = ()) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Add the recomputed column (`logp_<replayed>_processed`) and its pair metrics against
    `stored`, next to the raw pair and any other `pairs`, for summary.json."""
    from mismatch.analysis.metrics import summarize_pairs

    source = name or f"{replayed}_processed"
    if len(recomputed) != len(table):
        raise MismatchError(f"recomputed column has {len(recomputed)} rows, token table {len(table)}")
    out = table.copy()
    out[f"logp_{source}"] = np.asarray(recomputed, np.float64)
    wanted = [(replayed, stored), (source, stored), *pairs]
    return out, summarize_pairs(out, wanted)
