"""What the page needs from tokens.parquet, read in chunks of whole rollouts: memory of a chunk,
however many tokens were audited.

`DigestAnalysis` is an Analysis (mismatch.analysis.chunked) of two passes, three without the pairs'
token counts: (1) per pair the count and extremes of the log-ratio, its top 0.1% (behind the
histograms' common x-range), the stream's longest position, each rollout's ranking score, the
focus pair's worst tokens; (2) the histogram counts, the per-position (and, for results without
summary turns, per-turn) sums, and the rows of the worst rollouts. An audit runs it in its own
passes; `digest` runs it alone on a results dir.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from mismatch.reports import aggregate
from mismatch.reports.worst import (
    RankedRollout,
    WorstBlock,
    WorstOptions,
    color_scale,
    logp_roles,
    rollout_detail,
    token_texts,
)

if TYPE_CHECKING:
    from mismatch.analysis.chunked import Chunk
    from mismatch.analysis.pair_tokens import PairTokens

Chunks = Callable[[], Iterator[pd.DataFrame]]
WORST_TOKENS = 20  # the focus pair's worst tokens listed under the worst rollouts


@dataclass(kw_only=True, slots=True, frozen=True)
class WorstToken:
    """One of the focus pair's trainable tokens with the largest |log-ratio|: where it is, its id,
    the pair's two log-probs (a: the pair's first side) and |logp_a - logp_b|."""

    rollout: str
    branch: str
    turn: int
    pos: int
    token_id: int
    logp_a: float
    logp_b: float
    abs_log_ratio: float


@dataclass(slots=True)
class _PairTokenSums:
    """One pair's trainable tokens with both log-probs, summed over the chunks."""

    pair: str
    n: int = 0
    finite: int = 0                     # tokens with a finite log-ratio
    max_abs: float = -math.inf          # largest finite |log-ratio|
    tails: Any = None                   # the top 0.1% of finite |log-ratio| (analysis.tails.Tails)
    histogram: aggregate.Histogram | None = None  # pass 3
    by_position: aggregate.GroupSums = field(default_factory=aggregate.GroupSums)
    by_turn: aggregate.GroupSums = field(default_factory=aggregate.GroupSums)


def _pair_tokens(chunk: Chunk, pair: str) -> tuple[np.ndarray, PairTokens]:
    """(rows, tokens) of the chunk's trainable rows where the log-ratio of `pair` is defined: the
    chunk's own pair tokens, which the audit's other analyses of the chunk share (one log-ratio,
    one k3 per pair and chunk), and their rows in the chunk's table."""
    a, b = (f"logp_{role}" for role in aggregate.pair_roles(pair))
    tokens = chunk.pair(a, b)
    view = tokens.view
    rows = view.memo("rows", lambda: np.arange(len(view.table)) if view.mask is None else np.flatnonzero(view.mask))
    return rows, tokens


@dataclass(kw_only=True, slots=True)
class Digest:
    """The page's token-derived data."""

    scored: list[str]                        # pairs whose log-prob columns the table has
    histograms: dict[str, aggregate.Histogram]  # pair -> its log-ratio histogram
    by_position: aggregate.Breakdown | None
    by_turn: aggregate.Breakdown | None
    worst: WorstBlock | None
    worst_tokens: list[dict[str, object]]  # the worst tokens as the page's table shows them (_with_texts)


class DigestAnalysis:
    """The Digest as an Analysis of a token table's chunks (mismatch.analysis.chunked): an audit
    runs it in its own passes, `digest` on a results dir. Pass 0: per pair the count and extremes
    of the log-ratio and its top 0.1% (against `expected`, an upper bound of each pair's finite
    count), the stream's longest position, the focus pair's rollout ranking and worst tokens; a
    pass for that tail alone when `expected` is missing; then the histograms over the common
    x-range, the per-position (and per-turn) sums and the rows of the worst rollouts."""

    def __init__(self, columns: list[str], *, pairs: list[str], focus: str | None, options: WorstOptions,
                 with_turns: bool, with_worst_tokens: bool, expected: dict[str, int] | None = None) -> None:
        from mismatch.analysis.tails import Tails

        self.columns, self.pairs, self.focus, self.options = columns, pairs, focus, options
        self.with_turns, self.with_worst_tokens = with_turns, with_worst_tokens
        self.scored = [p for p in pairs if all(f"logp_{role}" in columns for role in aggregate.pair_roles(p))]
        self.found = {pair: _PairTokenSums(pair) for pair in self.scored}
        for pair, state in self.found.items():
            if expected and expected.get(pair):
                state.tails = Tails(np.array([int(expected[pair])]), [0.999])
        self.ranks: list[pd.DataFrame] = []
        self.worst_tokens: list[WorstToken] = []
        self.max_pos = -1
        self.stage = "first"  # then "tails" (only without `expected`), "last", "done"
        self.populated: list[_PairTokenSums] = []
        self.missing: list[_PairTokenSums] = []  # pairs whose tail takes a pass of its own (no `expected`)
        self.limit, self.width = 1e-3, 1
        self.ranked: pd.DataFrame | None = None
        self.top: pd.DataFrame | None = None
        self.rows_of: dict[str, pd.DataFrame] = {}

    def wants(self, index: int) -> bool:
        if index == 0:
            return True
        if self.stage == "first":
            self.populated = [state for state in self.found.values() if state.n]
            finite = [state for state in self.populated if state.finite]
            self.missing = [s for s in finite if s.tails is None or int(s.tails.counts[0]) < s.finite]
            if self.missing:
                from mismatch.analysis.tails import Tails

                for state in self.missing:
                    state.tails = Tails(np.array([state.finite]), [0.999])
                self.stage = "tails"
                return True
            self._before_last()
            return True
        if self.stage == "tails":
            self._before_last()
            return True
        self.stage = "done"
        return False

    def _before_last(self) -> None:
        self.limit = _histogram_limit(self.populated)
        self.width = max(1, int(aggregate.nice_ceil((self.max_pos + 1) / aggregate.MAX_POSITION_BINS)))
        self.ranked = _ranked(self.ranks)
        self.top = self.ranked.head(self.options.num_rollouts) if self.ranked is not None else None
        self.stage = "last"

    def add(self, chunk: Chunk, index: int) -> None:
        if index == 0:
            self._first(chunk)
        elif self.stage == "tails":
            for state in self.missing:
                log_ratio = _pair_tokens(chunk, state.pair)[1].log_ratio
                values = np.abs(log_ratio[np.isfinite(log_ratio)])
                state.tails.add(values, np.zeros(len(values), dtype=np.int64))
        else:
            self._last(chunk)

    def merge(self, other: DigestAnalysis, index: int) -> None:
        """Take in what the pass found in later chunks (its stage is this one's: set before the pass)."""
        if index == 0:
            for pair, state in self.found.items():
                theirs = other.found[pair]
                state.n, state.finite = state.n + theirs.n, state.finite + theirs.finite
                state.max_abs = max(state.max_abs, theirs.max_abs)
                if state.tails is not None and theirs.tails is not None:
                    state.tails.merge(theirs.tails)
            self.max_pos = max(self.max_pos, other.max_pos)
            self.ranks.extend(other.ranks)
            self.worst_tokens = _worst_tokens(self.worst_tokens + other.worst_tokens)
        elif self.stage == "tails":
            for state, theirs in zip(self.missing, other.missing):
                state.tails.merge(theirs.tails)
        else:
            for state, theirs in zip(self.populated, other.populated):
                if theirs.histogram is not None:
                    state.histogram = aggregate.merge_histograms(state.histogram, theirs.histogram)
                state.by_position.merge(theirs.by_position)
                state.by_turn.merge(theirs.by_turn)
            self.rows_of.update(other.rows_of)

    def _first(self, tokens: Chunk) -> None:
        chunk = tokens.table
        for pair, state in self.found.items():
            rows, pair_tokens = _pair_tokens(tokens, pair)
            if not len(rows):
                continue
            log_ratio = pair_tokens.log_ratio
            finite = np.abs(log_ratio[np.isfinite(log_ratio)])
            state.n, state.finite = state.n + len(rows), state.finite + len(finite)
            if state.tails is not None:
                state.tails.add(finite, np.zeros(len(finite), dtype=np.int64))
            state.max_abs = max(state.max_abs, float(finite.max()) if len(finite) else -math.inf)
            self.max_pos = max(self.max_pos, int(chunk["pos"].to_numpy()[rows].max()))
            if pair == self.focus:
                self.ranks.append(_rank(chunk, rows, pair_tokens))
                if self.with_worst_tokens:
                    self.worst_tokens = _worst_tokens(self.worst_tokens + _chunk_worst(chunk, rows, log_ratio, pair))

    def _last(self, tokens: Chunk) -> None:
        chunk = tokens.table
        for state in self.populated:
            rows, pair_tokens = _pair_tokens(tokens, state.pair)
            log_ratio = pair_tokens.log_ratio
            if len(rows):
                state.histogram = aggregate.merge_histograms(state.histogram, aggregate.histogram(log_ratio, self.limit))
            pos = chunk["pos"].to_numpy()[rows].astype(np.int64)
            token_terms = aggregate.TokenTerms.of(pair_tokens)  # once for both breakdowns
            state.by_position.add((pos // self.width) * self.width, token_terms)
            if self.with_turns:
                state.by_turn.add(chunk["turn"].to_numpy()[rows].astype(np.int64), token_terms)
        top_names = set(self.top["rollout"]) if self.top is not None else set()
        if top_names:
            codes, names = _rollout_codes(chunk)
            for code in np.flatnonzero(np.isin(names, list(top_names))).tolist():
                if (codes == code).any():
                    self.rows_of[names[code]] = chunk[codes == code].reset_index(drop=True)

    def result(self, tokenizer_path: Path | None) -> Digest:
        populated = self.populated
        return Digest(scored=self.scored, histograms={s.pair: s.histogram for s in populated if s.histogram},
                      by_position=aggregate.by_position_block({s.pair: s.by_position for s in populated}, self.width),
                      by_turn=aggregate.by_turn_block({s.pair: s.by_turn for s in populated})
                      if self.with_turns else None,
                      worst=_worst(self.top, self.ranked, self.rows_of, self.columns, pairs=self.scored,
                                   focus=self.focus, tokenizer_path=tokenizer_path, options=self.options),
                      worst_tokens=_with_texts(self.worst_tokens, tokenizer_path, self.focus))


def digest(chunks: Chunks, columns: list[str], *, pairs: list[str], focus: str, tokenizer_path: Path | None,
           options: WorstOptions, with_turns: bool, with_worst_tokens: bool,
           expected: dict[str, int] | None = None) -> Digest:
    """The Digest of the token table's chunks (`columns`: the table's column names). `expected`:
    each pair's token count as summary.json has it, at least its finite |log-ratio| count, so the
    tail behind the histograms' range is gathered in the first pass (else in a pass of its own)."""
    from mismatch.analysis.chunked import run_passes

    found = DigestAnalysis(columns, pairs=pairs, focus=focus, options=options, with_turns=with_turns,
                      with_worst_tokens=with_worst_tokens, expected=expected)
    run_passes(chunks, [found])
    return found.result(tokenizer_path)


def _histogram_limit(populated: list[_PairTokenSums]) -> float:
    """aggregate.histogram_limit's rule, with p99.9 of |log-ratio| per pair from its top 0.1%
    (at most ceil(0.001 n) + 1 values per pair, n its count gathered or an upper bound of it)."""
    finite = [state for state in populated if state.finite]
    if not finite:
        return 1e-3
    for state in finite:  # the ranks of the count gathered (kept: enough for any count up to the expected)
        state.tails.counts = np.array([state.finite])
    p999 = max(float(s.tails.quantiles()[0, 0]) for s in finite)
    return aggregate.limit_rule(max(s.max_abs for s in finite), p999)


def _rollout_codes(chunk: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(code per row, rollout id per code): the categorical's own codes, no string per row."""
    rollout = chunk["rollout"]
    if isinstance(rollout.dtype, pd.CategoricalDtype):
        return rollout.cat.codes.to_numpy(), np.asarray(rollout.cat.categories.astype(str), dtype=object)
    codes, names = pd.factorize(rollout)
    return codes, np.asarray(pd.Index(names).astype(str), dtype=object)


def _rank(chunk: pd.DataFrame, rows: np.ndarray, tokens: PairTokens) -> pd.DataFrame:
    """Per rollout of the chunk (a rollout lies in one chunk): max |log-ratio|, mean k3, scored tokens."""
    log_ratio = tokens.log_ratio
    codes, names = _rollout_codes(chunk)
    # Per rollout by bincount (a pandas groupby-agg took ~15 ms a chunk); as groupby's max and
    # mean, a NaN term (k3 of an infinite log-ratio) is left out of the mean.
    group, present = pd.factorize(codes[rows])
    abs_lr = tokens.abs_log_ratio  # the pair's, which the span sums and strata read too
    top = np.full(len(present), -np.inf)
    np.maximum.at(top, group, abs_lr)
    with np.errstate(over="ignore", invalid="ignore"):
        k3 = tokens.k3  # the pair's k3, which the span sums and strata read too
        kept = ~np.isnan(k3)
        k3_mean = (np.bincount(group[kept], weights=k3[kept], minlength=len(present))
                   / np.bincount(group[kept], minlength=len(present)))
    return pd.DataFrame({"rollout": names[present], "max_abs_log_ratio": top, "kl_k3_mean": k3_mean,
                         "n_scored": np.bincount(group, minlength=len(present))})


def _ranked(ranks: list[pd.DataFrame]) -> pd.DataFrame | None:
    """Every rollout, worst first (the token that hurts PPO most, then mean k3, then the id)."""
    if not ranks:
        return None
    ranked = pd.concat(ranks, ignore_index=True)
    return ranked.sort_values(["max_abs_log_ratio", "kl_k3_mean", "rollout"], ascending=[False, False, True],
                              kind="stable", na_position="last").reset_index(drop=True)


def _worst(top: pd.DataFrame | None, ranked: pd.DataFrame | None, rows_of: dict[str, pd.DataFrame],
           columns: list[str], *, pairs: list[str], focus: str, tokenizer_path: Path | None,
           options: WorstOptions) -> WorstBlock | None:
    """The page's `worst` block: the top rollouts token by token (worst.rollout_detail)."""
    if top is None or ranked is None or top.empty:
        return None
    roles = logp_roles(pd.DataFrame(columns=columns))
    ranked_top: list[RankedRollout] = top.to_dict("records")  # _rollout_rank's columns
    details = [rollout_detail(rows_of[record["rollout"]], pairs=pairs, roles=roles, ranked=record, focus=focus,
                              options=options) for record in ranked_top]
    ids = {i for d in details for i in d["token_id"]}
    return {"focus": focus, "pairs": pairs, "roles": roles, "rank_by": "max |log-ratio| on trainable tokens",
            "num_ranked": len(ranked), "rollouts": details,
            "scale": {pair: color_scale(details, pair) for pair in pairs},
            "text": token_texts(ids, tokenizer_path)}


def _chunk_worst(chunk: pd.DataFrame, rows: np.ndarray, log_ratio: np.ndarray, pair: str) -> list[WorstToken]:
    """The chunk's WORST_TOKENS trainable tokens by |log-ratio| (ties: the earlier row)."""
    a, b = (f"logp_{role}" for role in aggregate.pair_roles(pair))
    gap = np.abs(log_ratio)
    candidates = np.arange(len(gap))
    if len(gap) > WORST_TOKENS:  # only the tokens at or above the k-th largest gap are sorted
        candidates = np.flatnonzero(gap >= np.partition(gap, len(gap) - WORST_TOKENS)[len(gap) - WORST_TOKENS])
    picked = rows[candidates[np.argsort(-gap[candidates], kind="stable")[:WORST_TOKENS]]]
    logp_a, logp_b = chunk[a].to_numpy(np.float64), chunk[b].to_numpy(np.float64)
    # Each column looked up once: a frame's column lookup costs more than the 20 values read from it.
    rollout, branch, turn, pos, token_id = (chunk[name] for name in ("rollout", "branch", "turn", "pos", "token_id"))
    return [WorstToken(rollout=str(rollout.iat[row]), branch=str(branch.iat[row]), turn=int(turn.iat[row]),
                       pos=int(pos.iat[row]), token_id=int(token_id.iat[row]), logp_a=float(logp_a[row]),
                       logp_b=float(logp_b[row]), abs_log_ratio=float(abs(logp_a[row] - logp_b[row])))
            for row in picked.tolist()]


def _worst_tokens(candidates: list[WorstToken]) -> list[WorstToken]:
    """The WORST_TOKENS largest, earlier chunks first among equals (a stable sort)."""
    return sorted(candidates, key=lambda token: -token.abs_log_ratio)[:WORST_TOKENS]


def _with_texts(tokens: list[WorstToken], tokenizer_path: Path | None, pair: str) -> list[dict[str, object]]:
    """Each worst token as the page's table row: its text in place of its id (the id when there is
    no tokenizer), its log-probs under the pair's own column names."""
    texts = token_texts({token.token_id for token in tokens}, tokenizer_path) or {}
    a, b = (f"logp_{role}" for role in aggregate.pair_roles(pair))
    return [{"rollout": t.rollout, "branch": t.branch, "turn": t.turn, "pos": t.pos,
             "token": texts.get(str(t.token_id), f"#{t.token_id}"), a: t.logp_a, b: t.logp_b,
             "|log-ratio|": t.abs_log_ratio} for t in tokens]
