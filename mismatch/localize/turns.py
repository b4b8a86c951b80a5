"""Where in a rollout the gap lives: by turn (with an onset rule), along position, by token probability.

The turn step of localize: token table (`logp_*` columns) -> `summary.json["localization"]["turns"]`.
numpy/pandas only, so a report or a trainer can call it without torch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis.chunked import Chunk, Chunks, run_passes
from mismatch.results.chunks import table_chunks
from mismatch.analysis.grouped_metrics import OVERALL, GroupedPairMetrics
from mismatch.analysis.moments import Moments
from mismatch.analysis.metrics import (
    token_group_metrics,
    token_group_sums,
)
from mismatch.errors import MismatchError
from mismatch.localize.slope import POSITION_UNIT, SlopeFit, no_slope
from mismatch.results import json_safe

# Per-group metrics kept in each breakdown row (the full PAIR_METRICS live in summary["turns"]).
BREAKDOWN_METRICS = ("n_tokens", "n_rollouts", "log_ratio_mean", "log_ratio_abs_mean",
                     "log_ratio_abs_max", "kl_k3", "frac_outside_2", "bitwise_equal_frac")

# Edges of the probability buckets of p_B = exp(logp_B): [0, 1e-3), [1e-3, 1e-2), ..., [0.9, 1].
PROB_EDGES = (1e-3, 1e-2, 0.1, 0.5, 0.9)
PROB_LABELS = ("p<0.001", "0.001-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", "p>=0.9")

STATISTICS = ("prob_adjusted", "raw")  # what the onset rule compares across turns
MAD_TO_SIGMA = 1.4826  # MAD of a normal sample times this estimates its standard deviation


@dataclass(kw_only=True, slots=True, frozen=True)
class OnsetRule:
    """Parameters of the onset rule; see `localize_turns` for the rule itself."""

    statistic: str = "prob_adjusted"  # or "raw": the turn's plain mean |log_ratio|
    k: float = 3.0            # robust standard deviations above the earlier turns' median
    factor: float = 1.5       # ... and at least this many times that median
    min_abs: float = 1e-4     # ... and raw mean |log_ratio| at least this far (nats) above theirs
    min_tokens: int = 8       # turns with fewer tokens are reported but never compared
    min_history: int = 1      # earlier (compared) turns needed before a turn can be the onset

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS:
            raise MismatchError(f"onset statistic {self.statistic!r} is not one of: {', '.join(STATISTICS)}")

    def describe(self) -> str:
        stat = ("x_t = mean |log_ratio| of turn t / its expected value given the B-probability "
                "buckets of its tokens" if self.statistic == "prob_adjusted"
                else "x_t = mean |log_ratio| of turn t")
        return (f"{stat}; onset = first turn t (of turns with >= {self.min_tokens} tokens, after >= "
                f"{self.min_history} earlier such turns) with x_t > max(m + {self.k:g}*max(1.4826*MAD, "
                f"se_t), {self.factor:g}*m) and raw mean |log_ratio| > {self.min_abs:g} + the earlier "
                "turns' median, where m and MAD are the median and median absolute deviation of x "
                "over the earlier turns and se_t is the standard error of x_t")


def localize_turns(table: pd.DataFrame | Chunks, a: str = "train", b: str = "sampler", *,
                   trainable_only: bool = True, rule: OnsetRule = OnsetRule()) -> dict[str, Any]:
    """`summary.json["localization"]["turns"]` for the pair A/B (log_ratio = logp_A - logp_B).

    `table` is a token table, or its chunks of whole rollouts (analysis/chunked.py), read twice.
    Uses the token table's `turn`, `pos`, `role`, `branch_kind`, `rollout`, `branch` and
    `trainable` columns; only trainable tokens by default, and only tokens where both log-probs
    are defined. Returns JSON-safe values (NaN -> None).

    Onset rule (stated in the output as `onset_rule`, parameters in `onset_params`): each turn
    gets a statistic x_t. By default (`prob_adjusted`) x_t is the turn's mean |log_ratio| over
    its expected value, the mean over its tokens of the overall mean |log_ratio| of their
    probability bucket (`by_prob_bucket`): mismatch lives in low-probability tokens, so a turn
    of mostly templated, near-certain tokens would otherwise look clean and the next turn
    would look like an onset (as in examples/rollouts.jsonl, which has no fault: benchmarks/RESULTS.md).
    `raw` uses the plain mean |log_ratio|.
    Turns with fewer than `min_tokens` tokens are listed but skipped. A turn t with at least
    `min_history` earlier kept turns departs when
        x_t > max(m + k * max(1.4826 * MAD, se_t),  factor * m)
        and  mean |log_ratio|_t > median of the earlier turns' mean |log_ratio| + min_abs
    where m and MAD are the median and median absolute deviation of x over the earlier kept
    turns and se_t is the standard error of x_t. The MAD term asks for a jump beyond the
    turn-to-turn noise, se_t keeps one small noisy turn from triggering it, and the factor and
    min_abs terms ask for a jump that matters. `onset_turn` is the first departing turn.

    `position_slope`: OLS of |log_ratio| on `pos` (context length, per 1000 tokens) with a 95%
    Student-t confidence interval; `grows_with_position` = slope > 0 and the CI excludes 0.
    Tokens of one sequence are not independent, so a sequence-clustered CI is given too
    (`ci95_cluster_per_1k`), which is wider when whole sequences sit high or low.
    """
    chunks = table if callable(table) else table_chunks(table)
    found = TurnLocalizer(a, b, trainable_only=trainable_only, rule=rule)
    run_passes(chunks, [found])
    return found.result()


class TurnLocalizer:
    """localize_turns as an Analysis: pass 0 sums the breakdowns, the probability buckets and the
    position fit's moments; pass 1 the fit's residuals (and, where an ESS needs them, far sums)."""

    def __init__(self, a: str = "train", b: str = "sampler", *, trainable_only: bool = True,
                 rule: OnsetRule = OnsetRule()) -> None:
        self.a, self.b, self.trainable_only, self.rule = a, b, trainable_only, rule
        self.columns = (f"logp_{a}", f"logp_{b}")
        self.groups = GroupedPairMetrics([(a, b)], ("turn", "role", "branch_kind"), trainable_only=trainable_only,
                                         quantiles=False)
        self.tokens = _TurnTokens(*self.columns, trainable_only)
        self.fit: SlopeFit | None = None
        self.groups_pass = False  # whether the breakdowns read the current pass
        self.onset: _OnsetRollouts | None = None  # pass 1: who shows the onset, and what its turn holds

    def wants(self, index: int) -> bool:
        self.groups_pass = self.groups.wants(index)
        if index == 1:
            self.fit = SlopeFit.of(self.tokens.moments, self.tokens.x_range)
            onset = self._onset_turn()
            self.onset = _OnsetRollouts(*self.columns, onset, self.rule, self.trainable_only) \
                if onset is not None else None
        return self.groups_pass or (index == 1 and (self.fit is not None or self.onset is not None))

    def _onset_turn(self) -> Any:
        """The onset from pass 0's sums (known before pass 1, so pass 1 can ask who shows it)."""
        found = self.groups.result()
        frame = found["turn"][f"{self.a}/{self.b}"]
        if not int(found[OVERALL][f"{self.a}/{self.b}"]["n_tokens"].iloc[0]):
            return None
        return next((row["turn"] for row in _by_turn(frame, self.tokens, self.rule) if row["departs"]), None)

    def add(self, chunk: Chunk, index: int) -> None:
        if index == 0:
            needed = (*self.columns, "turn", "pos", "role", "branch_kind")
            missing = [c for c in needed if c not in chunk.table.columns]
            if missing:
                raise MismatchError(f"pair {self.a}/{self.b}: token table has no column {missing[0]!r} "
                                    f"(columns: {', '.join(map(str, chunk.table.columns))})")
            self.tokens.add(chunk)
        else:
            if self.fit is not None:
                self.tokens.add_residuals(chunk, self.fit)
            if self.onset is not None:
                self.onset.add(chunk)
        if self.groups_pass:
            self.groups.add(chunk, index)

    def merge(self, other: TurnLocalizer, index: int) -> None:
        if index == 0:
            self.tokens.merge(other.tokens)
        else:
            if self.fit is not None and other.fit is not None:
                self.fit.merge(other.fit)
            if self.onset is not None and other.onset is not None:
                self.onset.merge(other.onset)
        if self.groups_pass:
            self.groups.merge(other.groups, index)

    def result(self) -> dict[str, Any]:
        found = {by: frames[f"{self.a}/{self.b}"] for by, frames in self.groups.result().items()}
        slope = (self.fit.result() if self.fit is not None
                 else no_slope(self.tokens.moments.n))
        n_tokens = int(found[OVERALL]["n_tokens"].iloc[0])
        by_turn = _by_turn(found["turn"], self.tokens, self.rule) if n_tokens else []
        onset = next((row["turn"] for row in by_turn if row["departs"]), None)
        return json_safe({
            "pair": f"{self.a}/{self.b}",
            "trainable_only": self.trainable_only,
            "n_tokens": n_tokens,
            "onset_turn": onset,
            "onset": self.onset.result() if self.onset is not None and onset == self.onset.turn else None,
            "onset_rule": self.rule.describe(),
            "onset_params": asdict(self.rule),
            "by_turn": by_turn,
            "position_slope": slope,
            "by_prob_bucket": _by_prob_bucket(self.tokens.bucket_metrics()),
            "by_role": _breakdown(found["role"], "role") if n_tokens else [],
            "by_branch_kind": _breakdown(found["branch_kind"], "branch_kind") if n_tokens else [],
        })


class _OnsetRollouts:
    """Pass 1, once the onset turn k is known: each rollout's mean |log_ratio| before turn k and from
    it on (a rollout lies in one chunk: per-rollout rows, appended), and what the rows of turn k
    hold next to those of the turns before it (by role and branch kind, every row: the context a
    turn adds is its prompts, tool results and summaries)."""

    def __init__(self, col_a: str, col_b: str, turn: Any, rule: OnsetRule, trainable_only: bool) -> None:
        self.col_a, self.col_b, self.turn, self.rule, self.trainable_only = col_a, col_b, turn, rule, trainable_only
        self.rollouts: list[tuple[str, float, int, float, int]] = []  # (rollout, sum before, n, sum from k, n)
        self.at_turn: dict[str, Counter] = {"role": Counter(), "branch_kind": Counter()}
        self.before: dict[str, Counter] = {"role": Counter(), "branch_kind": Counter()}

    def add(self, chunk: Chunk) -> None:
        table = chunk.table
        turn = table["turn"].to_numpy()
        logp_a, logp_b = table[self.col_a].to_numpy(np.float64), table[self.col_b].to_numpy(np.float64)
        scored = np.isfinite(logp_a) & np.isfinite(logp_b)
        if self.trainable_only:
            scored &= table["trainable"].to_numpy(bool)
        codes, names = pd.factorize(table["rollout"], sort=False)
        abs_ratio = np.where(scored, np.abs(logp_a - logp_b), 0.0)
        late = turn >= self.turn
        sums = [np.bincount(codes, weights=abs_ratio * (scored & side), minlength=len(names)) for side in (~late, late)]
        counts = [np.bincount(codes, weights=(scored & side).astype(np.float64), minlength=len(names))
                  for side in (~late, late)]
        self.rollouts += [(str(name), float(sums[0][i]), int(counts[0][i]), float(sums[1][i]), int(counts[1][i]))
                          for i, name in enumerate(names)]
        for column in ("role", "branch_kind"):
            self.at_turn[column].update(table[column][turn == self.turn].astype(str).value_counts().to_dict())
            self.before[column].update(table[column][turn < self.turn].astype(str).value_counts().to_dict())

    def merge(self, other: _OnsetRollouts) -> None:
        self.rollouts += other.rollouts
        for column in ("role", "branch_kind"):
            self.at_turn[column].update(other.at_turn[column])
            self.before[column].update(other.before[column])

    def result(self) -> dict[str, Any]:
        """`localization.turns.onset`: the rollouts that step up at the onset (their mean |log_ratio|
        from turn k over before it, by the onset rule's factor and min_abs), worst first, and what
        turn k holds that the turns before it did not."""
        compared, departing = [], []
        for rollout, before, n_before, after, n_after in self.rollouts:
            if not (n_before and n_after):
                continue
            mean_before, mean_after = before / n_before, after / n_after
            compared.append(rollout)
            if mean_after > self.rule.factor * mean_before + self.rule.min_abs:
                departing.append({"rollout": rollout, "abs_mean_before": mean_before, "abs_mean_from": mean_after})
        departing.sort(key=lambda row: (-(row["abs_mean_from"] - row["abs_mean_before"]), row["rollout"]))
        roles, kinds = self.at_turn["role"], self.at_turn["branch_kind"]
        return {"turn": self.turn, "n_rollouts_compared": len(compared), "n_rollouts_departing": len(departing),
                "rollouts": departing[:10], "rows_by_role": dict(sorted(roles.items())),
                "rows_by_branch_kind": dict(sorted(kinds.items())),
                "new_roles": sorted(set(roles) - set(self.before["role"])),
                "new_branch_kinds": sorted(set(kinds) - set(self.before["branch_kind"]))}


class _TurnTokens:
    """What the turn localizer needs token by token, chunk by chunk: sums per probability bucket,
    tokens per (turn, bucket), and the moments of the position fit (then its residuals)."""

    def __init__(self, col_a: str, col_b: str, trainable_only: bool) -> None:
        self.col_a, self.col_b, self.trainable_only = col_a, col_b, trainable_only
        self.bucket_sums: dict[str, np.ndarray] = {}
        self.turn_bucket: dict[Any, np.ndarray] = {}  # turn -> tokens per bucket
        self.moments = Moments()  # of (pos / 1000, |log_ratio|)
        self.x_range = (math.inf, -math.inf)

    def add(self, chunk: Chunk) -> None:
        pair = chunk.pair(self.col_a, self.col_b, self.trainable_only)
        tokens = pair.view
        if not tokens.num_tokens:
            return
        bucket = _prob_bucket(pair.logp_b)
        sums = token_group_sums(pair, bucket, len(PROB_LABELS))
        for name, values in sums.items():
            merge = np.maximum if name.endswith("_max") else np.add
            self.bucket_sums[name] = merge(self.bucket_sums[name], values) if name in self.bucket_sums else values
        spans = tokens.spans_for(["turn"])
        turns = tokens.series_at("turn", spans.starts)
        turn_codes, turn_keys = pd.factorize(turns, sort=True)
        counts = np.bincount(spans.spread(turn_codes * len(PROB_LABELS)) + bucket,
                             minlength=len(turn_keys) * len(PROB_LABELS)).reshape(len(turn_keys), -1)
        for key, row in zip(turn_keys.tolist(), counts):
            self.turn_bucket[key] = self.turn_bucket[key] + row if key in self.turn_bucket else row
        x = tokens.column("pos").astype(np.float64) / POSITION_UNIT
        self.moments.add(np.stack([x, np.abs(pair.log_ratio)]))
        self.x_range = (min(self.x_range[0], float(x.min())), max(self.x_range[1], float(x.max())))

    def merge(self, other: _TurnTokens) -> None:
        for name, values in other.bucket_sums.items():
            merge = np.maximum if name.endswith("_max") else np.add
            self.bucket_sums[name] = merge(self.bucket_sums[name], values) if name in self.bucket_sums else values
        for key, row in other.turn_bucket.items():
            self.turn_bucket[key] = self.turn_bucket[key] + row if key in self.turn_bucket else row
        self.moments.merge(other.moments)
        self.x_range = (min(self.x_range[0], other.x_range[0]), max(self.x_range[1], other.x_range[1]))

    def add_residuals(self, chunk: Chunk, fit: SlopeFit) -> None:
        """The fit's residuals (their sum of squares, and each sequence's score, clustered by sequence)."""
        pair = chunk.pair(self.col_a, self.col_b, self.trainable_only)
        tokens = pair.view
        if tokens.num_tokens:
            spans = tokens.spans  # spans never cross sequences: per-sequence sums through them
            fit.add_residuals(tokens.column("pos").astype(np.float64) / POSITION_UNIT, np.abs(pair.log_ratio),
                              lambda values: np.bincount(tokens.span_seq, weights=spans.sum(values),
                                                         minlength=tokens.num_seqs))

    def bucket_metrics(self) -> pd.DataFrame:
        """BREAKDOWN_METRICS per probability bucket (empty buckets: zero counts, NaN metrics)."""
        return token_group_metrics(self.bucket_sums, len(PROB_LABELS))

    def expected_abs_mean(self, turn: Any, bucket_mean: np.ndarray) -> float:
        """The turn's expected mean |log_ratio| given the probability buckets of its tokens."""
        counts = self.turn_bucket[turn]
        return float((counts * bucket_mean).sum() / counts.sum())


def _records(frame: pd.DataFrame, by: str) -> list[dict[str, Any]]:
    columns = [by, *BREAKDOWN_METRICS]
    return [{key: (value.item() if hasattr(value, "item") else value) for key, value in row.items()}
            for row in frame[columns].to_dict("records")]


def _breakdown(frame: pd.DataFrame, by: str) -> list[dict[str, Any]]:
    frame = _without_empty(frame)
    frame[by] = frame[by].astype(str)  # role and branch_kind are categoricals; JSON wants str
    return _records(frame, by)


def _without_empty(frame: pd.DataFrame) -> pd.DataFrame:
    # Groups whose tokens all lack a log-prob of the pair: a breakdown lists only what it measured.
    return frame[frame["n_tokens"] > 0].reset_index(drop=True)


def _by_prob_bucket(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Mismatch by B's probability of the realized token; empty buckets keep a row (n_tokens 0)."""
    out = []
    for index, (label, row) in enumerate(zip(PROB_LABELS, frame[list(BREAKDOWN_METRICS)].to_dict("records"))):
        lo = 0.0 if index == 0 else PROB_EDGES[index - 1]
        hi = PROB_EDGES[index] if index < len(PROB_EDGES) else 1.0
        out.append({"bucket": label, "p_min": lo, "p_max": hi, **row})
    return out


def _by_turn(frame: pd.DataFrame, tokens: _TurnTokens, rule: OnsetRule) -> list[dict[str, Any]]:
    frame = _without_empty(frame)
    rows = _records(frame, "turn")
    n_t = frame["n_tokens"].to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        # Sample std (ddof=1) of |log_ratio| per turn from moments the metrics hold: mean(x^2) =
        # 2 * kl_k2 and mean |x|; no pass over the tokens.
        mean_sq = 2.0 * frame["kl_k2"].to_numpy()
        std = np.sqrt(np.maximum(mean_sq - np.square(frame["log_ratio_abs_mean"].to_numpy()), 0.0) * n_t / (n_t - 1))
    # Each turn's tokens by bucket: the turn's expected mean |log_ratio| given its probability mix.
    bucket_mean = np.nan_to_num(tokens.bucket_metrics()["log_ratio_abs_mean"].to_numpy())  # empty buckets hold no tokens
    history_x: list[float] = []    # x of the earlier kept turns
    history_raw: list[float] = []  # their raw mean |log_ratio|
    for index, row in enumerate(rows):
        n_t, raw_t = row["n_tokens"], row["log_ratio_abs_mean"]
        std_t, expected_t = float(std[index]) if n_t > 1 else math.nan, tokens.expected_abs_mean(row["turn"], bucket_mean)
        se_raw = std_t / math.sqrt(n_t) if n_t > 1 and np.isfinite(std_t) else math.inf
        if rule.statistic == "raw":
            x_t, se_t = raw_t, se_raw
        elif expected_t > 0:
            x_t, se_t = raw_t / expected_t, se_raw / expected_t
        else:  # every bucket this turn touches is bitwise equal everywhere: as expected
            x_t, se_t = 1.0, se_raw
        row.update(expected_abs_mean=expected_t, onset_stat=x_t, compared=n_t >= rule.min_tokens,
                   baseline=None, threshold=None, departs=False)
        if not row["compared"]:
            continue
        if len(history_x) >= rule.min_history:
            median = float(np.median(history_x))
            mad = float(np.median(np.abs(np.asarray(history_x) - median)))
            threshold = max(median + rule.k * max(MAD_TO_SIGMA * mad, se_t), rule.factor * median)
            matters = raw_t > float(np.median(history_raw)) + rule.min_abs
            row.update(baseline=median, threshold=threshold, departs=bool(x_t > threshold and matters))
        history_x.append(x_t)
        history_raw.append(raw_t)
    return rows


def _prob_bucket(logp_N: np.ndarray) -> np.ndarray:
    """Index into PROB_LABELS of each token's probability; edges compared in log space.

    As np.searchsorted(log edges, logp, side="right"), by one comparison per edge (faster: few edges).
    """
    bucket = np.zeros(len(logp_N), dtype=np.int32)
    for edge in np.log(PROB_EDGES):
        bucket += logp_N >= edge
    return bucket
