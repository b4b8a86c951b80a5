"""The fault sweep kept as tests: concurrent runs, resumes and merges of changed inputs, odd output
dirs and the leftovers of killed runs. Nothing lost, nothing mixed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mismatch.pipeline.audit import audit
from mismatch.cli import main
from mismatch.pipeline.merge import merge
from mismatch.replay import Shard
from mismatch.results import WorkDir
from test_golden import GOLDEN, stored_checkpoint

ROLLOUTS = GOLDEN / "rollouts.jsonl"
STORED = {"train": "stored:trainer", "infer": "stored:engine"}

SLOW_ENGINE = '''
import time
import numpy as np

class Slow:
    def replay(self, requests, progress=None):
        time.sleep({seconds})
        return [np.full(r.num_scored, -1.0) for r in requests]

def make(checkpoint, **options):
    return Slow()
'''


def _engine_file(tmp_path: Path, seconds: float, name: str = "slow_engine.py") -> str:
    path = tmp_path / name
    path.write_text(SLOW_ENGINE.replace("{seconds}", repr(seconds)))
    return f"python:{path}:make"


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mismatch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_concurrent_audits_into_one_out_one_succeeds_the_other_changes_nothing(tmp_path) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "o"
    args = ["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), "--train", "stored:trainer", "--out", str(out)]
    first = _cli(*args, "--infer", _engine_file(tmp_path, 4.0))
    lock = tmp_path / ".o.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().startswith("pid")) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = _cli(*args, "--infer", "stored:engine")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2, err
    assert f"another mismatch run is writing it (pid {first.pid} on " in err
    assert first.wait(timeout=120) == 0, first.stderr.read()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engines"]["infer"]["kind"] == "python"  # the first run's results, whole
    assert not lock.exists() and not (tmp_path / ".o.work").exists()


def _kill_after_first_block(command: list[str], work: Path) -> None:
    """Start the audit and kill -9 it once one block of the infer role is saved."""
    import signal

    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(work.glob("infer-*.npy")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(work.glob("infer-*.npy")), "the audit finished before a block was saved"


def test_resume_after_the_engine_toml_changed_is_refused_and_the_same_toml_resumes(tmp_path, capsys) -> None:
    from test_scale import VOLATILE, WORK_DONE, comparable

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    target = _engine_file(tmp_path, 0.5).removeprefix("python:")
    toml = tmp_path / "engine.toml"
    original = f'engine = "python"\ntarget = "{target}"\n'
    toml.write_text(original)
    out = tmp_path / "o"
    args = ["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), "--train", "stored:trainer",
            "--infer", str(toml), "--block-size", "8", "--out"]
    _kill_after_first_block([sys.executable, "-m", "mismatch", *args, str(out)], tmp_path / ".o.work")
    toml.write_text(original + "temperature = 0.7\n")  # same path, other config
    assert main([*args, str(out)]) == 2
    assert "holds an interrupted run with other inputs" in capsys.readouterr().err
    assert not out.exists() and (tmp_path / ".o.work").exists()  # the user's to --force away
    toml.write_text(original)
    assert main([*args, str(out)]) == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["engines"]["infer"]["resumed_blocks"] >= 1
    assert main([*args, str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert comparable(resumed, VOLATILE | WORK_DONE) == comparable(whole, VOLATILE | WORK_DONE)


def test_shards_of_two_versions_of_the_rollouts_file_do_not_merge(tmp_path) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(ROLLOUTS.read_text())
    audit(checkpoint, rollouts, **STORED, out=tmp_path / "s0", block_size=8, shard=Shard(index=0, count=2))
    lines = rollouts.read_text().splitlines()
    lines[-1] = lines[-1].replace('"id": "', '"id": "v2-', 1) if '"id": "' in lines[-1] else lines[-1] + " "
    rollouts.write_text("\n".join(lines) + "\n")  # same path, other content
    audit(checkpoint, rollouts, **STORED, out=tmp_path / "s1", block_size=8, shard=Shard(index=1, count=2))
    with pytest.raises(Exception, match=r"its rollouts file's content differs from .*s0's"):
        merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_out_on_a_mount_point_is_published_in_place(tmp_path) -> None:
    mount = tmp_path / "volume"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root in a container that allows it)")
    try:
        checkpoint = stored_checkpoint(tmp_path / "ckpt")
        assert os.path.ismount(mount)
        assert main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), *sum(
            ([f"--{k}", v] for k, v in STORED.items()), []), "--out", str(mount)]) == 0
        assert {"summary.json", "tokens.parquet", "rollouts.parquet", "index.html"} <= {p.name for p in mount.iterdir()}
        assert not [p for p in mount.iterdir() if p.name.startswith(".")]
        assert main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), *sum(
            ([f"--{k}", v] for k, v in STORED.items()), []), "--out", str(mount), "--force"]) == 0
        assert json.loads((mount / "summary.json").read_text())["schema"] == "mismatch.summary/v1"
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_read_only_parent_is_refused_before_any_work(tmp_path, capsys) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: permission bits cannot make a read-only dir here")
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    assert main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), "--out", str(parent / "o")]) == 2
    assert "cannot write in" in capsys.readouterr().err


def test_leftovers_of_killed_runs_are_settled_by_the_next_run(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "o"
    args = ["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), "--train", "stored:trainer",
            "--infer", "stored:engine", "--out", str(out)]
    assert main(args) == 0
    before = (out / "summary.json").read_text()
    # A --force replace killed between its two renames: the old results sit in the trash.
    trash = tmp_path / ".o.old-abc123"
    trash.mkdir()
    os.replace(out, trash / "old")
    (tmp_path / ".o.tmp-def456").mkdir()  # and a stage of a run killed before publishing
    (tmp_path / ".o.tmp-def456" / "tokens.parquet").write_bytes(b"half")
    (tmp_path / ".o.999999999.log").write_text("a killed run's pending dependency log")
    assert main(args) == 2  # no --force: the restored results are the user's
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "o"]


def test_an_empty_or_cut_work_block_is_replayed_not_fatal(tmp_path) -> None:
    work = WorkDir(tmp_path / ".o.work", {"command": "audit"})
    import numpy as np

    work.save("infer", 0, np.array([-1.0, -2.0]))
    (work.path / "infer-000001.npy").write_bytes(b"")
    (work.path / "infer-000002.npy").write_bytes((work.path / "infer-000000.npy").read_bytes()[:20])
    assert work.load("infer", 0).tolist() == [-1.0, -2.0]
    assert work.load("infer", 1) is None and work.load("infer", 2) is None
    assert not (work.path / "infer-000001.npy").exists()


def test_a_stream_past_the_models_context_is_refused_before_any_replay(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    code = main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), "--train", "hf", "--infer", "stored:engine",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "past the model's context of 16 (config.json)" in err and "rollout 'g-" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.work").exists()
    # Stored log-probs replay no model: nothing to refuse.
    assert main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), *sum(
        ([f"--{k}", v] for k, v in STORED.items()), []), "--out", str(tmp_path / "s")]) == 0


def test_a_nan_weight_is_named_at_the_first_token_not_blamed_on_the_sampler(tiny_checkpoint, tmp_path, capsys) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-ckpt"
    shutil.copytree(tiny_checkpoint, broken)
    weights = load_file(broken / "model.safetensors")
    name = next(key for key in weights if "layers.0.mlp" in key)
    weights[name][0, 0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    example = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
    code = main(["audit", str(broken), "--rollouts", str(example), "--train", "hf", "--infer", "sampler",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "--train hf: log-prob nan for token" in err and " position " in err, err
    assert not (tmp_path / "o").exists()
