"""tokens.parquet as write_tokens lays it out and read_tokens reads it back."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

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
