"""What `mismatch trend` and `gate --trend` read, held to the core's standard (mismatch/trend/steps.py,
cli/trend.py, advise/trend_gate.py): step numbers from names only when every name has one, strictly;
a rollouts.parquet that is garbage, cut short or another run's; a --report that cannot be written; a
step without the pair or metric asked for. Each is one line and exit 2, nothing written.

The run: four real audits of stored log-probs (no model loads), the gap growing with the step.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from mismatch.cli import main
from mismatch.hooks.dump import StepDump, sample_rollout
from mismatch.trend.steps import step_in_name

STEPS = 4


@pytest.fixture(scope="module")
def run(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("trend-inputs")
    dirs = []
    for step in range(STEPS):
        rollouts = base / f"r{step}.jsonl"
        with StepDump(rollouts, framework="test") as dump:
            for i in range(6):
                n = 6 + i
                logp = [-0.4 - 0.03 * ((k * 7 + i) % 13) for k in range(n)]
                gap = 0.02 * (1 + step)  # the gap grows with the step
                dump.write([sample_rollout(f"r{i}", [1, 2, 3], [20 + (k + i) % 40 for k in range(n)], [1] * n, logp,
                                           extra_logprobs={"trainer": [v - gap * (k % 3) for k, v in enumerate(logp)]})],
                           step=step)
        out = base / f"step_{step}"
        assert main(["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", "stored:trainer",
                     "--infer", "sampler", "--out", str(out)]) == 0
        dirs.append(out)
    return dirs


@pytest.fixture()
def copied(run: list[Path], tmp_path: Path) -> list[Path]:
    dirs = []
    for path in run:
        shutil.copytree(path, tmp_path / path.name)
        dirs.append(tmp_path / path.name)
    return dirs


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize(("name", "step"), [
    ("step_12", 12), ("global_step_12", 12), ("ckpt-12", 12), ("12", 12), ("step12", 12), ("step_007", 7),
    ("step_-7", None), ("-7", None), ("step_+7", None), ("step_1e3", None), ("step_1.5", None),
    ("step_\u0663", None), ("step_\u06631", None), ("latest", None), ("", None)])
def test_a_step_is_the_ascii_digits_ending_a_name(name, step):
    assert step_in_name(name) == step


@pytest.mark.parametrize("renamed", ["latest", "step_-2", "step_1e3", "step_\u0662"])
def test_one_dir_without_a_step_number_refuses_the_run_unless_order_given(copied, capsys, renamed):
    moved = copied[2].rename(copied[2].parent / renamed)
    dirs = [copied[0], copied[1], moved, copied[3]]
    for command in (["trend", *map(str, dirs)],
                    ["gate", "--trend", *map(str, dirs), "--max-slope", "kl_k3=1"]):
        assert main(command) == 2
        line = _one_line(capsys)
        assert f"{moved}: no step number in the name" in line and "--order given" in line
    # the order given, said so
    capsys.readouterr()
    assert main(["trend", *map(str, dirs), "--order", "given", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["step_from"] == "order" and [row["step"] for row in found["series"]["kl_k3"]] == [0, 1, 2, 3]
    assert main(["gate", "--trend", *map(str, dirs), "--order", "given", "--max-slope", "kl_k3=1"]) == 0


def test_names_order_the_steps_whatever_order_they_are_given_in(copied, capsys):
    capsys.readouterr()
    assert main(["trend", *map(str, reversed(copied)), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["step_from"] == "directory name" and [r["step"] for r in found["series"]["kl_k3"]] == [0, 1, 2, 3]
    assert main(["trend", *map(str, copied), "--order", "sideways"]) == 2
    assert "--order 'sideways': expected one of names, given" in _one_line(capsys)


def _garbage(path: Path) -> None:
    (path / "rollouts.parquet").write_bytes(b"not parquet at all")


def _cut(path: Path) -> None:
    data = (path / "rollouts.parquet").read_bytes()
    (path / "rollouts.parquet").write_bytes(data[: len(data) // 2])


def _unrecorded(summary: dict) -> None:
    del summary["shard"]["files"]


@pytest.mark.parametrize("damage", [_garbage, _cut])
@pytest.mark.parametrize("recorded", [True, False])
def test_a_damaged_rollouts_parquet_is_one_line(copied, capsys, damage, recorded):
    if not recorded:  # no digest to compare with: the file itself is read and refused
        summary = json.loads((copied[1] / "summary.json").read_text())
        _unrecorded(summary)
        (copied[1] / "summary.json").write_text(json.dumps(summary))
    damage(copied[1])
    assert main(["trend", *map(str, copied)]) == 2
    line = _one_line(capsys)
    said = "its content is not what" if recorded else "not a readable Parquet table"
    assert f"{copied[1] / 'rollouts.parquet'}: {said}" in line


def test_another_steps_rollouts_parquet_is_refused(copied, capsys):
    shutil.copy(copied[0] / "rollouts.parquet", copied[1] / "rollouts.parquet")
    assert main(["trend", *map(str, copied)]) == 2
    assert "rollouts.parquet: its content is not what" in _one_line(capsys)


@pytest.mark.parametrize("where", ["a dir", "no parent", "unwritable"])
def test_a_report_path_that_cannot_be_written_is_refused_before_any_work(copied, tmp_path, capsys, where):
    target = {"a dir": tmp_path, "no parent": tmp_path / "nowhere" / "t.html", "unwritable": Path("/proc/t.html")}[where]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["trend", *map(str, copied), "--report", str(target)]) == 2
    assert f"--report {target}: " in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("missing", ["pair", "metric"])
def test_a_step_without_the_pair_or_metric_is_named(copied, capsys, missing):
    summary = json.loads((copied[2] / "summary.json").read_text())
    if missing == "pair":
        del summary["pairs"]["train/sampler"]
    else:
        summary["pairs"]["train/sampler"]["kl_k3"] = None
    (copied[2] / "summary.json").write_text(json.dumps(summary))
    said = "no pair 'train/sampler'" if missing == "pair" else "no value of kl_k3 for train/sampler"
    for command in (["trend", *map(str, copied)], ["gate", "--trend", *map(str, copied), "--max-slope", "kl_k3=1"]):
        assert main(command) == 2
        line = _one_line(capsys)
        assert f"step 2 ({copied[2]}): {said}" in line


def test_the_ess_ci_is_the_step_ess_from_its_rollouts_and_covers_at_its_level() -> None:
    """ESS from each rollout's ratio_mean and chi2_token is the pooled (Σ r)² / (N Σ r²) of the
    tokens; its delta-method CI over rollouts covers the population ESS about 95% of the time on
    simulated steps of 40 rollouts whose log-ratios share a per-rollout offset (clustered)."""
    import pandas as pd

    from mismatch.trend.steps import _ess

    def step(rng: np.random.Generator) -> tuple[pd.DataFrame, np.ndarray]:
        rows, tokens = [], []
        for _ in range(40):
            n = int(rng.integers(20, 200))
            ratio = np.exp(rng.normal(rng.normal(0, 0.05), 0.2, n))
            rows.append({"n_tokens": n, "ratio_mean": ratio.mean(), "chi2_token": np.mean(ratio ** 2) - 1.0})
            tokens.append(ratio)
        return pd.DataFrame(rows), np.concatenate(tokens)

    rng = np.random.default_rng(0)
    rows, ratio = step(rng)
    estimate, (low, high) = _ess(rows)
    assert estimate == pytest.approx(ratio.sum() ** 2 / (len(ratio) * np.sum(ratio ** 2)), rel=1e-12)
    assert low < estimate < high
    # The population's ESS: E[r]² / E[r²] with log r ~ N(0, 0.05² + 0.2²).
    truth = math.exp(-(0.05 ** 2 + 0.2 ** 2))
    covered = [low <= truth <= high for low, high in (_ess(step(rng)[0])[1] for _ in range(400))]
    assert 0.9 <= np.mean(covered) <= 0.99, np.mean(covered)
    assert _ess(rows.iloc[:1])[1] is None  # one rollout: a value, no CI
