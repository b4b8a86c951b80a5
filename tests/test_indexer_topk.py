"""Format v1's `indexer_topk` (issue #47): the key positions a sparse-attention engine's DSA indexer
selected per token and layer, read and checked as routed_experts are, one clear line when wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mismatch.errors import MismatchError
from mismatch.replay import plan_replay
from mismatch.rollouts import load_rollouts


def _write(tmp_path: Path, selected: object, *, context: object = None) -> Path:
    rollout = {"id": "r", "branches": [{"id": "m", "segments": [
        {"role": "user", "tokens": [1, 2], **({"indexer_topk": context} if context is not None else {})},
        {"role": "assistant", "tokens": [5, 6, 7], "logprobs": [-0.1, 0.0, -0.2], "indexer_topk": selected}]}]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rollout) + "\n")
    return path


def test_indexer_topk_is_read_sorted_with_null_rows_unrecorded_and_reaches_the_request(tmp_path: Path) -> None:
    # 2 layers x top-2; token 2's query (position 2) selects 2 of keys 0..2; the last token recorded none.
    path = _write(tmp_path, [[[2, 0], [1, 2]], [[3, 1], [0, 3]], None], context=[[[0, -1], [0, -1]], None])
    rollout = load_rollouts(path, vocab_size=16)[0]
    own = rollout.branches[0].segments[1].indexer_topk
    assert own.dtype == np.int32 and own.shape == (3, 2, 2)
    assert own[0].tolist() == [[0, 2], [1, 2]] and own[2].tolist() == [[-1, -1], [-1, -1]]
    request = plan_replay([rollout]).requests[0]
    assert request.indexer_topk.shape == (5, 2, 2)  # the context's rows, then the own tokens'
    assert request.indexer_topk[0].tolist() == [[-1, 0], [-1, 0]] and request.indexer_topk[1].tolist() == [[-1, -1]] * 2
    assert request.indexer_topk[2].tolist() == [[0, 2], [1, 2]]


def test_a_file_without_indexer_topk_plans_none(tmp_path: Path) -> None:
    rollout = {"id": "r", "branches": [{"id": "m", "segments": [{"role": "user", "tokens": [1, 2]}]}]}
    (tmp_path / "r.jsonl").write_text(json.dumps(rollout) + "\n")
    assert plan_replay(load_rollouts(tmp_path / "r.jsonl")).requests[0].indexer_topk is None


@pytest.mark.parametrize(("selected", "message"), [
    ([[[0, 1]], [[1, 2]]], "indexer_topk: 2 rows for 3 tokens (one [layers][top-k] row per token"),
    ([[[0, 1]], [[1, 2, 3]], None], "indexer_topk: token 1: must be [layers][top-k] key positions (like token 0's "
                                    "1 layers x top-2)"),
    ([[[0, 1]], [[1, 1]], None], "indexer_topk: token 1 layer 0: key 1 appears twice in one top-k"),
    ([[[0, 1]], [[-1, -1]], None], "indexer_topk: token 1 layer 0: no key selected (a query selects at least itself)"),
    ([[[0, -2]], [[1, 2]], None], "indexer_topk: token 0 layer 0: key position -2 is not in [-1, 2147483647]"),
    ([[[0, 1.5]], [[1, 2]], None], "indexer_topk: token 0 layer 0: key position at index 1 is not an integer: 1.5"),
    ({"rows": []}, "indexer_topk: must be an array (one [layers][top-k] array of key positions per token), got object"),
])
def test_a_bad_indexer_topk_is_one_line_naming_file_line_rollout_and_field(tmp_path: Path, selected, message) -> None:
    with pytest.raises(MismatchError) as caught:
        load_rollouts(_write(tmp_path, selected), vocab_size=16)
    text = str(caught.value)
    assert "\n" not in text and f"{tmp_path / 'r.jsonl'}:1: rollout 'r': branches[0].segments[1]." in text
    assert message in text


def test_one_rollout_holds_one_indexer_shape(tmp_path: Path) -> None:
    path = _write(tmp_path, [[[0, 1]], [[1, 2]], None], context=[[[0, -1, -1]], None])
    with pytest.raises(MismatchError, match=r"branches\[0\]\.segments\[1\]\.indexer_topk: 1 layers x top-2 per token, "
                                            r"but branches\[0\]\.segments\[0\]\.indexer_topk has 1 layers x top-3"):
        load_rollouts(path, vocab_size=16)


def test_validate_refuses_a_bad_indexer_topk_with_exit_2(tmp_path: Path, capsys) -> None:
    from mismatch.cli import main

    assert main(["validate", str(_write(tmp_path, [[[0, 1]], [[1, 1]], None]))]) == 2
    assert "key 1 appears twice in one top-k" in capsys.readouterr().err
