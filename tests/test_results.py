"""tokens.parquet as write_tokens lays it out and read_tokens reads it back."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from mismatch.results import TOKENS_FILE, read_tokens, write_tokens


def tokens() -> pd.DataFrame:
    return pd.DataFrame({
        "rollout": pd.Categorical(["r-0", "r-0", "r-1", "r-1"]),
        "turn": np.array([0, 1, 0, 0], dtype=np.int32),
        "trainable": [False, True, True, False],
        "logp_sampler": [np.nan, -0.5, -np.inf, np.nan],
        "logp_train": np.array([np.nan, -0.25, -3.0, -1.0], dtype=np.float32),
        "note": ["a", None, "c", "d"],
    })


def test_round_trip_keeps_values_dtypes_and_nan(tmp_path):
    frame = tokens()
    write_tokens(frame, tmp_path / TOKENS_FILE)
    pd.testing.assert_frame_equal(read_tokens(tmp_path), frame)
    pd.testing.assert_frame_equal(read_tokens(tmp_path, columns=["turn", "logp_sampler"]),
                                  frame[["turn", "logp_sampler"]])
    # Any Parquet reader gets the same table (pandas' own reader included).
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / TOKENS_FILE), frame)


def test_layout_is_one_row_group_with_nan_not_null(tmp_path):
    write_tokens(tokens(), tmp_path / TOKENS_FILE)
    file = pq.ParquetFile(tmp_path / TOKENS_FILE)
    assert file.metadata.num_row_groups == 1
    table = file.read()
    assert table.column("logp_sampler").null_count == 0  # NaN stays NaN (the contract), not null
    assert np.isnan(table.column("logp_sampler").to_numpy()).sum() == 2
    assert table.column("note").null_count == 1           # non-float columns keep their nulls


def test_empty_table(tmp_path):
    frame = tokens().iloc[:0]
    write_tokens(frame, tmp_path / TOKENS_FILE)
    assert len(read_tokens(tmp_path)) == 0


def test_the_shipped_schema_describes_what_an_audit_and_a_merge_write(tmp_path):
    from mismatch.pipeline.audit import audit
    from mismatch.pipeline.merge import merge
    from mismatch.analysis.metrics import PAIR_METRICS
    from mismatch.replay import Shard
    from mismatch.results import summary_schema, validate_summary
    from test_golden import GOLDEN, stored_checkpoint

    schema = summary_schema()
    assert schema["$defs"]["PairMetrics"]["required"] == list(PAIR_METRICS)  # one list of metric names
    checkpoint, rollouts = stored_checkpoint(tmp_path / "ckpt"), GOLDEN / "rollouts.jsonl"
    stored = {"train": "stored:trainer", "infer": "stored:engine"}
    whole = audit(checkpoint, rollouts, **stored, out=tmp_path / "whole", block_size=16)
    assert validate_summary(whole.summary) == validate_summary(
        json.loads((tmp_path / "whole" / "summary.json").read_text())) == []
    for index in range(2):
        audit(checkpoint, rollouts, **stored, out=tmp_path / f"s{index}", block_size=16, shard=Shard(index=index, count=2))
    assert validate_summary(merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m")) == []
    broken = json.loads((tmp_path / "whole" / "summary.json").read_text())
    del broken["pairs"]["train/sampler"]["kl_k3"]
    broken["counts"]["tokens"] = -1
    assert validate_summary(broken) == ["counts/tokens: -1 is less than the minimum of 0",
                                        "pairs/train/sampler: 'kl_k3' is a required property"]


def test_the_shipped_schema_is_the_one_the_model_generates():
    """mismatch/data/summary.schema.json is generated from results/summary_model.py: a change to the
    model without regenerating it (python -m mismatch.results.summary_model) fails here."""
    from mismatch.results import SCHEMA_FILE
    from mismatch.results.summary_model import schema_text

    assert SCHEMA_FILE.read_text() == schema_text(), "regenerate: python -m mismatch.results.summary_model"


def test_a_summary_of_the_wrong_shape_is_one_line_naming_the_field(tmp_path):
    """read_summary decodes through the model: a field of the wrong type is refused with its path."""
    from mismatch.errors import ResultsError
    from mismatch.results import read_summary
    from mismatch.results.summary_model import Summary
    from test_golden import GOLDEN, renamed

    want = renamed(json.loads((GOLDEN / "expected_summary.json").read_text()))
    (tmp_path / "summary.json").write_text(json.dumps(want))
    assert isinstance(read_summary(tmp_path), Summary)
    want["pairs"]["train/sampler"]["kl_k3"] = "small"
    (tmp_path / "summary.json").write_text(json.dumps(want))
    with pytest.raises(ResultsError, match=r"pairs/train/sampler/kl_k3: 'small' is not valid under any of the given schemas"):
        read_summary(tmp_path)


def test_importing_the_results_contract_loads_no_model_code():
    import subprocess
    import sys

    code = "import json, sys, mismatch.results; print(json.dumps(sorted(sys.modules)))"
    modules = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                        check=True).stdout)
    assert not [m for m in modules if m.split(".")[0] in ("torch", "transformers", "vllm", "pandas", "pyarrow")]
    loaded = [m for m in modules if m.startswith("mismatch")]
    assert [m for m in loaded if not m.startswith("mismatch.results.")] == ["mismatch", "mismatch.errors", "mismatch.results", "mismatch.version"]
    assert "mismatch.results.tokens" in loaded  # the package's own modules, and nothing above it


def test_a_row_group_of_blocks_keeps_the_rollout_column_a_dictionary(tmp_path) -> None:
    """Blocks bring their own categories; TokensWriter unifies them before a row group is written,
    or Parquet's writer falls back to plain strings for the rest of the column (there: 271 kB for
    these 20,000 rows; one dictionary: ~4 kB) and every reading re-encodes them."""
    from mismatch.results import TokensWriter, tokens_chunks

    def block(first: int) -> pd.DataFrame:
        ids = np.repeat([f"rollout-{i:06d}" for i in range(first, first + 50)], 100)
        return pd.DataFrame({"rollout": pd.Categorical(ids), "x": np.arange(len(ids), dtype=np.float64)})

    file = tmp_path / TOKENS_FILE
    writer = TokensWriter(file, group_rows=1 << 20)
    blocks = [block(50 * k) for k in range(4)]
    for one in blocks:
        writer.write(one)
    writer.close()
    meta = pq.ParquetFile(file).metadata
    assert meta.num_row_groups == 1
    assert meta.row_group(0).column(0).total_uncompressed_size < 20_000  # under a byte a row
    (chunk,) = tokens_chunks([file])()
    assert chunk["rollout"].astype(str).tolist() == pd.concat(blocks)["rollout"].astype(str).tolist()
    assert list(chunk["rollout"].cat.categories) == sorted(chunk["rollout"].cat.categories)


def test_json_safe_turns_every_non_finite_number_into_null() -> None:
    from mismatch.results import json_safe

    value = {"a": [1.0, float("nan"), 2, True, None, "x", float("inf"), np.float64("-inf"), np.int64(3),
                   (4.5, float("nan")), [np.float32(0.5), {"k": -float("inf")}]], 7: np.nan}
    assert json_safe(value) == {"a": [1.0, None, 2, True, None, "x", None, None, 3, [4.5, None], [0.5, {"k": None}]],
                                "7": None}
    assert json.dumps(json_safe(value), allow_nan=False)


def test_a_digest_begun_ahead_is_the_files_and_a_file_changed_since_is_hashed_again(tmp_path):
    import hashlib

    from mismatch.results.staging import _AHEAD, digest_ahead, file_sha256

    file = tmp_path / "rollouts.jsonl"
    file.write_bytes(b"x" * 3_000_000)
    digest_ahead(file)
    assert file_sha256(file) == hashlib.sha256(b"x" * 3_000_000).hexdigest()
    assert str(file) not in _AHEAD  # taken once (other tests' commands may have left theirs)
    digest_ahead(file)
    _AHEAD[str(file)][1].result()  # hashed before the change: its stamp no longer matches
    file.write_bytes(b"y" * 10)
    assert file_sha256(file) == hashlib.sha256(b"y" * 10).hexdigest()
    digest_ahead(tmp_path / "missing.jsonl")  # nothing begun: the command's checks word it
    assert str(tmp_path / "missing.jsonl") not in _AHEAD


def test_a_pinned_file_whose_stamp_held_since_its_digest_is_not_hashed_again(tmp_path, monkeypatch):
    """Pinned.check trusts a whole-file digest this process took while the file's stamp (size,
    mtime, ctime, inode) has held since; a rewrite of the same size moves the ctime and is hashed,
    and so is a file changed too recently for its stamp to vouch for it (staging.RACY_NS)."""
    from mismatch.errors import RolloutError
    from mismatch.results import staging
    from mismatch.rollouts import pinned as pinning

    hashed = []
    real = pinning.prefix_digest
    monkeypatch.setattr(pinning, "prefix_digest", lambda path, size: hashed.append(size) or real(path, size))
    file = tmp_path / "rollouts.jsonl"
    file.write_bytes(b"x" * 1000)
    # Just written: too fresh to vouch for (its ctime is within RACY_NS of the hashing).
    pin = pinning.Pinned(size=1000, digest=staging.file_sha256(file))
    pin.check(file)
    assert hashed == [1000]
    monkeypatch.setattr(staging, "RACY_NS", -10**18)  # every stamp old enough: as after a second
    pin = pinning.Pinned(size=1000, digest=staging.file_sha256(file))
    pin.check(file)
    assert hashed == [1000]  # not hashed again
    file.write_bytes(b"y" * 1000)  # rewritten, the same size: the stamp moves
    with pytest.raises(RolloutError, match="changed during the run"):
        pin.check(file)
    assert hashed == [1000, 1000]
    staging.digest_ahead(file)  # a digest begun ahead is remembered as one taken in place
    assert not staging.unchanged_since_digest(file, pin.digest)
    pin = pinning.Pinned(size=1000, digest=staging.file_sha256(file))
    with file.open("ab") as handle:  # appended: the pinned bytes are still there, checked by hashing them
        handle.write(b"z" * 10)
    pin.check(file)
    assert hashed == [1000, 1000, 1000]
