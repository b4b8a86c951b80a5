"""The command users run on a real dump: `mismatch audit --train stored:trainer --infer stored:engine`.

Usage: python benchmarks/audit_stored.py [--rollouts 10000] [--big 30000] [--repeat 3] [--dir /tmp/mismatch-audit-bench]

Generates (once; reused when present) agentic rollouts in format v1 outside the repo: one main
branch each, system + user (~100 tokens), then 6 x (assistant ~80 tokens with `logprobs` and
`extra_logprobs` "trainer" and "engine", tool ~60 tokens): ~940 tokens a rollout, about half of
them trainable. A stored-log-prob audit needs a checkpoint only for its vocab size, so a
config-only checkpoint with one tiny safetensors file is written beside it.

Then, in one run and each in a fresh subprocess (peak RSS from `wait4`'s rusage of that child: its
largest process; and the peak of its whole process tree's summed RSS, forked analysis workers
included, sampled):
- the floor: `json.loads` of every line of the --rollouts file;
- `mismatch audit CKPT --rollouts F --train stored:trainer --infer stored:engine --out D` on the
  --rollouts file and on the --big one (memory must not grow with the input);
- `mismatch --help` (best of 3).
The floor and the --rollouts audit run --repeat times, one after the other in turn, each after
the file is read once (from the page cache, not the disk), and each is given by its fastest run:
a shared VM's speed drifts by tens of percent within minutes, and the best of each, taken side by
side, is what the code costs.
Prints one JSON object: wall and peak RSS of each (every run's wall too), and the audit / floor ratio.

--baseline OLD_TREE (a checkout of an earlier commit, e.g. `git archive COMMIT | tar -x -C DIR`):
that code's audit of the --rollouts file runs too, in turn with the floor and this code's, so a
before/after is measured against one floor on one machine in one run (`baseline_*` in the output).
--code TREE runs that tree's code in place of the installed one. Either tree's `mismatch` package
is imported from the tree itself (TREE_CLI), and the run fails if any of its modules came from elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

MIB = 2**20
VOCAB = 151_000
NUM_TEMPLATES = 512  # distinct rollouts; the file repeats them under fresh ids


def rollout_line(rng: np.random.Generator, index: int) -> str:
    def prompt(role: str, n: int) -> dict:
        return {"role": role, "tokens": rng.integers(0, VOCAB, n).tolist()}

    def assistant(n: int) -> dict:
        # Log-probs rounded to 6 decimals, as dumps usually store them; the trainer and the re-run
        # engine differ from the sampler by a small, heavy-ish tailed gap.
        logp = np.minimum(-rng.exponential(0.7, n), 0.0)
        trainer = np.minimum(logp + rng.standard_t(3, n) * 0.01, 0.0)
        engine = np.minimum(logp + rng.normal(0.0, 0.002, n), 0.0)
        return {"role": "assistant", "tokens": rng.integers(0, VOCAB, n).tolist(),
                "logprobs": np.round(logp, 6).tolist(),
                "extra_logprobs": {"trainer": np.round(trainer, 6).tolist(),
                                   "engine": np.round(engine, 6).tolist()}}

    segments = [prompt("system", int(rng.integers(30, 50))), prompt("user", int(rng.integers(40, 80)))]
    for _ in range(6):
        segments.append(assistant(int(rng.integers(60, 100))))
        segments.append(prompt("tool", int(rng.integers(45, 75))))
    meta = {"sampler": {"engine": "vllm", "dtype": "bfloat16", "temperature": 1.0, "top_p": 1.0,
                        "top_k": -1, "logprobs": "raw"}}
    return json.dumps({"id": f"r-{index:08d}", "meta": meta, "branches": [
        {"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": segments}]})


def generate(path: Path, num_rollouts: int, seed: int = 0) -> None:
    if path.exists():
        return
    rng = np.random.default_rng(seed)
    templates = [rollout_line(rng, i) for i in range(NUM_TEMPLATES)]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for i in range(num_rollouts):
            template = templates[i % NUM_TEMPLATES]
            f.write(template.replace(f'"r-{i % NUM_TEMPLATES:08d}"', f'"r-{i:08d}"', 1) + "\n")
    tmp.rename(path)


def write_checkpoint(root: Path) -> None:
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": VOCAB}))
    save_file({"unused": np.zeros(1, dtype=np.float32)}, str(root / "model.safetensors"))


def tree_rss_kib(pid: int) -> int:
    """The RSS of a process and its descendants, summed: pages a forked analysis worker shares
    with its parent count twice, so this bounds the tree's memory from above. (/proc/PID/statm:
    reading smaps for PSS every 50 ms cost the run a tenth of a core.)"""
    total = 0
    try:
        total = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += tree_rss_kib(int(child))
    except (OSError, ValueError, IndexError):
        pass  # a process that just ended
    return total


def timed(argv: list[str], extra_env: dict[str, str] | None = None) -> dict[str, float]:
    """Wall seconds, CPU seconds, peak RSS (MiB, the largest single process: wait4) and the peak of
    the process tree's summed RSS (MiB, sampled every 50 ms) of one child process, which must succeed."""
    # Bytecode cached as an installed package has it (pip compiles it at install): this machine's
    # PYTHONDONTWRITEBYTECODE=1 would have every run compile the project's modules again.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    env.update(extra_env or {})
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], tree_rss_kib(child.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    stderr = child.stderr.read().decode(errors="replace") if child.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(argv)}\n{stderr[-3000:]}")
    return {"wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "sys_s": round(usage.ru_stime, 3), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "peak_tree_rss_mib": round(peak[0] / 1024, 1)}


def warm(path: Path) -> None:
    """The file read once, so the run after reads it from the page cache: this VM's memory
    reclaim (DAMON) evicts a file idle for a while, and a run that waits on the disk measures the
    disk (a floor of 10.7 s against 5.9 s warm was seen)."""
    with path.open("rb") as f:
        while f.read(1 << 24):
            pass


def best_of(runs: list[dict[str, float]]) -> dict[str, object]:
    """The fastest run, with every run's wall time and peak RSS (the memory check compares the
    big run with the smallest of these peaks: the stricter ratio)."""
    best: dict[str, object] = dict(min(runs, key=lambda run: run["wall_s"]))
    for key in ("wall_s", "cpu_s", "peak_rss_mib", "peak_tree_rss_mib"):
        best[f"runs_{key}"] = [run[key] for run in runs]
    return best


FLOOR = "import json,sys\nwith open(sys.argv[1],'rb') as f:\n    for line in f: json.loads(line)\n"

# The CLI of another checkout's tree (the first argument), whatever is installed: the editable
# install maps `mismatch`, `mismatch.reports` and `mismatch.probes` to this checkout by a finder
# on sys.meta_path, which PYTHONPATH does not outrank for the two folders pyproject maps into the
# package. A finder put first maps the three to the tree's folders (its own pyproject's package-dir),
# and on the way out every `mismatch` module the run imported is checked to lie in that tree.
TREE_CLI = r"""
import importlib.abc, importlib.util, os, sys, tomllib
from pathlib import Path
root = Path(sys.argv.pop(1)).resolve()
folders = {"mismatch": root / "mismatch"}
if (root / "pyproject.toml").is_file():
    setuptools = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    folders.update({name: root / folder for name, folder in setuptools.get("package-dir", {}).items() if name})
class Tree(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in folders:
            return None
        return importlib.util.spec_from_file_location(name, folders[name] / "__init__.py",
                                                      submodule_search_locations=[str(folders[name])])
sys.meta_path.insert(0, Tree())
def check():
    elsewhere = sorted(name for name, module in list(sys.modules.items())
                       if name.split(".")[0] == "mismatch" and getattr(module, "__file__", None)
                       and not Path(module.__file__).resolve().is_relative_to(root))
    if elsewhere or "mismatch.cli" not in sys.modules:
        sys.stderr.write(f"not the code of {root}: {elsewhere[:5] or 'mismatch.cli not imported'}\n")
        sys.stderr.flush()
        os._exit(3)
from mismatch.cli import run
sys.argv[0] = "mismatch"
try:
    run()
finally:
    check()
"""


def cli(code: Path | None) -> list[str]:
    """The argv that starts `mismatch`: the installed console script, or the CLI of tree `code`."""
    if code is None:
        return [str(Path(sys.executable).with_name("mismatch"))]
    return [sys.executable, "-c", TREE_CLI, str(code)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--big", type=int, default=30_000, help="0 skips the memory check")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-audit-bench"))
    parser.add_argument("--repeat", type=int, default=3, help="runs of the floor and of the --rollouts audit")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout's code, run in turn with this one")
    parser.add_argument("--code", type=Path, default=None, help="run this checkout's code instead of the installed one")
    args = parser.parse_args()
    mismatch = str(Path(sys.executable).with_name("mismatch"))
    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.dir / "checkpoint"
    write_checkpoint(checkpoint)
    sizes = [args.rollouts] + ([args.big] if args.big else [])
    files = {n: args.dir / f"rollouts-{n}.jsonl" for n in sizes}
    for n, path in files.items():
        generate(path, n)

    result: dict[str, object] = {"python": sys.version.split()[0], "cores": os.cpu_count()}
    small = files[args.rollouts]
    result["file_mib"] = round(small.stat().st_size / MIB, 1)

    def audit(n: int, code: Path | None = None) -> dict[str, float]:
        out = args.dir / (f"baseline-audit-{n}" if code is not None and code == args.baseline else f"audit-{n}")
        shutil.rmtree(out, ignore_errors=True)
        return timed([*cli(code), "audit", str(checkpoint), "--rollouts", str(files[n]), "--train", "stored:trainer",
                      "--infer", "stored:engine", "--out", str(out)])

    floors, audits, baselines = [], [], []
    for _ in range(args.repeat):
        warm(small)
        floors.append(timed([sys.executable, "-c", FLOOR, str(small)]))
        warm(small)
        audits.append(audit(args.rollouts, args.code))
        if args.baseline is not None:
            warm(small)
            baselines.append(audit(args.rollouts, args.baseline))
    result["json_loads_floor"] = best_of(floors)
    result[f"audit_{args.rollouts}"] = best_of(audits)
    if baselines:
        result[f"baseline_audit_{args.rollouts}"] = best_of(baselines)
        result["baseline_code"] = str(args.baseline)
        result["baseline_over_floor"] = round(result[f"baseline_audit_{args.rollouts}"]["wall_s"]
                                              / result["json_loads_floor"]["wall_s"], 2)
    if args.big:
        warm(files[args.big])
        result[f"audit_{args.big}"] = audit(args.big, args.code)
    for n in files:
        summary = json.loads((args.dir / f"audit-{n}" / "summary.json").read_text())
        result[f"audit_{n}"]["tokens"] = summary["counts"]["tokens"]
        result[f"audit_{n}"]["trainable_tokens"] = summary["counts"]["trainable_tokens"]
    result["help"] = min((timed([mismatch, "--help"]) for _ in range(3)), key=lambda r: r["wall_s"])
    small_audit = result[f"audit_{args.rollouts}"]
    result["audit_over_floor"] = round(small_audit["wall_s"] / result["json_loads_floor"]["wall_s"], 2)
    # CPU seconds over the floor's (the least of each one's runs): what a loaded machine moves least.
    result["audit_cpu_over_floor_cpu"] = round(min(small_audit["runs_cpu_s"])
                                               / min(result["json_loads_floor"]["runs_cpu_s"]), 2)
    if baselines:
        result["baseline_cpu_over_floor_cpu"] = round(min(result[f"baseline_audit_{args.rollouts}"]["runs_cpu_s"])
                                                      / min(result["json_loads_floor"]["runs_cpu_s"]), 2)
    if args.big:
        for key in ("peak_rss_mib", "peak_tree_rss_mib"):
            result[f"{key.removesuffix('_mib')}_big_over_small"] = round(
                result[f"audit_{args.big}"][key] / min(small_audit[f"runs_{key}"]), 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
