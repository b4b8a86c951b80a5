"""`mismatch diff` on a real dump's stored log-probs, in bounded memory: the command users run,
`mismatch diff CKPT --rollouts F --a stored:trainer --b stored:engine --reference sampler --out D`.

Usage: python benchmarks/diff_stored.py [--rollouts 10000] [--big 30000] [--repeat 3] [--dir /tmp/mismatch-audit-bench]
       [--pythonpath OLD_TREE]  (the same runs on another checkout's code, e.g. a `git worktree` of
       the commit before a change, for its baseline)

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
from audit_stored import FLOOR, MIB, best_of, generate, timed, warm, write_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--big", type=int, default=30_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-audit-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pythonpath", type=Path, default=None, help="run another checkout's mismatch")
    args = parser.parse_args()
    if args.pythonpath is not None:
        os.environ["PYTHONPATH"] = str(args.pythonpath)
    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.dir / "checkpoint"
    write_checkpoint(checkpoint)
    files = {n: args.dir / f"rollouts-{n}.jsonl" for n in (args.rollouts, args.big)}
    for n, path in files.items():
        generate(path, n)
    # -P: not the working directory first on sys.path, so --pythonpath picks the code that runs.
    command = [sys.executable, "-P", "-c", "from mismatch.cli import run; run()"]

    def diff(n: int) -> dict[str, float]:
        out = args.dir / f"diff-{n}"
        shutil.rmtree(out, ignore_errors=True)
        return timed([*command, "diff", str(checkpoint), "--rollouts", str(files[n]), "--a", "stored:trainer",
                      "--b", "stored:engine", "--reference", "sampler", "--out", str(out)])

    result: dict[str, object] = {"python": sys.version.split()[0], "cores": os.cpu_count(),
                                 "code": str(args.pythonpath or Path(__file__).parent.parent),
                                 "file_mib": round(files[args.rollouts].stat().st_size / MIB, 1)}
    floors, diffs = [], []
    for _ in range(args.repeat):
        warm(files[args.rollouts])
        floors.append(timed([sys.executable, "-c", FLOOR, str(files[args.rollouts])]))
        warm(files[args.rollouts])
        diffs.append(diff(args.rollouts))
    result["json_loads_floor"] = best_of(floors)
    result[f"diff_{args.rollouts}"] = small = best_of(diffs)
    warm(files[args.big])
    result[f"diff_{args.big}"] = big = diff(args.big)
    for n in files:
        summary = json.loads((args.dir / f"diff-{n}" / "summary.json").read_text())
        result[f"diff_{n}"]["tokens"] = summary["counts"]["tokens"]
    result["diff_over_floor"] = round(small["wall_s"] / result["json_loads_floor"]["wall_s"], 2)
    for key in ("peak_rss_mib", "peak_tree_rss_mib"):
        result[f"{key.removesuffix('_mib')}_big_over_small"] = round(big[key] / min(small[f"runs_{key}"]), 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
