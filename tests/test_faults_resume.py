"""The fault sweep's resume items kept as tests: what a replay publishes is checked wherever it
came from (a fresh replay or the work dir), the rollouts file is pinned for the run, a resumed
run counts its engine's work as one run would, and another checkpoint's context is checked first.

The faults are planted by a scripted `python:` engine at a chosen call (no timing, no kill): it
stops the run (an interrupted audit), or changes the rollouts file or the work dir under it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mismatch.cli import main
from test_golden import GOLDEN, stored_checkpoint

ROLLOUTS = GOLDEN / "rollouts.jsonl"  # 48 rollouts: 6 blocks of 8
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"

SCRIPTED_ENGINE = '''
import json
from pathlib import Path

import numpy as np

CONTROL = Path(__file__).with_name("control.json")


class Scripted:
    """-1.0 for every token; at the calls control.json names, a fault planted."""

    def __init__(self):
        self.calls = self.num_requests = self.num_tokens_scored = 0

    def replay(self, requests, progress=None):
        self.calls += 1
        control = json.loads(CONTROL.read_text()) if CONTROL.is_file() else {}
        if self.calls == control.get("stop_at"):
            raise RuntimeError("stopped by the test")
        if self.calls == control.get("change_at"):
            path = Path(control["path"])
            if control["how"] == "append":
                with path.open("a") as handle:
                    handle.write(control["text"])
            elif control["how"] == "rewrite":
                path.write_text(control["text"])
            else:  # a saved work-dir block overwritten with values no engine returns
                np.save(path, np.full(len(np.load(path)), 0.5))
        self.num_requests += len(requests)
        self.num_tokens_scored += sum(r.num_scored for r in requests)
        return [np.full(r.num_scored, -1.0) for r in requests]

    def describe(self):
        return {"num_requests": self.num_requests, "num_tokens_scored": self.num_tokens_scored,
                "num_replay_calls": self.calls, "seconds": 0.001 * self.calls}


def make(checkpoint, **options):
    return Scripted()
'''


def _engine(tmp_path: Path, **control: object) -> str:
    """The scripted engine's spec; `control` (stop_at, change_at, how, path, text) beside it."""
    path = tmp_path / "scripted.py"
    path.write_text(SCRIPTED_ENGINE)
    _control(tmp_path, **control)
    return f"python:{path}:make"


def _control(tmp_path: Path, **control: object) -> None:
    (tmp_path / "control.json").write_text(json.dumps(control))


def _audit_args(checkpoint: Path, rollouts: Path, engine: str, out: Path) -> list[str]:
    return ["audit", str(checkpoint), "--rollouts", str(rollouts), "--train", "stored:trainer", "--infer", engine,
            "--block-size", "8", "--out", str(out)]


def _interrupted(tmp_path: Path, rollouts: Path = ROLLOUTS) -> tuple[list[str], Path]:
    """An audit stopped at its third block (two saved in the work dir): its args and work dir."""
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    args = _audit_args(checkpoint, rollouts, _engine(tmp_path, stop_at=3), tmp_path / "o")
    assert main(args) == 2  # the engine's raise is one line (engines/user.py), the blocks before it kept
    work = tmp_path / ".o.work"
    assert sorted(p.name for p in work.glob("infer-0*.npy")) == ["infer-000000.npy", "infer-000001.npy"]
    _control(tmp_path)
    return args, work


@pytest.mark.parametrize("damage", ["positive", "nan", "short"])
def test_a_damaged_work_block_is_refused_on_resume_and_replayed_with_force(tmp_path, capsys, damage) -> None:
    args, work = _interrupted(tmp_path)
    block = work / "infer-000001.npy"
    values = np.load(block)
    if damage == "short":
        values = values[:-1]
    else:
        values[3] = 0.5 if damage == "positive" else np.nan  # row 3: position 3, context before it
    np.save(block, values)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{block}: damaged" in err and "pass --force to replay it" in err, err
    assert not (tmp_path / "o").exists()
    assert main([*args, "--force"]) == 0
    logp = pd.read_parquet(tmp_path / "o" / "tokens.parquet")["logp_infer"]
    assert (logp == -1.0).all()  # block 1 replayed again, not the damaged values


def test_a_work_block_changed_after_its_replay_is_not_published(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    engine = _engine(tmp_path, change_at=6, how="block", path=str(tmp_path / ".o.work" / "infer-000000.npy"))
    assert main(_audit_args(checkpoint, ROLLOUTS, engine, tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert "infer-000000.npy: damaged: log-prob 0.5" in err and "nothing published" in err, err
    assert not (tmp_path / "o").exists()


def test_a_rollouts_file_rewritten_during_the_run_is_refused(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    rollouts = tmp_path / "rollouts.jsonl"
    shutil.copy(ROLLOUTS, rollouts)
    lines = ROLLOUTS.read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])
    tokens = last["branches"][0]["segments"][-1]["tokens"]
    tokens[0] = (tokens[0] + 1) % 1000  # another token, the same structure: the silent case
    rewritten = "".join(lines[:-1]) + json.dumps(last) + "\n"
    engine = _engine(tmp_path, change_at=2, how="rewrite", path=str(rollouts), text=rewritten)
    assert main(_audit_args(checkpoint, rollouts, engine, tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert f"{rollouts}: changed during the run (digest " in err and "nothing published; rerun" in err, err
    assert not (tmp_path / "o").exists()


def test_rollouts_appended_during_the_run_are_not_audited(tmp_path) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    rollouts = tmp_path / "rollouts.jsonl"
    shutil.copy(ROLLOUTS, rollouts)
    original = ROLLOUTS.read_bytes()
    more = [json.loads(line) for line in ROLLOUTS.read_text().splitlines()[:4]]
    appended = "".join(json.dumps({**rollout, "id": f"late-{rollout['id']}"}) + "\n" for rollout in more)
    engine = _engine(tmp_path, change_at=2, how="append", path=str(rollouts), text=appended)
    assert main(_audit_args(checkpoint, rollouts, engine, tmp_path / "o")) == 0
    assert rollouts.stat().st_size > len(original)  # it did grow, during the run
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["counts"]["rollouts"] == 48
    assert summary["inputs"]["rollouts"] == {"size": len(original), "digest": hashlib.sha256(original).hexdigest()}
    assert pd.read_parquet(tmp_path / "o" / "tokens.parquet")["rollout"].nunique() == 48


def test_a_growing_jsonl_file_is_read_to_its_pinned_size_in_whole_lines(tmp_path) -> None:
    from mismatch.rollouts import iter_rollouts

    lines = ROLLOUTS.read_text().splitlines(keepends=True)
    path = tmp_path / "r.jsonl"
    path.write_text("".join(lines[:3]))
    whole_lines = path.stat().st_size
    with path.open("a") as handle:
        handle.write(lines[3][:40])  # a line being written when the size was pinned
    cut = path.stat().st_size
    with path.open("a") as handle:
        handle.write(lines[3][40:] + lines[4])
    assert len(list(iter_rollouts(path, limit=whole_lines))) == 3
    assert len(list(iter_rollouts(path, limit=cut))) == 3  # the cut line: not yet a rollout
    assert len(list(iter_rollouts(path, limit=whole_lines + len(lines[3]) + 10))) == 4
    path.write_text("".join(lines[:2]) + lines[2].rstrip("\n"))  # no newline at the end, not growing
    assert len(list(iter_rollouts(path, limit=path.stat().st_size))) == 3


TIMING = {"seconds", "tokens_per_s", "resumed_blocks"}


def _engines(summary: dict) -> dict:
    return {source: {key: value for key, value in engine.items() if key not in TIMING}
            for source, engine in summary["engines"].items()}


def test_a_resumed_runs_engine_counters_equal_one_runs(tmp_path) -> None:
    args, _ = _interrupted(tmp_path)
    assert main(args) == 0
    resumed = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert resumed["engines"]["infer"]["resumed_blocks"] == 2
    assert main([*args[:-1], str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert whole["engines"]["infer"]["num_replay_calls"] == 6
    assert _engines(resumed) == _engines(whole)


def test_another_checkpoints_context_is_checked_before_any_model_loads(tiny_checkpoint, tmp_path, capsys,
                                                                       monkeypatch) -> None:
    import mismatch.replay.passes

    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model loaded before the context check")

    monkeypatch.setattr(mismatch.replay.passes, "load_engine", no_load)
    diff = ["diff", str(tiny_checkpoint), "--rollouts", str(EXAMPLE), "--b", "hf", "--out", str(tmp_path / "d")]
    assert main([*diff, "--a", f"hf:checkpoint={other}"]) == 2
    err = capsys.readouterr().err
    assert f"past the context of 16 of --a hf:checkpoint={other} ({other}/config.json)" in err, err
    assert "rollout '" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / ".d.work").exists()
    assert main([*diff, "--a", f"hf:checkpoint={tmp_path / 'missing'}"]) == 2
    assert f"--a hf:checkpoint={tmp_path / 'missing'}: " in capsys.readouterr().err
