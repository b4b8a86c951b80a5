"""`mismatch diff` on a real dump's stored log-probs, in bounded memory: the command users run,
`mismatch diff CKPT --rollouts F --a stored:trainer --b stored:engine --reference sampler --out D`.

Usage: python benchmarks/diff_stored.py [--rollouts 10000] [--big 30000] [--repeat 3] [--dir /tmp/mismatch-audit-bench]
       [--pythonpath OLD_TREE]  (the same runs on another checkout's code, e.g. a `git worktree` of
       the commit before a change, for its baseline)
       [--baseline OLD_TREE]  (that code's diff of the --rollouts file too, in turn with this one's:
       one floor, one machine, one run for the before and the after)

The rollouts files, the config-only checkpoint and the measurement (wall, peak RSS of the largest
process from wait4, the process tree's summed RSS sampled) are audit_stored.py's, in the same
directory, so the two benchmarks share their inputs. In one run: the json.loads floor, the diff of
the --rollouts file (--repeat times, in turn with the floor, best of each) and of the --big one.
The memory check is the --big diff's peak over the smallest --rollouts peak (target ≤ 1.2×: what
grows with the run is per rollout, never per token). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from audit_stored import FLOOR, MIB, best_of, cli, generate, timed, warm, write_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--big", type=int, default=30_000, help="0 skips the memory check")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-audit-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pythonpath", type=Path, default=None, help="run another checkout's mismatch")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout's code, its diff of the --rollouts file run in turn with this one's")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.dir / "checkpoint"
    write_checkpoint(checkpoint)
    files = {n: args.dir / f"rollouts-{n}.jsonl" for n in (args.rollouts, args.big) if n}
    for n, path in files.items():
        generate(path, n)
    def diff(n: int, code: Path | None = args.pythonpath) -> dict[str, float]:
        out = args.dir / (f"baseline-diff-{n}" if code is not None and code == args.baseline else f"diff-{n}")
        shutil.rmtree(out, ignore_errors=True)
        # cli(): the tree's own `mismatch` (the run fails if a module of it came from elsewhere).
        return timed([*cli(code), "diff", str(checkpoint), "--rollouts", str(files[n]), "--a", "stored:trainer",
                      "--b", "stored:engine", "--reference", "sampler", "--out", str(out)])

    result: dict[str, object] = {"python": sys.version.split()[0], "cores": os.cpu_count(),
                                 "code": str(args.pythonpath or Path(__file__).parent.parent),
                                 "file_mib": round(files[args.rollouts].stat().st_size / MIB, 1)}
    floors, diffs, baselines = [], [], []
    for _ in range(args.repeat):
        warm(files[args.rollouts])
        floors.append(timed([sys.executable, "-c", FLOOR, str(files[args.rollouts])]))
        warm(files[args.rollouts])
        diffs.append(diff(args.rollouts))
        if args.baseline is not None:
            warm(files[args.rollouts])
            baselines.append(diff(args.rollouts, args.baseline))
    result["json_loads_floor"] = floor = best_of(floors)
    result[f"diff_{args.rollouts}"] = small = best_of(diffs)
    if args.big:
        warm(files[args.big])
        result[f"diff_{args.big}"] = big = diff(args.big)
    for n in files:
        summary = json.loads((args.dir / f"diff-{n}" / "summary.json").read_text())
        result[f"diff_{n}"]["tokens"] = summary["counts"]["tokens"]
    result["diff_over_floor"] = round(small["wall_s"] / floor["wall_s"], 2)
    # CPU seconds over the floor's (the least of each one's runs): what a loaded machine moves least.
    result["diff_cpu_over_floor_cpu"] = round(min(small["runs_cpu_s"]) / min(floor["runs_cpu_s"]), 2)
    if baselines:
        result[f"baseline_diff_{args.rollouts}"] = baseline = best_of(baselines)
        result["baseline_code"] = str(args.baseline)
        result["baseline_over_floor"] = round(baseline["wall_s"] / floor["wall_s"], 2)
        result["baseline_cpu_over_floor_cpu"] = round(min(baseline["runs_cpu_s"]) / min(floor["runs_cpu_s"]), 2)
    if args.big:
        for key in ("peak_rss_mib", "peak_tree_rss_mib"):
            result[f"{key.removesuffix('_mib')}_big_over_small"] = round(big[key] / min(small[f"runs_{key}"]), 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
