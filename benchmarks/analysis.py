"""Analysis throughput: mismatch's metrics + turn localization + corrections over a 10M-token table,
read from Parquet, vs a trainer-style torch per-batch computation of the core metrics, in one run.

Usage: python benchmarks/analysis.py [--tokens 10000000] [--rollouts 10000] [--repeats 3]
                                     [--dtype float32] [--profile 25] [--results DIR] [--fresh N]
                                     [--prefault-mb MB]

1. Writes a synthetic token table (the tokens.parquet contract: rollout, branch, branch_kind,
   turn, segment, pos, role, token_id, trainable, logp_sampler, logp_train, logp_infer) to
   DIR/tokens.parquet with `results.write_tokens`, as an audit writes it, once (10k agentic
   rollouts of 1-3 branches, 2-8 turns; bf16-like noise that grows at low probability; NaN
   sampler log-probs on prompt tokens, as an audit writes them).
2. mismatch, end to end, timed from `results.read_tokens` (of the columns the analysis reads) to
   the last result: one `TokenView` (trainable rows, keys, runs), then `summarize_pairs` for the three
   audit pairs, `metrics_by(..., "turn")`, `localize_turns` and `summary_corrections` (the full
   default correction set), all on that view, as `mismatch audit` runs them.
3. Baseline, the way RL trainers log these metrics (verl's rollout_corr metrics, TRL/OpenRLHF
   alike): the table already in memory as padded [64, max_len] tensors with a response mask
   (building them is not timed); per batch and per pair torch computes log-ratio mean/|mean|/max,
   ratio mean/std/min/max, k1, k2, k3, chi2 (token and sequence), ESS sums, fraction outside
   [0.5, 2] and bitwise-equal fraction, accumulated across batches.
4. The part both compute, on equal terms: mismatch's pair metrics for the three pairs from the
   table already in memory (`TokenView` + `summarize_pairs`, which also gives quantiles,
   ppl_ratio, n_rollouts and the probability gap the baseline leaves out) against the baseline.
All are best of --repeats, in this process, taken round-robin (each round runs 2, 4 and the
baseline once) so that all of them see the same machine; every repeat's wall and system seconds
of 2 are printed too. The baseline runs with 1 torch thread and with the default (2 here), and the
faster counts. mismatch's analysis is plain numpy, vectorized over the tokens and their runs.
--prefault-mb MB touches and frees MB of memory before every timed run, untimed (see `prefault`:
this sandbox charges for memory its host has reclaimed). --fresh N also runs step 2 once in each
of N new processes (as a CLI command would), after a warm-up there on a tiny table (imports and
first calls, reported apart). Prints one JSON object; --profile N adds the top N functions
(cProfile, cumulative) of 2.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from mismatch.advise.corrections import summary_corrections
from mismatch.analysis.metrics import metrics_by, summarize_pairs
from mismatch.analysis.tokenview import TokenView
from mismatch.localize.turns import localize_turns
from mismatch.results import TOKENS_FILE, read_tokens, write_tokens

PAIRS = [("train", "sampler"), ("train", "infer"), ("infer", "sampler")]
# What the analysis reads (token_id and segment are not used by it, and Parquet is columnar).
ANALYSIS_COLUMNS = ["rollout", "branch", "branch_kind", "turn", "pos", "role", "trainable",
                    "logp_sampler", "logp_train", "logp_infer"]
SYSTEM_TOKENS = 48
BATCH = 64


# ---------------------------------------------------------------------------------------------
# Synthetic table


def synthetic_table(num_tokens: int, num_rollouts: int, seed: int) -> pd.DataFrame:
    """About num_tokens rows over num_rollouts rollouts, in the column layout audit writes."""
    rng = np.random.default_rng(seed)
    # ~15 prompt/answer segments per rollout on average (main: 2-8 turns, subagents: 1-3 each).
    mean_prompt = mean_answer = max(8, num_tokens // num_rollouts // 15)
    seg: dict[str, list] = {k: [] for k in ("rollout", "branch", "kind", "role", "turn", "segment", "start", "length")}
    for r in range(num_rollouts):
        kinds = ["main"] + ["subagent"] * int(rng.integers(0, 3))
        if rng.random() < 0.1:
            kinds.append("summary")
        for b, kind in enumerate(kinds):
            pieces = [("system", SYSTEM_TOKENS)] if kind == "main" else []
            for turn in range(int(rng.integers(2, 9)) if kind == "main" else int(rng.integers(1, 4))):
                pieces.append(("user" if turn == 0 else "tool", int(rng.integers(4, 2 * mean_prompt))))
                pieces.append(("summary" if kind == "summary" else "assistant", int(rng.integers(4, 2 * mean_answer))))
            start = 0 if kind == "main" else int(rng.integers(50, 400))  # forked: context before own tokens
            turn = 0
            for s, (role, length) in enumerate(pieces):
                seg["rollout"].append(r), seg["branch"].append(b), seg["kind"].append(kind)
                seg["role"].append(role), seg["turn"].append(turn), seg["segment"].append(s)
                seg["start"].append(start), seg["length"].append(length)
                start += length
                turn += role in ("assistant", "summary")
    lengths = np.asarray(seg["length"])
    n = int(lengths.sum())
    seg_start = np.repeat(np.cumsum(lengths) - lengths, lengths)
    offset = np.arange(n) - seg_start
    role = np.repeat(np.asarray(seg["role"], dtype=object), lengths)
    trainable = np.isin(role, ["assistant", "summary"])

    # Probability of each realized token: mostly near-certain, a heavy low-probability tail.
    confident = rng.random(n) < 0.6
    logp = np.where(confident, -rng.exponential(0.02, n), -rng.exponential(1.5, n)).clip(-25, 0)
    # bf16-like replay noise, larger at low probability; the inference engine is bitwise
    # equal to the sampler on 40% of tokens and close elsewhere.
    logp_train = np.minimum(logp + rng.normal(0, 1, n) * (0.004 + 0.02 * -logp), 0.0)
    logp_infer = np.where(rng.random(n) < 0.4, logp,
                          np.minimum(logp + rng.normal(0, 1, n) * (0.001 + 0.005 * -logp), 0.0))
    first = (offset == 0) & (np.repeat(np.asarray(seg["segment"]), lengths) == 0) \
        & (np.repeat(np.asarray(seg["kind"]), lengths) == "main")
    logp_train[first] = np.nan  # position 0 of a stream has no log-prob
    logp_infer[first] = np.nan
    rollout_names = np.asarray([f"r-{i:06d}" for i in range(num_rollouts)], dtype=object)
    branch_names = np.asarray(["main", "sub-1", "sub-2", "sum-1"], dtype=object)
    table = pd.DataFrame({
        "rollout": pd.Categorical(rollout_names[np.repeat(seg["rollout"], lengths)]),
        "branch": pd.Categorical(branch_names[np.repeat(seg["branch"], lengths)]),
        "branch_kind": pd.Categorical(np.repeat(np.asarray(seg["kind"], dtype=object), lengths)),
        "turn": np.repeat(np.asarray(seg["turn"], dtype=np.int32), lengths),
        "segment": np.repeat(np.asarray(seg["segment"], dtype=np.int32), lengths),
        "pos": (np.repeat(np.asarray(seg["start"]), lengths) + offset).astype(np.int32),
        "role": pd.Categorical(role),
        "token_id": rng.integers(0, 151_000, n, dtype=np.int64),
        "trainable": trainable,
        "logp_sampler": np.where(trainable, logp, np.nan),
        "logp_train": logp_train,
        "logp_infer": logp_infer,
    })
    return table


# ---------------------------------------------------------------------------------------------
# mismatch's path


def mismatch_analysis(path: Path) -> tuple[dict[str, float], dict]:
    """Stage timings (s) and the results, from reading the Parquet file to the last correction."""
    times, started, started_cpu = {}, time.perf_counter(), time.process_time()

    def lap(name: str) -> None:  # wall and CPU seconds of each stage
        nonlocal started, started_cpu
        now, now_cpu = time.perf_counter(), time.process_time()
        times[name] = [round(now - started, 4), round(now_cpu - started_cpu, 4)]
        started, started_cpu = now, now_cpu

    table = read_tokens(path, columns=ANALYSIS_COLUMNS)
    lap("read_tokens")
    view = TokenView(table)  # the trainable rows, keyed and cut into runs once for every step below
    lap("token_view")
    pairs = summarize_pairs(view, PAIRS)
    lap("summarize_pairs")
    turns = metrics_by(view, PAIRS, "turn")
    lap("metrics_by_turn")
    localization = localize_turns(view, "train", "sampler")
    lap("localize_turns")
    corrections = summary_corrections(view)
    lap("summary_corrections")
    times["total"] = [round(sum(t[0] for t in times.values()), 4), round(sum(t[1] for t in times.values()), 4)]
    return times, {"pairs": pairs, "turns": turns, "localization": localization, "corrections": corrections}


# ---------------------------------------------------------------------------------------------
# Trainer-style baseline


def padded_batches(table: pd.DataFrame, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Sequences (one per branch) in batches of BATCH, padded to the batch's longest, with a mask.

    This is the layout a trainer already holds (its rollout buffer); building it is not timed.
    """
    seq = table.groupby(["rollout", "branch"], sort=False, observed=True).ngroup().to_numpy()
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    ends = np.r_[starts[1:], len(seq)]
    columns = {name: table[f"logp_{name}"].to_numpy() for name in ("sampler", "train", "infer")}
    mask_all = table["trainable"].to_numpy()
    batches = []
    for first in range(0, len(starts), BATCH):
        s, e = starts[first:first + BATCH], ends[first:first + BATCH]
        width = int((e - s).max())
        row = np.repeat(np.arange(len(s)), e - s)
        col = np.arange(int((e - s).sum())) - np.repeat(np.cumsum(e - s) - (e - s), e - s)
        flat = np.concatenate([np.arange(a, b) for a, b in zip(s, e)])
        batch = {}
        for name, values in columns.items():
            padded = np.zeros((len(s), width))
            padded[row, col] = np.nan_to_num(values[flat])
            batch[name] = torch.from_numpy(padded).to(dtype)
        mask = np.zeros((len(s), width), dtype=bool)
        mask[row, col] = mask_all[flat]
        batch["mask"] = torch.from_numpy(mask)
        batches.append(batch)
    return batches


def torch_baseline(batches: list[dict[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Per batch, per pair: masked torch ops accumulated into sums (verl rollout_corr style)."""
    acc = {f"{a}/{b}": {"n": 0.0, "lr": 0.0, "abs_lr": 0.0, "abs_max": 0.0, "r": 0.0, "r2": 0.0,
                        "r_min": math.inf, "r_max": -math.inf, "k1": 0.0, "k2": 0.0, "k3": 0.0,
                        "out2": 0.0, "equal": 0.0, "chi2_seq": 0.0, "n_seq": 0.0}
           for a, b in PAIRS}
    with torch.inference_mode():
        for batch in batches:
            mask = batch["mask"]
            maskf = mask.to(batch["train"].dtype)
            n = maskf.sum()
            seq_has = mask.any(dim=1)
            for a, b in PAIRS:
                total = acc[f"{a}/{b}"]
                log_ratio = (batch[a] - batch[b]) * maskf
                ratio = torch.exp(log_ratio)
                abs_lr = log_ratio.abs()
                total["n"] += float(n)
                total["lr"] += float(log_ratio.sum())
                total["abs_lr"] += float(abs_lr.sum())
                total["abs_max"] = max(total["abs_max"], float(abs_lr.max()))
                total["r"] += float((ratio * maskf).sum())
                total["r2"] += float((ratio.square() * maskf).sum())
                total["r_min"] = min(total["r_min"], float(ratio.masked_fill(~mask, math.inf).min()))
                total["r_max"] = max(total["r_max"], float(ratio.masked_fill(~mask, -math.inf).max()))
                total["k1"] += float(-log_ratio.sum())
                total["k2"] += float((0.5 * log_ratio.square()).sum())
                total["k3"] += float(((ratio - 1 - log_ratio) * maskf).sum())
                total["out2"] += float((((ratio > 2) | (ratio < 0.5)) & mask).sum())
                total["equal"] += float(((batch[a] == batch[b]) & mask).sum())
                seq_log_ratio = log_ratio.sum(dim=1)
                total["chi2_seq"] += float(torch.exp(2 * seq_log_ratio)[seq_has].sum())
                total["n_seq"] += float(seq_has.sum())
    out = {}
    for pair, t in acc.items():
        n = t["n"]
        mean_r = t["r"] / n
        out[pair] = {"n_tokens": int(n), "log_ratio_mean": t["lr"] / n, "log_ratio_abs_mean": t["abs_lr"] / n,
                     "log_ratio_abs_max": t["abs_max"], "ratio_mean": mean_r,
                     "ratio_std": math.sqrt(max(t["r2"] / n - mean_r ** 2, 0.0)),
                     "ratio_min": t["r_min"], "ratio_max": t["r_max"], "kl_k1": t["k1"] / n,
                     "kl_k2": t["k2"] / n, "kl_k3": t["k3"] / n, "chi2_token": t["r2"] / n - 1,
                     "chi2_seq": t["chi2_seq"] / t["n_seq"] - 1, "ess": t["r"] ** 2 / (n * t["r2"]),
                     "frac_outside_2": t["out2"] / n, "bitwise_equal_frac": t["equal"] / n}
    return out


# ---------------------------------------------------------------------------------------------


def prefault(megabytes: int) -> None:
    """Touch and free `megabytes` of memory. On this sandbox's VM, memory a process frees goes back
    to the host (virtio-balloon free page reporting) and the first touch of it costs up to ~2 ms
    per MB; memory freed a moment ago is still backed, and the next allocations reuse it. Run
    untimed before a repeat, this makes the repeat's fresh memory cost what it costs on a machine
    that does not reclaim it (RESULTS.md has both)."""
    if megabytes > 0:
        block = np.empty(megabytes * 2**17)
        block.fill(0.0)
        del block


class Best:
    """Best wall seconds of the runs so far, the CPU (and system) seconds of that run, its result,
    and every run's wall and system seconds."""

    def __init__(self) -> None:
        self.seconds = self.cpu_seconds = math.inf
        self.result = None
        self.every: list[float] = []
        self.every_sys: list[float] = []

    def span(self, work):
        sys_before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        started, started_cpu = time.perf_counter(), time.process_time()
        result = work()
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
        self.every.append(round(seconds, 4))
        self.every_sys.append(round(resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys_before, 3))
        if seconds < self.seconds:
            self.seconds, self.cpu_seconds, self.result = seconds, cpu_seconds, result


def fresh_process_run(results: Path) -> dict:
    """What `mismatch merge` or a one-off analysis pays: a new process, warmed up on a tiny table
    first (lazy imports and first calls: a fixed cost per process, reported apart), then the table
    read and analysed once."""
    started = time.perf_counter()
    small = TokenView(synthetic_table(20_000, 20, seed=1))
    summarize_pairs(small, PAIRS), metrics_by(small, PAIRS, "turn"), localize_turns(small), summary_corrections(small)
    warmup_s = time.perf_counter() - started
    started = time.perf_counter()
    stages, _ = mismatch_analysis(results)
    return {"warmup_s": round(warmup_s, 3), "analysis_s": round(time.perf_counter() - started, 4), "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                        help="baseline tensor dtype (trainers keep log-probs in float32)")
    parser.add_argument("--results", type=Path, default=Path("/tmp/mismatch-bench/analysis"),
                        help="where to write the token table (DIR/tokens.parquet)")
    parser.add_argument("--profile", type=int, default=0, help="also print the top N functions of mismatch's path")
    parser.add_argument("--fresh", type=int, default=0,
                        help="also time the end-to-end analysis once in each of N new processes")
    parser.add_argument("--prefault-mb", type=int, default=0,
                        help="touch and free this much memory, untimed, before every timed run (see prefault)")
    parser.add_argument("--fresh-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fresh_child:
        print(json.dumps(fresh_process_run(args.results)))
        return

    started = time.perf_counter()
    table = synthetic_table(args.tokens, args.rollouts, args.seed)
    args.results.mkdir(parents=True, exist_ok=True)
    write_tokens(table, args.results / TOKENS_FILE)  # as results.write_results writes it
    generate_s = time.perf_counter() - started
    num_rows, num_trainable = len(table), int(table["trainable"].sum())

    batches = padded_batches(table, getattr(torch, args.dtype))
    padded_cells = sum(b["mask"].numel() for b in batches)
    del table

    load_before = os.getloadavg()[0]
    table = read_tokens(args.results, columns=ANALYSIS_COLUMNS)  # for the in-memory comparison
    # Round-robin, so that every contender sees the same machine (this sandbox's cost of fresh
    # memory drifts within a process, see RESULTS.md): mismatch end to end, mismatch's pair
    # metrics from the table in memory, and the baseline on 1 torch thread and on all of them
    # (on a shared machine OpenMP's spinning threads can make 2 threads 40x slower than 1).
    default_threads = torch.get_num_threads()
    ours, pairs_only = Best(), Best()
    baseline_runs = {threads: Best() for threads in sorted({1, default_threads})}
    for _ in range(args.repeats):
        prefault(args.prefault_mb)
        ours.span(lambda: mismatch_analysis(args.results))
        prefault(args.prefault_mb)
        pairs_only.span(lambda: summarize_pairs(TokenView(table), PAIRS))
        for threads, best in baseline_runs.items():
            torch.set_num_threads(threads)
            prefault(args.prefault_mb)
            best.span(lambda: torch_baseline(batches))
    torch.set_num_threads(default_threads)
    stages, ours_result = ours.result
    base_threads = min(baseline_runs, key=lambda t: baseline_runs[t].seconds)
    baseline = baseline_runs[base_threads]
    ours_s, base_s, pairs_s = ours.seconds, baseline.seconds, pairs_only.seconds

    # The two must agree on what they both compute (float32 baseline: to ~1e-6 relative).
    agree = {}
    for pair in ("train/sampler", "train/infer"):
        for name in ("n_tokens", "log_ratio_abs_mean", "kl_k3", "chi2_token", "ratio_max", "ess"):
            ours_v, base_v = ours_result["pairs"][pair][name], baseline.result[pair][name]
            agree[f"{pair}:{name}"] = abs(ours_v - base_v) / max(abs(ours_v), 1e-300)
    result = {
        "rows": num_rows, "trainable_rows": num_trainable, "rollouts": args.rollouts,
        "parquet_mb": round(os.path.getsize(args.results / TOKENS_FILE) / 2**20, 1),
        "baseline_dtype": args.dtype, "baseline_batches": len(batches), "baseline_padded_cells": padded_cells,
        "load_average_1min": round(load_before, 2), "prefault_mb": args.prefault_mb,
        "mismatch_s": ours_s, "mismatch_cpu_s": ours.cpu_seconds, "mismatch_s_every_repeat": ours.every,
        "mismatch_sys_s_every_repeat": ours.every_sys, "mismatch_s_median": float(np.median(ours.every)),
        "mismatch_stages_s_best_run": stages,
        "baseline_s": base_s, "baseline_cpu_s": baseline.cpu_seconds, "baseline_threads": base_threads,
        "baseline_s_by_threads": {t: best.seconds for t, best in baseline_runs.items()},
        "mismatch_pair_metrics_in_memory_s": pairs_s, "mismatch_pair_metrics_in_memory_cpu_s": pairs_only.cpu_seconds,
        "mismatch_pair_metrics_in_memory_s_every_repeat": pairs_only.every,
        "pair_metrics_speedup_vs_baseline": base_s / pairs_s,
        "mismatch_tokens_per_s": num_rows / ours_s, "baseline_tokens_per_s": num_rows / base_s,
        "speedup_vs_baseline": base_s / ours_s,
        "target_10M_tokens_per_s_met": num_rows / ours_s >= 10e6,
        "faster_than_baseline": ours_s < base_s,
        "max_rel_diff_vs_baseline": max(agree.values()), "generate_s": generate_s,
    }
    if args.fresh:
        command = [sys.executable, __file__, "--fresh-child", "--results", str(args.results)]
        spans = [json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                for _ in range(args.fresh)]
        seconds = [span["analysis_s"] for span in spans]
        result["fresh_process_s_every_run"] = seconds
        result["fresh_process_s_best"], result["fresh_process_s_median"] = min(seconds), float(np.median(seconds))
        result["fresh_process_tokens_per_s_best"] = num_rows / min(seconds)
        result["fresh_process_warmup_s"] = [span["warmup_s"] for span in spans]
    if args.profile:
        profiler = cProfile.Profile(time.process_time)  # CPU time: steadier on a shared machine
        profiler.enable()
        mismatch_analysis(args.results)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        total = max(stats.total_tt, 1e-9)
        rows = []
        for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():
            rows.append({"function": f"{Path(file).name}:{line}:{func}", "calls": calls,
                         "self_s": round(tottime, 3), "cum_s": round(cumtime, 3),
                         "self_pct": round(100 * tottime / total, 1)})
        result["profile_total_s"] = total
        result["profile_top_self"] = sorted(rows, key=lambda r: -r["self_s"])[:args.profile]
        ours_rows = [r for r in rows if any(m in r["function"] for m in ("metrics.py", "turns.py", "corrections.py"))]
        result["profile_top_cumulative_mismatch"] = sorted(ours_rows, key=lambda r: -r["cum_s"])[:args.profile]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
