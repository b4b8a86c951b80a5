"""What changed between two windows of steps: the gap's growth split over the strata of summary.json
(length, position, probability, entropy), the turns and branch kinds that grew, the layer where the
two engines part, and the recorded inputs (each engine's configuration) that differ.

The strata split is a shift-share decomposition of the token-weighted mean gap G = Σ_b w_b g_b over
buckets b (w: the share of tokens, g: the bucket's mean k3): G' − G = Σ_b (w'_b − w_b)·g_b (mix:
more tokens in some buckets, e.g. longer responses) + Σ_b w'_b·(g'_b − g_b) (within: the buckets'
own gap grew). A bucket empty before takes g_b = g'_b, so the identity is exact. Where the within
part concentrates: the buckets whose gap grew by more than the whole's; the dimension explains the
growth when their gap grew by a larger factor than the other buckets' gap (contrast = factor /
rest's factor: 1 when every bucket grew by one factor, whatever its share).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from msgspec import UNSET

from mismatch.results.section_records import LayerLocalization
from mismatch.results.summary_model import BranchKindRow, TurnRow, present
from mismatch.trend.steps import Step

MIN_REST_SHARE = 0.1     # the other buckets must have held this share of the gap for a contrast to mean anything
MIN_GROWTH_SHARE = 0.02  # a hot bucket holds at least this share of the growth
MIN_CONTRAST = 1.5  # a dimension explains the growth when its hot buckets' gap grew 1.5x the rest's factor
# What a run draws anew at every step without reconfiguring any engine: the sampling seed and how
# many rollouts (or samples per prompt) the step drew. Two steps differing there ran the same engine.
PER_STEP_FACTS = frozenset({"seed", "sampling_seed", "n", "num_rollouts", "n_rollouts", "num_samples", "rollouts"})
_UNITS = {"length": "response length (trained tokens in the rollout)", "position": "position in the stream",
          "prob": "token probability", "entropy": "trainer entropy (nats)"}


def pooled_stratum(steps: Sequence[Step], pair: str, dimension: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(edges, tokens, Σ k3) per bucket over the steps' summaries; None where any step lacks it."""
    edges, n, k3 = None, None, None
    for step in steps:
        stratum = step.strata.get(pair, {}).get(dimension)
        if stratum is None or stratum.n_tokens is UNSET:
            return None
        counts = np.asarray(stratum.n_tokens, np.float64)
        means = np.array([math.nan if v is None else v for v in stratum.kl_k3 or ()], np.float64)
        sums = np.where(counts > 0, np.nan_to_num(means) * counts, 0.0)
        if edges is None:
            edges, n, k3 = np.asarray(stratum.edges, np.float64), counts, sums
        elif len(counts) != len(n):
            return None
        else:
            n, k3 = n + counts, k3 + sums
    return (edges, n, k3) if edges is not None else None


def shift_share(before: tuple[np.ndarray, np.ndarray, np.ndarray], after: tuple[np.ndarray, np.ndarray, np.ndarray],
                dimension: str) -> dict[str, Any] | None:
    """The decomposition of the module docstring for one dimension; None without tokens on a side."""
    edges, n0, s0 = before
    _, n1, s1 = after
    if n0.sum() <= 0 or n1.sum() <= 0:
        return None
    w0, w1 = n0 / n0.sum(), n1 / n1.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        g1 = np.where(n1 > 0, s1 / n1, 0.0)
        g0 = np.where(n0 > 0, s0 / n0, g1)
    total = float(np.sum(w1 * g1) - np.sum(w0 * g0))
    mix = float(np.sum((w1 - w0) * g0))
    return {"gap_before": float(np.sum(w0 * g0)), "gap_after": float(np.sum(w1 * g1)), "growth": total,
            "mix": mix, "within": float(np.sum(w1 * (g1 - g0))), "hot": _hot_buckets(edges, w1, g0, g1, dimension)}


def _hot_buckets(edges: np.ndarray, w1: np.ndarray, g0: np.ndarray, g1: np.ndarray, dimension: str) -> dict[str, Any] | None:
    """The buckets whose gap grew by more than the whole's (g'/g above Σw'g'/Σw'g: relative, not
    absolute, since where the gap is larger a growth by one factor everywhere grows more in absolute
    terms, and that is no concentration), and the factor their gap grew by against the other buckets'.
    The contrast of the two is only claimed where the other buckets held MIN_REST_SHARE of the gap:
    against a sliver of it (the near-certain tokens' gap is ~0) a ratio says nothing."""
    within_b = w1 * (g1 - g0)
    baseline = w1 * g0  # these tokens at the old gap
    if within_b.sum() <= 0 or baseline.sum() <= 0:
        return None
    overall = float(np.sum(w1 * g1) / baseline.sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        relative = np.where(g0 > 0, g1 / g0, np.where(g1 > 0, np.inf, 1.0))
    # A bucket that holds almost none of the growth is noise there, however fast its sliver grew.
    chosen = [int(b) for b in np.flatnonzero((relative > overall) & (within_b >= MIN_GROWTH_SHARE * within_b.sum()))]
    rest = [int(b) for b in np.flatnonzero(w1 > 0) if b not in chosen]
    if not chosen:
        return None
    hot_base, rest_base = float(baseline[chosen].sum()), float(baseline[rest].sum())
    factor = float(np.sum(w1[chosen] * g1[chosen]) / hot_base) if hot_base > 0 else math.inf
    rest_factor = float(np.sum(w1[rest] * g1[rest]) / rest_base) if rest_base > 0 else math.nan
    comparable = rest_base >= MIN_REST_SHARE * baseline.sum() and rest_factor > 0
    return {"buckets": chosen, "where": describe_buckets(edges, chosen, dimension),
            "growth_share": float(within_b[chosen].sum() / within_b.sum()), "gap_share": hot_base / baseline.sum(),
            "token_share": float(w1[chosen].sum()), "factor": factor, "rest_factor": rest_factor,
            "contrast": factor / rest_factor if comparable else None}


def describe_buckets(edges: np.ndarray, buckets: list[int], dimension: str) -> str:
    """Buckets as ranges of their dimension: "length in [64, 256)"; runs of adjacent buckets joined."""
    runs: list[list[int]] = []
    for b in buckets:
        if runs and b == runs[-1][-1] + 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    parts = []
    for run in runs:
        low, high = edges[run[0]], edges[run[-1] + 1] if run[-1] + 1 < len(edges) else math.inf
        parts.append(f"≥ {low:g}" if math.isinf(high) else f"[{low:g}, {high:g})")
    return f"{_UNITS[dimension]} " + " or ".join(parts)


def strata_growth(before: Sequence[Step], after: Sequence[Step], pair: str) -> dict[str, Any]:
    """Each dimension's decomposition between the two windows, and the dimensions that explain the
    growth (contrast past MIN_CONTRAST), best first. Probability and entropy go together (an
    uncertain distribution gives low-probability tokens), so both may; length and position too."""
    out: dict[str, Any] = {}
    for dimension in _UNITS:
        pooled = pooled_stratum(before, pair, dimension), pooled_stratum(after, pair, dimension)
        if pooled[0] is None or pooled[1] is None:
            found = [s.strata.get(pair, {}).get(dimension) for s in after]
            unavailable = next((present(f.unavailable) for f in found if f is not None), None)
            out[dimension] = {"unavailable": unavailable or "not in these summaries (one audit of many steps keeps no "
                                                            "strata per step; an audit per step does)"}
            continue
        out[dimension] = shift_share(pooled[0], pooled[1], dimension) or {"unavailable": "no tokens in a window"}
    ranked = sorted(((d["hot"]["contrast"], name) for name, d in out.items() if isinstance(d.get("hot"), dict)
                     and (d["hot"]["contrast"] or 0) >= MIN_CONTRAST and d.get("growth", 0) > 0), reverse=True)
    out["explained_by"] = [name for _, name in ranked]
    return out


def grown(records_before: Sequence[Sequence[TurnRow | BranchKindRow]],
          records_after: Sequence[Sequence[TurnRow | BranchKindRow]],
          key: str, pair: str, metric: str, top: int = 3) -> list[dict[str, Any]]:
    """The groups (turns, branch kinds: `key`, the rows' field) whose metric grew most between the
    windows, token-weighted."""
    def pooled(windows: Sequence[Sequence[TurnRow | BranchKindRow]]) -> dict[Any, tuple[float, float]]:
        found: dict[Any, tuple[float, float]] = {}
        for records in windows:
            for record in records:
                metrics, group = record.pairs.get(pair), getattr(record, key)
                if metrics is None:  # the pair has no token in this group
                    continue
                value, n = getattr(metrics, metric, None), metrics.n_tokens or 0  # a metric the rows lack: none
                if isinstance(value, (int, float)) and n > 0:
                    total, count = found.get(group, (0.0, 0.0))
                    found[group] = (total + value * n, count + n)
        return found

    first, last = pooled(records_before), pooled(records_after)
    rows = [{key: group, "before": first[group][0] / first[group][1] if group in first else None,
             "after": total / count, "n_tokens_after": int(count)} for group, (total, count) in last.items()]
    for row in rows:
        row["growth"] = row["after"] - row["before"] if row["before"] is not None else None
    rows.sort(key=lambda row: -(row["growth"] if row["growth"] is not None else row["after"]))
    return rows[:top]


def configuration_changes(previous: Step, current: Step) -> list[dict[str, Any]]:
    """Every recorded configuration fact of an engine that differs between two steps, each with its
    kind of cause: an engine restarted in another dtype or version, or otherwise configured; and
    the audits' own mismatch version. A per-step seed or rollout count (PER_STEP_FACTS) is none."""
    changes = []
    if previous.mismatch_version != current.mismatch_version:
        changes.append({"engine": "mismatch", "key": "mismatch_version", "before": previous.mismatch_version,
                        "after": current.mismatch_version, "cause": "another mismatch version audited this step"})
    for source in sorted(set(previous.engines) | set(current.engines)):
        old, new = previous.engines.get(source, {}), current.engines.get(source, {})
        for key in sorted(set(old) | set(new)):
            if key.rpartition(".")[2] in PER_STEP_FACTS:
                continue
            if old.get(key) != new.get(key):
                changes.append({"engine": source, "key": key, "before": old.get(key), "after": new.get(key),
                                "cause": _cause_of(key)})
    return changes


def _cause_of(key: str) -> str:
    leaf = key.rpartition(".")[2]
    if "dtype" in leaf:
        return "engine restart: dtype"
    if "version" in leaf:
        return "engine restart: version"
    if key in ("kind", "spec"):
        return "another engine"
    return "engine configuration"


def layer_change(previous: Step, current: Step) -> dict[str, Any] | None:
    """Where the two engines part (the layer localizer's jump) at each of two steps, when both ran it."""
    if previous.layers is None or current.layers is None:
        return None
    def where(layers: LayerLocalization) -> dict[str, Any]:
        return {"jump_layer": present(layers.jump_layer), "jump_block": present(layers.jump_block),
                "jump_module": present(layers.jump_module),
                "output_logp_abs_diff_mean": present(layers.output_logp_abs_diff_mean)}

    return {"before": where(previous.layers), "after": where(current.layers)}
