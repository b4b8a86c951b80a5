"""Streaming load of a big rollouts JSONL: peak memory stays flat as the file grows, and MB/s.

Usage: python benchmarks/stream_load.py [--size-mb 1024] [--small-mb 100] [--dir /tmp/mismatch-bench]

Generates (once; reused when the size matches) a JSONL of agentic rollouts in format v1 (main
branch of 4-7 turns, a subagent in every third rollout, float32-like sampler log-probs printed as
Python floats, about 50 KB a line) at --size-mb and a --small-mb prefix of it, outside the repo
(about a second per GiB: 256 distinct rollouts repeated under fresh ids).
Then, each in a fresh subprocess so peak RSS is its own (`getrusage(RUSAGE_SELF).ru_maxrss`,
minus the RSS after imports; the parent's `RUSAGE_CHILDREN.ru_maxrss` is the overall maximum):
- `json_lines`: a bare `for line in f: json.loads(line)` loop -- the parsing floor, no checks;
- `iter_rollouts` and `validate_file` over the small and the big file: streaming, so the peak
  must not grow with the file;
- `load_rollouts` (everything in memory) over the small file, for contrast.
Prints one JSON object with MB/s (file MiB / wall seconds) and peak RSS of each.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MIB = 2**20


def rollout_line(rng: np.random.Generator, index: int) -> str:
    def segment(role: str, n: int) -> dict:
        seg = {"role": role, "tokens": rng.integers(0, 151_000, n).tolist()}
        if role == "assistant":
            logp = np.minimum(-rng.exponential(0.7, n), 0.0).astype(np.float32)
            seg["logprobs"] = [float(x) for x in logp]  # float32 values, printed as Python floats
        return seg

    main = [segment("system", 48)]
    for turn in range(int(rng.integers(4, 8))):
        main.append(segment("user" if turn == 0 else "tool", int(rng.integers(30, 300))))
        main.append(segment("assistant", int(rng.integers(50, 500))))
    branches = [{"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": main}]
    if index % 3 == 0:
        branches.append({"id": "sub-1", "kind": "subagent", "parent": "main", "fork_at": 48, "segments": [
            segment("user", 80), segment("assistant", int(rng.integers(50, 400)))]})
    meta = {"checkpoint": "step-120", "sampler": {"engine": "vllm", "dtype": "bfloat16", "temperature": 1.0,
                                                  "top_p": 1.0, "top_k": -1, "logprobs": "raw"}}
    return json.dumps({"id": f"r-{index:08d}", "meta": meta, "branches": branches})


def generate(path: Path, size_mb: int, small: Path, small_mb: int, seed: int) -> None:
    """Distinct templates, repeated with fresh ids: the loader does the same work per line."""
    if path.exists() and small.exists() and abs(path.stat().st_size - size_mb * MIB) < 2 * MIB:
        return
    rng = np.random.default_rng(seed)
    templates = [rollout_line(rng, i) for i in range(256)]
    path.parent.mkdir(parents=True, exist_ok=True)
    written, index = 0, 0
    with open(path, "w") as big, open(small, "w") as head:
        while written < size_mb * MIB:
            template = templates[index % len(templates)]
            line = template.replace(f'"id": "r-{index % len(templates):08d}"', f'"id": "r-{index:08d}"', 1) + "\n"
            big.write(line)
            if written < small_mb * MIB:
                head.write(line)
            written += len(line)
            index += 1


def child(mode: str, path: str) -> dict:
    from mismatch.rollouts import iter_rollouts, load_rollouts, validate_file

    with open("/proc/self/status") as f:
        rss_start_kib = int(next(line.split()[1] for line in f if line.startswith("VmRSS:")))
    started = time.perf_counter()
    count = 0
    if mode == "json_lines":
        with open(path, "rb") as f:
            for line in f:
                json.loads(line)
                count += 1
    elif mode == "iter_rollouts":
        for _ in iter_rollouts(path):
            count += 1
    elif mode == "validate_file":
        report = validate_file(path)
        assert report.ok, report.errors[:3]
        count = report.num_rollouts
    elif mode == "load_rollouts":
        rollouts = load_rollouts(path)
        count = len(rollouts)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "rollouts": count, "seconds": seconds,
            "rss_after_imports_mib": rss_start_kib / 1024, "peak_rss_mib": peak_kib / 1024,
            "peak_extra_mib": (peak_kib - rss_start_kib) / 1024}


def measure(mode: str, path: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", mode, str(path)],
                          capture_output=True, text=True, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    size = path.stat().st_size / MIB
    row.update(file=path.name, file_mib=round(size, 1), mib_per_s=size / row["seconds"])
    return row


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--small-mb", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-bench"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    big = args.dir / f"stream-{args.size_mb}MB.jsonl"
    small = args.dir / f"stream-{args.size_mb}MB-head{args.small_mb}MB.jsonl"
    started = time.perf_counter()
    generate(big, args.size_mb, small, args.small_mb, args.seed)
    generate_s = time.perf_counter() - started

    rows = [measure("json_lines", big),
            measure("iter_rollouts", small), measure("validate_file", small),
            measure("iter_rollouts", big), measure("validate_file", big),
            measure("load_rollouts", small)]
    by = {(r["mode"], r["file"]): r for r in rows}
    stream = [r for r in rows if r["mode"] in ("iter_rollouts", "validate_file")]
    result = {
        "file_mib": round(big.stat().st_size / MIB, 1), "small_file_mib": round(small.stat().st_size / MIB, 1),
        "lines": by[("validate_file", big.name)]["rollouts"], "generate_s": generate_s,
        "cases": rows,
        # Flat memory: what a 10x bigger file adds to the streaming peak (MiB; ~0 = bounded).
        "streaming_peak_rss_mib_small": max(r["peak_rss_mib"] for r in stream if r["file"] == small.name),
        "streaming_peak_rss_mib_big": max(r["peak_rss_mib"] for r in stream if r["file"] == big.name),
        "streaming_peak_extra_mib_max": max(r["peak_extra_mib"] for r in stream),
        "load_rollouts_small_peak_extra_mib": by[("load_rollouts", small.name)]["peak_extra_mib"],
        "validate_over_bare_json_speed": by[("validate_file", big.name)]["mib_per_s"]
        / by[("json_lines", big.name)]["mib_per_s"],
        "children_max_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
