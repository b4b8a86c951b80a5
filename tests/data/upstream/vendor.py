"""Vendor the frameworks' own example configs and scripts (tests/test_configs_upstream.py reads them).

Run once by hand from a `git clone` (or the project's mirror) of each repository:
    python tests/data/upstream/vendor.py FRAMEWORK REPO_DIR REF
It copies the configs and scripts of CORPORA[FRAMEWORK] at REF into tests/data/upstream/FRAMEWORK/
(paths kept), writes COMMIT (repository, ref, commit), and for each shell script writes the launch
line it runs, as `set -x` shows it, beside it (`NAME.sh.cmdline`): the script is run by bash with
python/ray/torchrun replaced by a stub that records its argv and stops, under an empty
environment and HOME, so the script's defaults apply. A script that launches nothing gets none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPORA: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], str]] = {
    # framework: (repository, folders, file endings, what its launch line holds)
    "verl": ("verl-project/verl", ("examples",), (".sh", ".yaml"), "verl."),
    "openrlhf": ("OpenRLHF/OpenRLHF", ("examples/scripts",), (".sh",), "openrlhf.cli"),
    "slime": ("THUDM/slime", ("scripts", "examples"), (".sh", ".yaml"), "train"),
    "prime-rl": ("PrimeIntellect-ai/prime-rl", ("examples",), (".toml",), ""),
    "open-r1": ("huggingface/open-r1", ("recipes",), (".yaml",), ""),
    "trl": ("huggingface/trl", ("examples",), (".yaml",), ""),
}
STUBBED = ("python", "python3", "ray", "torchrun", "deepspeed", "accelerate", "nvidia-smi", "pip", "wget", "curl",
           "huggingface-cli", "hf", "git", "sleep", "pkill", "sudo", "docker", "srun", "sbatch", "hostname", "ip")
STUB = """#!/bin/bash
case "$(basename "$0")" in python|python3|ray|torchrun|deepspeed|accelerate|srun) ;; *) exit 0 ;; esac
for a in "$(basename "$0")" "$@"; do printf '%q ' "$a"; done >> "$LAUNCH_OUT"; printf '\\n' >> "$LAUNCH_OUT"
exit 0
"""


def main(framework: str, repo_dir: str, ref: str) -> None:
    repository, folders, endings, entry = CORPORA[framework]
    git = ["git", "-C", repo_dir]
    commit = subprocess.run([*git, "rev-parse", f"{ref}^{{commit}}"], check=True, capture_output=True,
                            text=True).stdout.strip()
    names = subprocess.run([*git, "ls-tree", "-r", "--name-only", commit, *folders], check=True,
                           capture_output=True, text=True).stdout.split()
    out = HERE / framework
    shutil.rmtree(out, ignore_errors=True)
    for name in sorted(n for n in names if n.endswith(endings)):
        data = subprocess.run([*git, "show", f"{commit}:{name}"], check=True, capture_output=True).stdout
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if name.endswith(".sh"):
            line = launch_line(target, entry)
            if line:
                target.with_name(target.name + ".cmdline").write_text(line)
    (out / "COMMIT").write_text(f"{repository} {ref} {commit}\n")


def launch_line(script: Path, entry: str) -> str:
    """The first line the script launches (python/ray/torchrun) that names `entry`, as `set -x` prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        stubs, home, record = Path(tmp, "bin"), Path(tmp, "home"), Path(tmp, "launched")
        stubs.mkdir(), home.mkdir()
        for name in STUBBED:
            (stubs / name).write_text(STUB)
            (stubs / name).chmod(0o755)
        env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(home), "LAUNCH_OUT": str(record)}
        copy = Path(tmp, script.name)  # run a copy: a script that writes beside itself writes in tmp
        shutil.copyfile(script, copy)
        try:
            subprocess.run(["bash", str(copy)], env=env, cwd=tmp, timeout=20, capture_output=True)
        except subprocess.TimeoutExpired:
            return ""
        lines = record.read_text().splitlines() if record.exists() else []
    return next((line.strip() + "\n" for line in lines if entry in line and " -c " not in line), "")


if __name__ == "__main__":
    main(*sys.argv[1:])
