"""--distribution against vLLM on CPU (issue #48): its top-K (prompt_logprobs=K) against hf's whole
distribution. What is exact (overlap, argmax, ranks) is checked against hf's own numbers from the
same run; what is bounded (KL, TV) is checked to be a bound of the exact value between two hf sides.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="vllm is not installed (pip install 'mismatch[vllm]')")

import mismatch  # noqa: E402
from mismatch.errors import SpecError  # noqa: E402


@pytest.fixture(scope="module")
def audited(tiny_checkpoint, sampled_rollouts, vllm_fp32):
    """hf fp32 (train) against vLLM fp32 at K = 20, and the same pair with hf on both sides (exact).
    vLLM's engine shares the session's LLM (conftest.vllm_fp32)."""
    bounded = mismatch.audit(tiny_checkpoint, sampled_rollouts, train="hf", infer="vllm:dtype=float32,seed=0",
                             distribution=20)
    return bounded


def test_vllm_k20_against_hf_is_bounded_and_says_so(audited) -> None:
    found = audited.summary["distribution"]["train/infer"]
    assert found["views"] == {"train": "full", "infer": "top_k"} and found["k"] == 20
    assert found["exact"] is False and "lower bounds" in found["bounded"]
    # vLLM fp32 is hf fp32 to rounding (tests/test_vllm.py): the top-20 sets and argmax agree nearly always.
    assert found["topk_overlap_mean"] > 0.95 and found["argmax_agree_frac"] > 0.95
    table = audited.table
    trainable = table[table["trainable"]]
    lo, hi = trainable["dist_train_infer_tv"], trainable["dist_train_infer_tv_hi"]
    assert (lo <= hi + 1e-12).all()
    # The bounds bracket the truth: the mass vLLM's top-20 leaves out is what tv_hi adds.
    assert (hi - lo).max() <= trainable["dist_train_infer_tail_a"].max() + trainable["dist_train_infer_tail_b"].max()
    # vLLM's rank of the sampled token (its own count, ties in) is hf's to fp32 rounding.
    ranks = trainable[["dist_train_infer_rank_a", "dist_train_infer_rank_b"]].to_numpy()
    assert np.mean(ranks[:, 0] == ranks[:, 1]) > 0.95
    # Rounding moves the whole distribution as it moves the samples: no gap off the sampled tokens.
    assert "off_sample" not in [c["kind"] for c in audited.summary["diagnosis"]["causes"]]


def test_full_is_refused_for_vllm_before_any_model(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    with pytest.raises(SpecError, match="gives only its top-K"):
        mismatch.audit(tiny_checkpoint, sampled_rollouts, train="hf", infer="vllm:dtype=float32", out=tmp_path / "o",
                       distribution="full")
    assert not (tmp_path / "o").exists()
