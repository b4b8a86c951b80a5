"""summary.json's analysis sections are records of the model (results/section_records.py): a summary
a run writes decodes into them and encodes back key for key, a key written only sometimes stays out
when it was out, null stays null, and readers get attributes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mismatch
from mismatch.results.section_records import Alignment, Localization, TurnLocalization
from mismatch.results.summary_model import encode, from_builtins, partial_summary, to_builtins
from test_golden import GOLDEN, stored_checkpoint


# The sections the stages hand to the summary as their producers' plain data (pipeline/summary.py);
# `shard` gets its published files' digests at publish, after.
SECTIONS = ("alignment", "localization", "drift", "prefix_consistency", "strata", "inputs", "trees", "clip",
            "framework_metrics", "framework_settings", "routing", "distribution", "diff", "weights", "probes")


def _null_for_nan(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _null_for_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_null_for_nan(v) for v in value]
    return value


def test_every_key_a_stage_writes_reaches_summary_json_and_reads_back(tmp_path: Path, monkeypatch) -> None:
    """What each producer (alignment, the turn localizer, prefix consistency, strata, ...) handed
    the summary, key for key and value for value, is what summary.json holds; the file decodes into
    the records and encodes back the same."""
    from mismatch.pipeline import summary as building

    handed: dict[str, object] = {}
    original = building.with_parts

    def recording(summary, parts):
        handed.update({name: _null_for_nan(to_builtins(value)) for name, value in parts.items() if name in SECTIONS})
        return original(summary, parts)

    monkeypatch.setattr(building, "with_parts", recording)
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    mismatch.audit(checkpoint, GOLDEN / "rollouts.jsonl", train="stored:trainer", infer="stored:engine",
                   out=tmp_path / "out")
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {"alignment", "localization", "prefix_consistency", "strata", "inputs"} <= set(handed)
    for name, raw in handed.items():
        assert written[name] == raw, name
    summary = from_builtins(written)
    assert json.loads(encode(summary)) == written
    # the sections are records, read by attribute
    assert isinstance(summary.localization, Localization) and isinstance(summary.localization.turns, TurnLocalization)
    assert summary.localization.turns.pair == written["localization"]["turns"]["pair"]
    assert summary.onset_turn == written["localization"]["turns"]["onset_turn"]
    assert isinstance(summary.alignment, Alignment)
    assert summary.semantics == written["alignment"]["logprob_semantics"]
    assert summary.counts.trainable_tokens == written["counts"]["trainable_tokens"]
    assert set(summary.prefix_findings()) == set(written["prefix_consistency"])


def test_a_key_written_sometimes_stays_out_and_null_stays_null() -> None:
    """`{}` (nothing stored to check) stays `{}`; a turn localizer without an onset keeps its null;
    a section absent stays absent; an unknown key is ignored on reading."""
    data = {"schema": "mismatch.summary/v1", "command": "audit", "pairs": {},
            "alignment": {}, "localization": {"turns": {"pair": "train/sampler", "onset_turn": None, "onset": None}},
            "drift": {"num_rollouts_checked": 2, "spans": [], "a_later_key": 1}}
    again = json.loads(encode(partial_summary(data)))
    assert again["alignment"] == {} and "routing" not in again and "diff" not in again
    assert again["localization"] == {"turns": {"pair": "train/sampler", "onset_turn": None, "onset": None}}
    assert again["drift"] == {"num_rollouts_checked": 2, "spans": []}
    summary = partial_summary(data)
    assert summary.onset_turn is None and summary.semantics is None and summary.drift.spans == []
