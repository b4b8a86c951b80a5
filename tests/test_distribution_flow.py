"""--distribution through the flow around it (issue #48): shards merged, a pass killed and resumed,
the trend over steps. Each against one uninterrupted run made in the same test session.

The merge and the resume use real torch engines on the tiny checkpoint (hf fp32 against hf-decode
bf16: a real gap on the whole distribution); the trend uses two loopback servers of vLLM's
completions API (tests/test_http.py's dialect), whose top-K moves by a set amount at chosen steps,
so each step costs no model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_http import _server, _toml
from test_scale import VOLATILE, WORK_DONE, comparable

from mismatch.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SPECS = ["--train", "hf", "--infer", "hf-decode:dtype=bfloat16", "--distribution", "full", "--block-size", "2"]


def _audit(checkpoint: Path, rollouts: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mismatch", "audit", str(checkpoint), "--rollouts", str(rollouts), *SPECS, *extra,
            "--out", str(out)]


@pytest.fixture(scope="module")
def whole(tiny_checkpoint, sampled_rollouts, tmp_path_factory) -> Path:
    """One uninterrupted audit with the pass (6 rollouts, 3 blocks)."""
    out = tmp_path_factory.mktemp("dist-flow") / "whole"
    done = subprocess.run(_audit(tiny_checkpoint, sampled_rollouts, out), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _distribution(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())["distribution"]


def _close(got: Any, want: Any, path: str = "") -> None:
    """The same JSON, numbers within float tolerance (a merge reassociates sums), timings aside."""
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for key in want:
            if key != "seconds":
                _close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), path
    else:
        assert got == want, path


def test_merged_shards_rebuild_the_distribution_of_one_run(whole, tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    shards = [tmp_path / f"shard{index}" for index in range(2)]
    for index, out in enumerate(shards):
        done = subprocess.run(_audit(tiny_checkpoint, sampled_rollouts, out, "--shard", f"{index}/2"),
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    assert main(["merge", *map(str, shards), "--out", str(tmp_path / "merged")]) == 0
    merged, want = _distribution(tmp_path / "merged"), _distribution(whole)
    _close(merged, want)
    assert merged["train/infer"]["n_positions"] == sum(_distribution(s)["train/infer"]["n_positions"] for s in shards)
    assert merged["train/infer"]["kl"] > 0  # a real gap: bf16 decode against fp32


def test_a_killed_distribution_pass_resumes_to_one_runs_summary(whole, tiny_checkpoint, sampled_rollouts,
                                                                tmp_path) -> None:
    out, work = tmp_path / "resumed", tmp_path / ".resumed.work"
    command = _audit(tiny_checkpoint, sampled_rollouts, out)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(work.glob("dist-train-infer-full-*.npy")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the audit finished before its distribution pass could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = sorted(work.glob("dist-train-infer-full-*.npy"))
    assert 1 <= len(saved) < 3 and not out.exists()  # killed inside the pass: some of its 3 blocks saved
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = json.loads((out / "summary.json").read_text())
    wanted = json.loads((whole / "summary.json").read_text())
    assert resumed["distribution"] == {pair: {**entry, "seconds": resumed["distribution"][pair]["seconds"]}
                                       for pair, entry in wanted["distribution"].items()}  # bit for bit
    assert comparable(resumed, VOLATILE | WORK_DONE) == comparable(wanted, VOLATILE | WORK_DONE)


def _shifted(shift: float, k: int = 4) -> Any:
    """vLLM's completions answer: at every position the top-k ids 100.. holding half the mass, in
    proportion to exp(-(ln 2 − shift)·j); the prompt token outside them at log-prob log(0.01)."""
    weights = np.exp(-(np.log(2) - shift) * np.arange(k))
    logp_top = np.log(0.5 * weights / weights.sum())

    def answer(body: dict[str, Any] | None) -> tuple[int, Any]:
        ids, asked = (body or {})["prompt"], (body or {})["prompt_logprobs"]
        rows: list[Any] = [None]
        for token in ids[1:]:
            top = {str(100 + j): {"logprob": float(logp_top[j]), "rank": j + 1} for j in range(min(asked, k))}
            rows.append({str(token): {"logprob": float(np.log(0.01)), "rank": k + 1}, **top})
        return 200, {"choices": [{"prompt_logprobs": rows, "prompt_token_ids": ids}]}
    return answer


def test_trend_of_dist_kl_over_steps_names_the_steps_without_it(tmp_path, capsys) -> None:
    """Eight steps; the engine side's top-K moves at step 5; steps 2 and 7 ran without --distribution.
    The trend names those two and reads no value there; without them it reads each step's own and
    finds the change (3 measured steps on each side: the fewest a change point is tested on)."""
    from test_golden import GOLDEN, stored_checkpoint

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join((GOLDEN / "rollouts.jsonl").read_text().splitlines(keepends=True)[:8]))
    shifts = {1: 0.0, 2: 0.0, 3: 0.02, 4: 0.01, 5: 0.5, 6: 0.52, 7: 0.5, 8: 0.51}
    lacking = (2, 7)
    with _server({"POST /v1/completions": _shifted(0.0)}) as trainer_url:
        for step, shift in shifts.items():
            (tmp_path / f"e{step}").mkdir()
            (tmp_path / f"t{step}").mkdir()
            with _server({"POST /v1/completions": _shifted(shift)}) as engine_url:
                args = ["audit", str(checkpoint), "--rollouts", str(rollouts),
                        "--train", _toml(tmp_path / f"t{step}", url=f"{trainer_url}/v1", api="openai", model="tiny"),
                        "--infer", _toml(tmp_path / f"e{step}", url=f"{engine_url}/v1", api="openai", model="tiny"),
                        "--out", str(tmp_path / "steps" / f"step_{step}")]
                assert main([*args, *([] if step in lacking else ["--distribution", "4"])]) == 0
    capsys.readouterr()
    steps = [str(tmp_path / "steps" / f"step_{step}") for step in shifts]
    assert main(["trend", *steps, "--metric", "dist.kl", "--pair", "train/infer"]) == 2
    err = capsys.readouterr().err
    assert f"step 2 ({steps[1]}), step 7 ({steps[6]}): no value of dist.kl for train/infer" in err
    assert "ran without --distribution" in err and "step 1 " not in err
    kept = [path for step, path in zip(shifts, steps) if step not in lacking]
    assert main(["trend", *kept, "--metric", "dist.kl", "--pair", "train/infer", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    want = [_distribution(Path(path))["train/infer"]["kl"] for path in kept]
    assert [row["value"] for row in found["series"]["dist.kl"]] == want
    assert want[0] == 0 < max(want[1:3]) < 1e-3 < 0.05 < min(want[3:])
    assert found["change_points"] == [5]  # where the engine's top-K moved
    assert main(["trend", *kept, "--metric", "dist.kl", "--pair", "train/infer",
                 "--report", str(tmp_path / "trend.html")]) == 0  # the terminal and the page draw it too
    out = capsys.readouterr().out
    assert "dist.kl" in out and "step 5" in out and (tmp_path / "trend.html").is_file()
    print(f"trend dist.kl over steps 1,3,4,5,6,8: {want}; changes {found['changes']}")
