"""Step-indexed dumps: the files of a dump directory in step order, each with the step its name gives.

`import_file` reads a directory through `dump_files`, so one `mismatch import FORMAT DIR` turns a
whole run's per-step dumps into one rollouts file with `meta.step` on every rollout.
"""

from __future__ import annotations

import re
from pathlib import Path

# What each framework names its per-step dumps:
# - verl `trainer.rollout_data_dir`: `{global_steps}.jsonl` (verl-project/verl@1dda039b
#   verl/trainer/ppo/ray_trainer.py:454-457, verl 0.9.1 the same lines);
# - prime-rl filesystem rollout transport: `rollouts/step_{N}/rank_{R}.bin` (PrimeIntellect-ai/
#   prime-rl@559b4477 src/prime_rl/transports/rollouts/filesystem.py:29-35);
# - slime `--save-debug-rollout-data`: `rollout_data/{rollout_id}.pt` (THUDM/slime@624b824a
#   slime/observability/rollout_data_utils.py:140-153);
# - SkyRL `trainer.dump_data_batch`: `dumped_data/global_step_{N}_training_input.pkl`
#   (NovaSky-AI/SkyRL@a9564572 skyrl/train/trainer.py:441-446, 1236-1242).
# A name is a step when it says so (`step_N`, `step-N`, `global_step_N`, optionally followed by
# `_...`) or is a bare integer; one that says so wins over a bare integer (`step_3/0.pt` is step 3).
NAMED_STEP = re.compile(r"^(?:global_)?step[_-]?(\d+)(?:_.*)?$")
BARE_STEP = re.compile(r"^(\d+)$")


def step_of(parts: tuple[str, ...]) -> int | None:
    """The step named by the deepest of `parts` (folder names, then the file's stem) that names one."""
    for pattern in (NAMED_STEP, BARE_STEP):
        for part in reversed(parts):
            match = pattern.match(part)
            if match:
                return int(match.group(1))
    return None


def file_step(path: Path) -> int | None:
    """A single dump file's step: from its stem (`12.jsonl`, `global_step_12_...`), else a folder
    that says so (`step_3/rank_0.bin`); a folder that is only a number may be anything."""
    named = step_of((path.stem,))
    if named is not None:
        return named
    match = NAMED_STEP.match(path.parent.name)
    return int(match.group(1)) if match else None


def dump_files(root: Path, suffixes: frozenset[str]) -> list[tuple[Path, str, int | None]]:
    """(file, its name relative to `root` without the suffix, step) for every dump file under `root`
    (hidden files and unknown suffixes skipped), in step order, files without a step last."""
    found = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        if path.suffix.lower() not in suffixes:
            continue
        stem = relative.with_suffix("")
        found.append((path, stem.as_posix(), step_of(stem.parts)))
    return sorted(found, key=lambda item: (item[2] is None, item[2] or 0, item[1]))
