"""Verdict levels follow their stated thresholds."""

from __future__ import annotations

import numpy as np

from mismatch.analysis.metrics import pair_metrics
from mismatch.advise.verdicts import verdict
from mismatch.results.summary_model import PairMetrics, from_builtins


def _metrics(log_ratio: np.ndarray) -> PairMetrics:
    logp_b = np.full(len(log_ratio), -1.0)
    keys = np.zeros(len(log_ratio), dtype=int)
    return from_builtins(pair_metrics(logp_b + log_ratio, logp_b, seq=keys, rollout=keys), PairMetrics)


def test_levels() -> None:
    n = 10_000
    assert verdict("train/infer", _metrics(np.zeros(n))).level == "exact"
    assert verdict("train/infer", _metrics(np.full(n, 1e-4))).level == "negligible"
    assert verdict("train/infer", _metrics(np.full(n, 1e-2))).level == "small"
    assert verdict("train/infer", _metrics(np.full(n, 0.1))).level == "large"  # kl_k3 ~ 5e-3
    tail = np.zeros(n)
    tail[:20] = 1.0  # 0.2% of tokens with ratio e > 2: small kl, heavy tail
    assert verdict("train/sampler", _metrics(tail)).level == "large"
    empty = from_builtins(pair_metrics(np.array([]), np.array([]), seq=np.array([]), rollout=np.array([])), PairMetrics)
    assert verdict("infer/sampler", empty).level == "unknown"


def test_text_names_the_meaning_and_numbers() -> None:
    got = verdict("infer/sampler", _metrics(np.full(100, 0.1)))
    assert got.meaning == "replay fidelity"
    assert got.text.startswith("the stored log-probs were not produced by this checkpoint")
    assert "kl_k3 0.00517" in got.text
    assert verdict("a/reference", _metrics(np.zeros(5))).text == "identical log-probs"


def test_the_sentence_guesses_no_cause_and_ends_with_the_diagnosed_one() -> None:
    small = _metrics(np.full(10_000, 1e-2))
    assert verdict("train/infer", small).text.startswith("trainer and engine differ slightly (kl_k3")
    cause = "the weights of train and infer differ in model.layers.1.self_attn.o_proj"
    assert verdict("train/infer", small, cause).text.endswith(f"; cause: {cause}")
    # Under the thresholds yet diagnosed (a stale layer barely moving the output): not "rounding".
    stale = verdict("train/infer", _metrics(np.full(10_000, 1e-4)), cause)
    assert stale.level == "negligible" and "rounding" not in stale.text and stale.text.endswith(cause)
    assert verdict("train/infer", _metrics(np.zeros(5)), cause).text == "trainer and engine compute identical log-probs"
