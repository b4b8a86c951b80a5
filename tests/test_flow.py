"""One audit, walked: every engine loaded once per config, every stage once, in order; the
processed-log-prob audit (the like-for-like trainer column planned with the trainer's own replay)
resumes after kill -9 to the same results."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mismatch.demo.toy_agent import HarnessConfig, write_rollouts
from test_scale import VOLATILE, WORK_DONE, comparable


@pytest.fixture(scope="module")
def processed_rollouts(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy agent at T=0.7: its rollouts declare processed log-probs in meta.sampler."""
    path = tmp_path_factory.mktemp("flow") / "rollouts.jsonl"
    write_rollouts(tiny_checkpoint, path, HarnessConfig(num_rollouts=6, max_turns=2, temperature=0.7))
    return path


def test_one_audit_loads_each_engine_once_and_runs_each_stage_once(tiny_checkpoint, processed_rollouts,
                                                                     tmp_path, monkeypatch) -> None:
    passes = importlib.import_module("mismatch.replay.passes")  # loads each engine
    blocks = importlib.import_module("mismatch.replay.blocks")  # plans each block
    audit_module = importlib.import_module("mismatch.pipeline.audit")
    calls: list[str] = []

    def counted(module, name, label=None):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(label or name)
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    loads: list[str] = []
    original_load = passes.load_engine
    monkeypatch.setattr(passes, "load_engine", lambda spec, checkpoint: (loads.append(spec.text),
                                                                        original_load(spec, checkpoint))[1])
    counted(blocks, "plan_replay")
    for name in ("check_alignment", "analyze_audit", "replay_processed"):
        counted(audit_module, name)
    counted(importlib.import_module("mismatch.pipeline.stages"), "write_results_files")
    result = audit_module.audit(tiny_checkpoint, processed_rollouts, train="hf", infer="hf-decode:dtype=bfloat16",
                                out=tmp_path / "o")
    assert loads == ["hf", "hf-decode:dtype=bfloat16"]  # the processed column came with the trainer's load
    # The file is one block: planned once per engine (each streams the file) and once more when
    # the results are stored; no replay_processed: it was planned, not run after the fact.
    assert calls == ["plan_replay"] * 3 + ["check_alignment", "analyze_audit", "write_results_files"]
    assert "logp_train_processed" in result.tokens.columns
    assert result.summary["engines"]["train"]["processed"] == {"temperature": 0.7, "top_k": -1, "top_p": 1.0}
    assert "train_processed/sampler" in result.summary["pairs"]


def test_the_processed_audit_resumes_after_kill_9_identically(tiny_checkpoint, processed_rollouts, tmp_path) -> None:
    command = [sys.executable, "-m", "mismatch", "audit", str(tiny_checkpoint), "--rollouts", str(processed_rollouts),
               "--train", "hf", "--infer", "hf-decode:dtype=bfloat16", "--block-size", "1", "--out"]
    work = tmp_path / ".resumed.work"
    proc = subprocess.Popen([*command, str(tmp_path / "resumed")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not list(work.glob("train_processed-*.npy")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the audit finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(work.glob("train_processed-*.npy"))
    done = subprocess.run([*command, str(tmp_path / "resumed")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    subprocess.run([*command, str(tmp_path / "whole")], check=True, capture_output=True)
    resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert resumed["engines"]["train"]["resumed_blocks"] >= 1
    assert comparable(resumed, VOLATILE | WORK_DONE) == comparable(whole, VOLATILE | WORK_DONE)
    assert "train_processed/sampler" in resumed["pairs"]


def test_localize_with_a_shard_is_refused_before_any_replay(tiny_checkpoint, tmp_path, capsys) -> None:
    from mismatch.cli import main

    example = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(example), "--localize", "--shard", "0/2",
                 "--out", str(tmp_path / "o")]) == 2
    assert "--localize with --shard: localization needs the whole run" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.work").exists()


def test_the_model_localizers_are_a_stage_of_the_work_dir(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """A rerun after a kill past the localizers reads their result from the work dir."""
    audit_module = importlib.import_module("mismatch.pipeline.audit")
    example = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
    calls = []
    original = audit_module.run_model_localizers
    monkeypatch.setattr(audit_module, "run_model_localizers", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    stages = importlib.import_module("mismatch.pipeline.stages")
    real_publish = stages.write_results_files

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill after the localizers, before publishing
    monkeypatch.setattr(stages, "write_results_files", killed)
    with pytest.raises(KeyboardInterrupt):
        audit_module.audit(tiny_checkpoint, example, train="hf", infer="hf:dtype=bfloat16", out=tmp_path / "o",
                           localize_models=True)
    assert calls == [1] and (tmp_path / ".o.work" / "stage-localize.json").is_file()
    monkeypatch.setattr(stages, "write_results_files", real_publish)
    result = audit_module.audit(tiny_checkpoint, example, train="hf", infer="hf:dtype=bfloat16", out=tmp_path / "o",
                                localize_models=True)
    assert calls == [1]  # not run again
    assert "layers" in result.summary["localization"] and not (tmp_path / ".o.work").exists()
