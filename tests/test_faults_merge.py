"""Fault sweep B (issue 31): inputs known by their content, and a merge that verifies what it merges.

Each test reproduces one fault on stored-only audits of the golden rollouts (no model load): weights
edited in place, copies of a checkpoint, a shard dir whose files are not its own, options that change
numbers, prefix consistency across shards, a full disk while publishing, a dangling --out.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mismatch.cli import main
from mismatch.pipeline.audit import audit
from mismatch.replay import Shard
from test_golden import GOLDEN, stored_checkpoint

ROLLOUTS = GOLDEN / "rollouts.jsonl"
STORED = {"train": "stored:trainer", "infer": "stored:engine"}
STORED_ARGS = ["--train", "stored:trainer", "--infer", "stored:engine"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> Path:
    """The digest cache of these tests is theirs, never the user's."""
    cache = tmp_path / "digest-cache"
    monkeypatch.setenv("MISMATCH_CACHE_DIR", str(cache))
    return cache


def _shards(checkpoint: Path, tmp_path: Path, count: int = 2, *, rollouts: Path = ROLLOUTS,
            block_size: int = 8, **options) -> list[Path]:
    dirs = []
    for index in range(count):
        out = tmp_path / f"s{index}"
        audit(checkpoint, rollouts, **STORED, out=out, block_size=block_size, shard=Shard(index=index, count=count),
              **options)
        dirs.append(out)
    return dirs


def _merge(dirs: list[Path], out: Path, capsys) -> tuple[int, str]:
    code = main(["merge", *map(str, dirs), "--out", str(out)])
    return code, capsys.readouterr().err


def _edit_in_place_keeping_size_and_mtime(file: Path) -> None:
    """Overwrite the last 4 bytes (the one float32 weight: the header stays) and put the times back."""
    before = file.stat()
    data = bytearray(file.read_bytes())
    data[-4:] = np.float32(1.0).tobytes()
    file.write_bytes(bytes(data))
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = file.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


# --- 1. identity by content ---------------------------------------------------------------------

FAILING_ENGINE = '''
from pathlib import Path
import numpy as np
from mismatch.errors import EngineError

class Once:
    calls = 0
    def replay(self, requests, progress=None):
        Once.calls += 1
        if Once.calls > 1 and Path({marker!r}).exists():
            raise EngineError("stopped after the first block (test)")
        return [np.full(r.num_scored, -1.0) for r in requests]

def make(checkpoint, **options):
    return Once()
'''


def test_weights_edited_in_place_with_size_and_mtime_kept_refuse_the_resume(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "stop"
    marker.touch()
    engine = tmp_path / "once.py"
    engine.write_text(FAILING_ENGINE.replace("{marker!r}", repr(str(marker))))
    out = tmp_path / "o"
    args = ["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), "--train", "stored:trainer",
            "--infer", f"python:{engine}:make", "--block-size", "8", "--out", str(out)]
    assert main(args) == 2 and "stopped after the first block" in capsys.readouterr().err
    assert list((tmp_path / ".o.work").glob("infer-*.npy"))  # an interrupted run to resume
    _edit_in_place_keeping_size_and_mtime(checkpoint / "model.safetensors")
    marker.unlink()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds an interrupted run with other inputs; pass --force" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_weights_edited_in_place_between_shards_do_not_merge(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    audit(checkpoint, ROLLOUTS, **STORED, out=tmp_path / "s0", block_size=8, shard=Shard(index=0, count=2))
    _edit_in_place_keeping_size_and_mtime(checkpoint / "model.safetensors")
    audit(checkpoint, ROLLOUTS, **STORED, out=tmp_path / "s1", block_size=8, shard=Shard(index=1, count=2))
    code, err = _merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m", capsys)
    assert code == 2 and "its checkpoint files differ from" in err, err
    assert not (tmp_path / "m").exists()


def test_a_copy_of_the_checkpoint_on_each_node_merges(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    for file in checkpoint.iterdir():  # written long ago: the copy's times differ for sure
        os.utime(file, ns=(10**18, 10**18))
    copy = Path(shutil.copytree(checkpoint, tmp_path / "node1" / "ckpt", copy_function=shutil.copy))
    assert (copy / "model.safetensors").stat().st_mtime_ns != (checkpoint / "model.safetensors").stat().st_mtime_ns
    audit(checkpoint, ROLLOUTS, **STORED, out=tmp_path / "s0", block_size=8, shard=Shard(index=0, count=2))
    audit(copy, ROLLOUTS, **STORED, out=tmp_path / "s1", block_size=8, shard=Shard(index=1, count=2))
    code, err = _merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m", capsys)
    assert code == 0, err
    inputs = json.loads((tmp_path / "m" / "summary.json").read_text())["inputs"]
    weights = next(item for item in inputs["checkpoint"] if item["file"] == "model.safetensors")
    assert set(weights) == {"file", "size", "sha256"}  # no mtime, no inode: copies match


def test_an_unchanged_weight_file_is_hashed_once_and_a_corrupt_cache_is_ignored(tmp_path, monkeypatch,
                                                                                _own_cache) -> None:
    import time

    from mismatch import identity

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    time.sleep(identity.RACY_NS / 1e9 + 0.05)  # a file changed just before it was hashed is not cached
    hashed: list[str] = []
    real = identity.content_digest

    def counting(path: Path) -> str:
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(identity, "content_digest", counting)
    first = identity.checkpoint_identity(checkpoint)
    assert hashed == ["model.safetensors"]
    assert identity.checkpoint_identity(checkpoint) == first and hashed == ["model.safetensors"]  # the cache
    cache_file = _own_cache / identity.CACHE_FILE
    assert cache_file.is_file()
    cache_file.write_text("{ not json")
    assert identity.checkpoint_identity(checkpoint) == first and len(hashed) == 2  # ignored, hashed again
    json.loads(cache_file.read_text())  # and rewritten whole
    _edit_in_place_keeping_size_and_mtime(checkpoint / "model.safetensors")
    changed = identity.checkpoint_identity(checkpoint)
    assert len(hashed) == 3 and changed != first  # same size and mtime, another ctime: hashed again


# --- 2. merge verifies each shard's files -------------------------------------------------------

def test_a_shard_holding_another_shards_tokens_is_refused(tmp_path, capsys) -> None:
    s0, s1 = _shards(stored_checkpoint(tmp_path / "ckpt"), tmp_path)
    shutil.copy(s0 / "tokens.parquet", s1 / "tokens.parquet")
    code, err = _merge([s0, s1], tmp_path / "m", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{s1}/tokens.parquet: its content is not what {s1}/summary.json recorded" in err
    assert not (tmp_path / "m").exists()


def _forge_files(shard: Path) -> None:
    """The shard's summary made to vouch for whatever its files now are: digests, rows, counts."""
    import hashlib

    import pyarrow.parquet as pq

    summary = json.loads((shard / "summary.json").read_text())
    for name, entry in summary["shard"]["files"].items():
        entry["sha256"] = hashlib.sha256((shard / name).read_bytes()).hexdigest()
        try:
            entry["rows"] = pq.ParquetFile(shard / name).metadata.num_rows
        except Exception:  # a cut file: its rows as they were
            pass
    summary["counts"]["tokens"] = summary["shard"]["files"]["tokens.parquet"]["rows"]
    (shard / "summary.json").write_text(json.dumps(summary))


def test_a_copied_tokens_file_with_a_forged_summary_is_refused_by_its_blocks(tmp_path, capsys) -> None:
    s0, s1 = _shards(stored_checkpoint(tmp_path / "ckpt"), tmp_path)
    for name in ("tokens.parquet", "prefix_keys.parquet"):  # all of a shard's rows, consistently
        shutil.copy(s0 / name, s1 / name)
    _forge_files(s1)
    code, err = _merge([s0, s1], tmp_path / "m", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{s1}/tokens.parquet: holds rows of block 0, which is shard 0's of 2 (shard 1 holds blocks 1, 3, 5, ...)" \
        in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("forged", [False, True], ids=["as-published", "summary-forged"])
def test_a_truncated_shard_tokens_file_is_one_line_exit_2(tmp_path, capsys, forged) -> None:
    s0, s1 = _shards(stored_checkpoint(tmp_path / "ckpt"), tmp_path)
    data = (s1 / "tokens.parquet").read_bytes()
    (s1 / "tokens.parquet").write_bytes(data[:len(data) // 2])
    if forged:
        _forge_files(s1)
    code, err = _merge([s0, s1], tmp_path / "m", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{s1}/tokens.parquet: " in err
    assert not (tmp_path / "m").exists()


def test_a_shard_log_prob_that_breaks_the_engine_contract_is_refused(tmp_path, capsys) -> None:
    s0, s1 = _shards(stored_checkpoint(tmp_path / "ckpt"), tmp_path)
    table = pd.read_parquet(s1 / "tokens.parquet")
    row = int(np.flatnonzero(table["pos"].to_numpy() > 0)[3])
    table.loc[row, "logp_infer"] = 0.5
    from mismatch.results import write_tokens

    write_tokens(table, s1 / "tokens.parquet")
    _forge_files(s1)
    code, err = _merge([s0, s1], tmp_path / "m", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{s1}/tokens.parquet: logp_infer: log-prob 0.5 for token" in err and f"rollout {table['rollout'][row]!r}" in err
    assert not (tmp_path / "m").exists()


def test_published_files_are_recorded_with_rows_and_digest(tmp_path) -> None:
    import hashlib

    whole = audit(stored_checkpoint(tmp_path / "ckpt"), ROLLOUTS, **STORED, out=tmp_path / "o")
    files = json.loads((tmp_path / "o" / "summary.json").read_text())["shard"]["files"]
    assert files == whole.summary["shard"]["files"]
    assert files["tokens.parquet"]["rows"] == whole.summary["counts"]["tokens"]
    assert files["rollouts.parquet"]["rows"] == len(pd.read_parquet(tmp_path / "o" / "rollouts.parquet"))
    assert "prefix_keys.parquet" not in files  # published by shards only (their merge reads it)
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((tmp_path / "o" / name).read_bytes()).hexdigest(), name


# --- 3. options that change numbers must agree --------------------------------------------------

def test_shards_with_another_clip_range_do_not_merge(tmp_path, capsys) -> None:
    from mismatch.analysis.clip import ClipRange

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    audit(checkpoint, ROLLOUTS, **STORED, out=tmp_path / "s0", block_size=8, shard=Shard(index=0, count=2))
    audit(checkpoint, ROLLOUTS, **STORED, out=tmp_path / "s1", block_size=8, shard=Shard(index=1, count=2),
          clip=ClipRange(low=0.2, high=0.28))
    code, err = _merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{tmp_path / 's1'}: its clip eps_high (--clip-eps) differs (0.28, not 0.2 as in {tmp_path / 's0'})" in err


def test_diff_shards_with_another_bootstrap_seed_do_not_merge(tmp_path, capsys) -> None:
    from mismatch.pipeline.diff import diff

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    specs = {"a": "stored:trainer", "b": "stored:engine", "reference": "sampler"}
    for index, seed in ((0, 0), (1, 7)):
        diff(checkpoint, ROLLOUTS, **specs, out=tmp_path / f"s{index}", block_size=8,
             shard=Shard(index=index, count=2), seed=seed)
    code, err = _merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m", capsys)
    assert code == 2 and "its bootstrap seed differs (7, not 0 as in" in err, err


def test_merged_diff_keeps_the_shards_seed(tmp_path) -> None:
    from mismatch.pipeline.diff import diff
    from mismatch.pipeline.merge import merge

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    specs = {"a": "stored:trainer", "b": "stored:engine", "reference": "sampler"}
    whole = diff(checkpoint, ROLLOUTS, **specs, out=tmp_path / "whole", block_size=8, seed=7)
    for index in range(2):
        diff(checkpoint, ROLLOUTS, **specs, out=tmp_path / f"s{index}", block_size=8,
             shard=Shard(index=index, count=2), seed=7)
    merged = merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m")
    assert json.dumps(merged["diff"]["deltas"]) == json.dumps(whole.summary["diff"]["deltas"])


# --- 4. prefix consistency of a merged run --------------------------------------------------------

def _rollouts_with_shared_prefixes(path: Path) -> Path:
    """16 golden rollouts, then copies of the first 8 (other ids, the trainer's log-probs nudged on a
    few tokens): with blocks of 8 and 3 shards, every shared prefix spans two shards."""
    lines = ROLLOUTS.read_text().splitlines()[:16]
    copies = []
    for number, line in enumerate(lines[:8]):
        rollout = json.loads(line)
        rollout["id"] = f"copy-{number}"
        if number % 3 == 0:
            segment = next(s for s in rollout["branches"][0]["segments"] if "extra_logprobs" in s)
            segment["extra_logprobs"]["trainer"][0] = min(segment["extra_logprobs"]["trainer"][0] - 0.01, 0.0)
        copies.append(json.dumps(rollout))
    path.write_text("\n".join(lines + copies) + "\n")
    return path


def test_a_merged_summary_has_the_unsharded_runs_prefix_consistency(tmp_path) -> None:
    from mismatch.pipeline.merge import merge

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    rollouts = _rollouts_with_shared_prefixes(tmp_path / "rollouts.jsonl")
    whole = audit(checkpoint, rollouts, **STORED, out=tmp_path / "whole", block_size=8)
    found = whole.summary["prefix_consistency"]
    assert found["train"]["n_shared_tokens"] > 0 and found["train"]["worst"] is not None
    merged = merge(_shards(checkpoint, tmp_path, 3, rollouts=rollouts), tmp_path / "m")
    assert merged["prefix_consistency"] == found
    assert not any(path.name.startswith(".") for path in (tmp_path / "m").iterdir())  # no side file left


# --- 5. a full disk while publishing --------------------------------------------------------------

@pytest.mark.parametrize("where", ["staged write", "rename"])
def test_a_full_disk_while_publishing_is_exit_3_and_leaves_no_half_dir(tmp_path, capsys, monkeypatch, where) -> None:
    from mismatch.pipeline import stages
    from mismatch.results import staging

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "o"
    if where == "staged write":
        def full(directory, summary):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "summary.json"))
        monkeypatch.setattr(stages, "write_summary", full)
    else:
        real = os.replace

        def read_only(src, dst):
            if Path(dst) == out and ".o.tmp-" in Path(src).name:  # the publishing rename only
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
            return real(src, dst)
        monkeypatch.setattr(staging.os, "replace", read_only)
    code = main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), *STORED_ARGS, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "the staged results were removed; free space and rerun: the work dir resumes" in err
    assert ("No space left on device" if where == "staged write" else "Read-only file system") in err
    assert not out.exists() and not list(tmp_path.glob(".o.tmp-*")) and not list(tmp_path.glob(".o.old-*"))


def test_a_full_disk_replacing_a_results_dir_with_force_keeps_the_old_one(tmp_path, capsys, monkeypatch) -> None:
    from mismatch.results import staging

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "o"
    args = ["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), *STORED_ARGS, "--out", str(out)]
    assert main(args) == 0
    before = (out / "summary.json").read_text()
    real = os.replace

    def full(src, dst):
        if Path(dst) == out and ".o.tmp-" in Path(src).name:  # the publishing rename, not the rollback
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst)
    monkeypatch.setattr(staging.os, "replace", full)
    capsys.readouterr()
    assert main([*args, "--force"]) == 3
    assert (out / "summary.json").read_text() == before  # the previous results, back in place
    assert not list(tmp_path.glob(".o.tmp-*")) and not list(tmp_path.glob(".o.old-*"))


# --- 6. a dangling symlink as --out ---------------------------------------------------------------

def test_a_dangling_symlink_as_out_is_refused_before_any_work(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "o"
    out.symlink_to(tmp_path / "gone" / "results")
    code = main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), *STORED_ARGS, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{out}: is a symlink to {tmp_path / 'gone' / 'results'}, which does not exist" in err
    assert out.is_symlink() and not (tmp_path / ".o.work").exists() and not list(tmp_path.glob(".o.tmp-*"))


def test_a_live_symlink_as_out_is_refused_naming_its_target(tmp_path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    (tmp_path / "real").mkdir()
    out = tmp_path / "o"
    out.symlink_to("real")
    code = main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), *STORED_ARGS, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and f"{out}: is a symlink to real; give --out {tmp_path / 'real'} itself" in err, err
    assert out.is_symlink() and not any((tmp_path / "real").iterdir())


def test_shards_whose_tables_have_other_columns_do_not_merge(tmp_path, capsys) -> None:
    from mismatch.results import write_tokens

    s0, s1 = _shards(stored_checkpoint(tmp_path / "ckpt"), tmp_path)
    table = pd.read_parquet(s1 / "tokens.parquet")
    write_tokens(table.assign(logp_train_processed=-1.0), s1 / "tokens.parquet")
    _forge_files(s1)
    code, err = _merge([s0, s1], tmp_path / "m", capsys)
    assert code == 2 and f"{s1}/tokens.parquet: its columns (" in err and "shards must be one run's" in err, err
