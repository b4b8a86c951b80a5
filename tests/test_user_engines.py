"""Bring-your-own specs: `python:MODULE:CALLABLE` and `stored:NAME` inside a real audit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from mismatch.audit import audit
from mismatch.cli import main
from mismatch.engines import parse_spec
from mismatch.errors import SpecError

CUSTOM = f"python:{REPO / 'examples/custom_engine.py'}:make_engine"


def test_python_engine_from_a_file_matches_the_hf_engine(tiny_checkpoint, sampled_rollouts) -> None:
    result = audit(tiny_checkpoint, sampled_rollouts, train=CUSTOM, infer="hf:dtype=float32")
    pair = result.summary["pairs"]["train/infer"]
    assert pair["n_tokens"] > 100 and pair["log_ratio_abs_max"] < 1e-5
    assert result.summary["engines"]["train"]["module"] == "LogitsOnly(float32)"


def _with_extra(src: Path, dst: Path, name: str, shift: float) -> None:
    """Copy rollouts, storing the sampler's log-probs (minus `shift`) as extra_logprobs[name]."""
    lines = []
    for line in src.read_text().splitlines():
        raw = json.loads(line)
        for branch in raw["branches"]:
            for segment in branch["segments"]:
                if "logprobs" in segment:
                    segment["extra_logprobs"] = {name: [lp - shift for lp in segment["logprobs"]]}
        lines.append(json.dumps(raw))
    dst.write_text("\n".join(lines) + "\n")


def test_stored_logprobs_audit_without_replay(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    path = tmp_path / "with_trainer.jsonl"
    _with_extra(sampled_rollouts, path, "trainer", shift=0.25)
    result = audit(tiny_checkpoint, path, train="stored:trainer", infer="sampler")
    pairs = result.summary["pairs"]
    assert pairs["infer/sampler"]["bitwise_equal_frac"] == 1.0
    # train = sampler - 0.25 on every trainable token: log_ratio is -0.25 up to float rounding.
    np.testing.assert_allclose(pairs["train/sampler"]["log_ratio_mean"], -0.25, rtol=1e-12)
    assert result.summary["engines"]["train"] == {"kind": "stored", "spec": "stored:trainer",
                                                  "name": "trainer"}


def test_missing_stored_name_is_bad_input(tiny_checkpoint, sampled_rollouts, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code = main(["audit", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts), "--out", str(out),
                 "--train", "stored:megatron"])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err.strip() == ("mismatch: error: --train stored:megatron: no segment "
                                               "of the rollouts carries extra_logprobs['megatron'] "
                                               "(found: sampler)")


def test_python_spec_errors(tiny_checkpoint) -> None:
    from mismatch.engines import load_engine

    with pytest.raises(SpecError, match=r"^engine spec 'python:nocolon': expected python:MODULE:CALLABLE$"):
        parse_spec("python:nocolon")
    with pytest.raises(SpecError, match=r"has no attribute 'nope'"):
        load_engine(f"python:{REPO / 'examples/custom_engine.py'}:nope", str(tiny_checkpoint))
    with pytest.raises(SpecError, match=r"cannot import no_such_module_x"):
        load_engine("python:no_such_module_x:f", str(tiny_checkpoint))


def test_python_engine_from_toml_takes_checkpoint_and_options(tiny_checkpoint, sampled_rollouts,
                                                             tmp_path) -> None:
    toml = tmp_path / "mine.toml"
    toml.write_text(f'engine = "python"\ntarget = "{REPO / "examples/custom_engine.py"}:make_engine"\n'
                    f'checkpoint = "{tiny_checkpoint}"\ndtype = "bfloat16"\n')
    result = audit(tiny_checkpoint, sampled_rollouts,
                   train=str(toml), infer="hf:dtype=bfloat16")
    assert result.summary["engines"]["train"]["module"] == "LogitsOnly(bfloat16)"
    assert result.summary["pairs"]["train/infer"]["log_ratio_abs_max"] < 0.1
