"""`mismatch diff` on two real vLLM configs: fp32 is closer to an fp32 trainer than bf16, significantly."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from mismatch.cli import main  # noqa: E402


def test_vllm_fp32_is_closer_to_an_fp32_trainer_than_bf16(tiny_checkpoint, sampled_rollouts, tmp_path,
                                                          capsys, vllm_fp32, vllm_bf16) -> None:
    # The two vLLM configs are the session's engines' (conftest): the diff's engines share their LLMs.
    out = tmp_path / "diff"
    assert main(["diff", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts),
                 "--a", "vllm:dtype=bfloat16", "--b", "vllm:dtype=float32",
                 "--reference", "hf:dtype=float32", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    comparison = summary["diff"]
    assert comparison["closer_to_reference"] == "b"
    for name in ("kl_k3", "log_ratio_abs_mean"):
        low, high = comparison["deltas"][name]["ci95"]
        assert high < 0, f"{name}: b - a should be negative with a CI excluding 0, got [{low}, {high}]"
    assert summary["pairs"]["b/reference"]["log_ratio_abs_max"] < 1e-4 < summary["pairs"]["a/reference"]["log_ratio_abs_max"]
    assert all(v > 0 for v in comparison["throughput_tokens_per_s"].values())
    assert "closer to the reference: b" in capsys.readouterr().out
