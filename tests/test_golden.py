"""The analysis gives the numbers it gave before it was rewritten: a stored-log-prob audit of a
small tree-shaped fixture against the summary.json written for it before the rewrite (commit
2bd13b5, with the numba loops and hand-written Student-t of that time): tests/data/golden, made by
its make.py; expected_summary.json is that run's output, unedited.

Floats may move by reassociation only (1e-9 relative); everything else is equal, except what later
work changed on purpose: advice prose, verdict sentences and snippets (`why`, `text`,
`config_snippets`), the renamed quantiles (ratio_qXYZ), which fixes are
recommended beside the correction, keys added to an object, and corrections added to the
simulated list (each one there before must be there still, with the same numbers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import mismatch

GOLDEN = Path(__file__).parent / "data" / "golden"
# Where and when a run happened, not what it found; and the advice's prose.
RUN_FACTS = {"created_unix", "checkpoint", "rollouts_file"}
# Advice and verdict sentences (their numbers are compared as numbers), and each verdict's label: a
# pair with a stored stream on one side reads "stored, not replayed" (issue 43).
PROSE = {"why", "config_snippets", "text", "meaning"}


def _correction_key(item: dict) -> str:
    return json.dumps([item.get("mode"), item.get("params")], sort_keys=True)


def stored_checkpoint(root: Path) -> Path:
    """A stored-log-prob audit reads only the vocab size; the weights file must merely exist."""
    from safetensors.numpy import save_file

    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000}))
    save_file({"unused": np.zeros(1, dtype=np.float32)}, str(root / "model.safetensors"))
    return root


def differences(got: object, want: object, path: str = "") -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        # Keys added since (new metrics, new params) are additions, not changed numbers.
        out = [f"{path}.{k}: missing" for k in want if k not in got]
        for key in want.keys() & got.keys():
            if key not in RUN_FACTS | PROSE:
                out += differences(got[key], want[key], f"{path}.{key}")
        return out
    if path == ".recommendations" and isinstance(want, list) and isinstance(got, list):
        # Which fixes are advised changed on purpose (the advice issue: proportionate); the chosen
        # correction's numbers did not.
        chosen = [[item for item in items if item.get("kind") == "correction"] for items in (got, want)]
        return differences(chosen[0], chosen[1], f"{path}[correction]")
    if path == ".corrections" and isinstance(want, list) and isinstance(got, list):
        by_key = {_correction_key(item): item for item in got}
        return [d for item in want for d in (differences(by_key[_correction_key(item)], item,
                                                         f"{path}[{_correction_key(item)}]")
                                             if _correction_key(item) in by_key
                                             else [f"{path}: {_correction_key(item)} missing"])]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items, expected {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{i}]")]
    numbers = (int, float)
    if (isinstance(want, float) and isinstance(got, numbers) and not isinstance(got, bool)
            and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-300)):
        return []
    return [] if (got == want and type(got) is type(want)) else [f"{path}: {got!r} != {want!r}"]


# Renamed since the expected file was written (issue 15: both tails, named by quantile).
RENAMED = {"ratio_p01": "ratio_q01", "ratio_p99": "ratio_q99", "ratio_p999": "ratio_q999"}


def renamed(value: object) -> object:
    if isinstance(value, dict):
        return {RENAMED.get(k, k): renamed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [renamed(v) for v in value]
    return value


@pytest.mark.parametrize(("chunk_rows", "block_size"), [(None, 64), (97, 4)],
                         ids=["one-chunk", "chunks-of-97-rows"])
def test_stored_audit_matches_the_summary_from_before_the_rewrite(tmp_path: Path, monkeypatch, chunk_rows,
                                                                  block_size) -> None:
    """Read in one chunk, and in chunks of about 97 rows (blocks of 4 rollouts, row groups and
    chunks of a few blocks: every merge path of the chunked analysis taken)."""
    if chunk_rows is not None:
        monkeypatch.setattr("mismatch.results.chunks.DEFAULT_CHUNK_ROWS", chunk_rows)
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    result = mismatch.audit(checkpoint, GOLDEN / "rollouts.jsonl", train="stored:trainer",
                            infer="stored:engine", out=tmp_path / "out", block_size=block_size)
    if chunk_rows is not None:
        import pyarrow.parquet as pq

        assert pq.ParquetFile(tmp_path / "out" / "tokens.parquet").num_row_groups > 10
    got = json.loads((tmp_path / "out" / "summary.json").read_text())
    want = renamed(json.loads((GOLDEN / "expected_summary.json").read_text()))
    want["shard"]["block_size"] = block_size  # the run's own setting, not a measurement
    found = differences(got, want)
    assert not found, f"{len(found)} differences, first: " + "; ".join(found[:8])
    assert result.summary["counts"] == want["counts"]


def test_the_comparison_sees_a_moved_number() -> None:
    want = json.loads((GOLDEN / "expected_summary.json").read_text())
    got = json.loads(json.dumps(want))
    got["pairs"]["train/sampler"]["kl_k3"] *= 1 + 1e-8
    assert differences(got, want) == [".pairs.train/sampler.kl_k3: "
                                      f"{got['pairs']['train/sampler']['kl_k3']!r} != "
                                      f"{want['pairs']['train/sampler']['kl_k3']!r}"]
