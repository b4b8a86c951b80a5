"""Shards merge into exactly one run's results; a killed audit resumes to exactly the same results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import REPO
from mismatch.pipeline.audit import audit
from mismatch.cli import main
from mismatch.pipeline.merge import merge
from mismatch.replay import Shard

EXAMPLE = REPO / "examples/rollouts.jsonl"
SPECS = {"train": "hf:dtype=bfloat16", "infer": "hf-decode:dtype=bfloat16"}  # batch-variant: a real test
PER_TOKEN = ["rollout_index", "rollout", "branch", "turn", "segment", "pos", "role", "token_id",
             "trainable", "logp_sampler", "logp_train", "logp_infer"]


def _same_tokens(left: pd.DataFrame, right: pd.DataFrame) -> None:
    assert len(left) == len(right)
    for column in PER_TOKEN:
        a, b = left[column].to_numpy(), right[column].to_numpy()
        if a.dtype.kind == "f":
            assert np.array_equal(a, b, equal_nan=True), column  # bitwise, NaNs included
        else:
            assert (a.astype(str) == b.astype(str)).all(), column


# What may differ between two runs of the same inputs: when, how fast, which shard, what was reused.
VOLATILE = {"created_unix", "seconds", "tokens_per_s", "load_seconds", "resumed_blocks", "shards", "shard",
            "merged_from"}


# What a resumed run did itself (it replayed fewer blocks than one run): not what it found.
WORK_DONE = {"num_tokens_scored", "num_requests", "num_forward_calls", "num_tokens_fed", "num_tokens_padded",
             "padding_frac"}


def comparable(summary: dict, volatile: frozenset[str] | set[str] = VOLATILE) -> str:
    """summary.json without its timing and provenance fields, as canonical JSON text."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in volatile}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    return json.dumps(strip(summary), sort_keys=True, default=str)


def test_three_shards_merge_to_one_run(tiny_checkpoint, tmp_path) -> None:
    whole = audit(tiny_checkpoint, EXAMPLE, **SPECS, out=tmp_path / "whole", block_size=2)
    shards = []
    for index in range(3):
        out = tmp_path / f"shard{index}"
        audit(tiny_checkpoint, EXAMPLE, **SPECS, out=out, block_size=2, shard=Shard(index=index, count=3))
        shards.append(out)
    assert main(["merge", *map(str, shards), "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged/summary.json").read_text())
    _same_tokens(pd.read_parquet(tmp_path / "whole/tokens.parquet"),
                 pd.read_parquet(tmp_path / "merged/tokens.parquet"))
    for key in ("pairs", "turns", "roles", "branch_kinds", "corrections", "recommendations", "counts"):
        assert json.dumps(merged[key]) == json.dumps(json.loads(
            (tmp_path / "whole/summary.json").read_text())[key]), key
    # A prefix two shards share is grouped across them by the prefix keys each publishes, as one run does.
    assert merged["prefix_consistency"]["infer"]["n_prefixes"] > 0
    assert comparable(merged, VOLATILE) == comparable(json.loads((tmp_path / "whole/summary.json").read_text()), VOLATILE)
    assert whole.summary["counts"]["rollouts"] == 12
    assert merged["engines"]["infer"]["num_tokens_scored"] == whole.summary["engines"]["infer"]["num_tokens_scored"]


def test_merge_refuses_incomplete_or_mixed_shards(tiny_checkpoint, tmp_path) -> None:
    for index in (0, 1):
        audit(tiny_checkpoint, EXAMPLE, train="hf", infer="hf", out=tmp_path / f"s{index}",
              block_size=4, shard=Shard(index=index, count=3))
    with pytest.raises(Exception, match=r"^shards \[0, 1\] of 3: need each of 0\.\.2 exactly once$"):
        merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_shard_argument_errors(tiny_checkpoint, tmp_path, capsys) -> None:
    args = ["audit", str(tiny_checkpoint), "--rollouts", str(EXAMPLE), "--out", str(tmp_path / "o")]
    assert main([*args, "--shard", "3/3"]) == 2
    assert capsys.readouterr().err.strip() == "mismatch: error: --shard '3/3': expected I/N with 0 <= I < N, e.g. 0/4"
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.work").exists()


def test_empty_shards_write_valid_results_that_merge(tmp_path) -> None:
    """A fixed-size Slurm array over a small file: shards without a block are empty results, not errors."""
    from test_golden import GOLDEN, stored_checkpoint

    checkpoint, rollouts = stored_checkpoint(tmp_path / "ckpt"), GOLDEN / "rollouts.jsonl"
    stored = {"train": "stored:trainer", "infer": "stored:engine"}
    whole = audit(checkpoint, rollouts, **stored, out=tmp_path / "whole")  # 48 rollouts: one block of 64
    for index in range(3):
        result = audit(checkpoint, rollouts, **stored, out=tmp_path / f"s{index}", shard=Shard(index=index, count=3))
        assert result.summary["counts"]["tokens"] == (whole.summary["counts"]["tokens"] if index == 0 else 0)
    merged = merge([tmp_path / f"s{index}" for index in range(3)], tmp_path / "merged")
    _same_tokens(pd.read_parquet(tmp_path / "whole/tokens.parquet"), pd.read_parquet(tmp_path / "merged/tokens.parquet"))
    for key in ("pairs", "turns", "roles", "branch_kinds", "corrections", "counts", "clip", "framework_metrics"):
        assert json.dumps(merged[key]) == json.dumps(whole.summary[key], default=str), key


def test_kill_9_then_resume_equals_an_uninterrupted_run(tiny_checkpoint, tmp_path) -> None:
    script = Path(sys.executable).with_name("mismatch")
    out = tmp_path / "resumed"
    command = [str(script), "audit", str(tiny_checkpoint), "--rollouts", str(EXAMPLE), "--train",
               SPECS["train"], "--infer", SPECS["infer"], "--block-size", "1",
               "--out", str(out)]
    work = tmp_path / ".resumed.work"
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(work.glob("infer-*.npy"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the audit finished before it could be killed: make the workload bigger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and len(list(work.glob("infer-*.npy"))) >= 2
    subprocess.run(command, check=True, capture_output=True)
    assert not work.exists()
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["engines"]["train"]["resumed_blocks"] == 12
    assert resumed["engines"]["infer"]["resumed_blocks"] >= 2
    whole = tmp_path / "whole"
    subprocess.run([*command[:-1], str(whole)], check=True, capture_output=True)
    _same_tokens(pd.read_parquet(whole / "tokens.parquet"), pd.read_parquet(out / "tokens.parquet"))
    assert (comparable(resumed, VOLATILE | WORK_DONE)
            == comparable(json.loads((whole / "summary.json").read_text()), VOLATILE | WORK_DONE))
    assert resumed["engines"]["train"]["options"]["dtype"] == "bfloat16"  # all 12 blocks reused, still described


def test_work_dir_of_another_run_is_not_reused(tiny_checkpoint, tmp_path, capsys) -> None:
    work = tmp_path / ".o.work"
    work.mkdir()
    (work / "manifest.json").write_text('{"command": "something else"}')
    args = ["audit", str(tiny_checkpoint), "--rollouts", str(EXAMPLE), "--out", str(tmp_path / "o"),
            "--infer", "hf"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (f"mismatch: error: {work}: holds an interrupted run with "
                                               "other inputs; pass --force to discard it")
    assert main([*args, "--force"]) == 0 and not work.exists()
