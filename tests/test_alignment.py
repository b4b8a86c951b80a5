"""Alignment sanity on the token table: shifts, padding, placeholders, missing and processed
log-probs (synthetic tables), then the toy agent's processed T=0.7 rollouts and their
like-for-like recomputation through the tiny checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from mismatch.analysis.alignment import check_alignment, like_for_like
from mismatch.engines.processing import Sampling, processed_logprobs, processed_token_logprobs
from mismatch.errors import MismatchError
from mismatch.engines.logprobs import token_logprobs
from mismatch.analysis.metrics import summarize_pairs
from mismatch.replay import plan_replay, recompute_processed, replay_processed, replay_sources
from mismatch.rollouts import load_rollouts
from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

NUM_ROLLOUTS, PROMPT, ANSWER, VOCAB = 4, 5, 60, 40


def _logits(rng: np.random.Generator, n: int) -> np.ndarray:
    # Peaked rows, as a trained policy's: one token well ahead, a few contenders.
    logits = rng.normal(0.0, 1.0, (n, VOCAB))
    logits[np.arange(n), rng.integers(0, VOCAB, n)] += rng.uniform(2.0, 8.0, n)
    return logits


def _table(*, temperature: float = 1.0, noise: float = 1e-3, seed: int = 0) -> pd.DataFrame:
    """rollout r-k: a prompt segment, then a trainable answer sampled at `temperature`; stored =
    the sampler's log-probs (processed at that temperature), train = raw log-probs + noise."""
    rng = np.random.default_rng(seed)
    frames = []
    for k in range(NUM_ROLLOUTS):
        logits = _logits(rng, ANSWER)
        processed = torch.log_softmax(torch.tensor(logits) / temperature, -1).numpy()
        raw = torch.log_softmax(torch.tensor(logits), -1).numpy()
        tokens = np.array([rng.choice(VOCAB, p=np.exp(row)) for row in processed])
        rows = np.arange(ANSWER)
        frames.append(pd.DataFrame({
            "rollout": f"r-{k}", "branch": "main", "segment": np.r_[np.zeros(PROMPT), np.ones(ANSWER)].astype(int),
            "trainable": np.r_[np.zeros(PROMPT, bool), np.ones(ANSWER, bool)],
            "logp_sampler": np.r_[np.full(PROMPT, np.nan), processed[rows, tokens]],
            "logp_train": np.r_[rng.normal(-3, 1, PROMPT), raw[rows, tokens] + rng.normal(0, noise, ANSWER)]}))
    return pd.concat(frames, ignore_index=True)


def _rows(table: pd.DataFrame, rollout: str) -> np.ndarray:
    return np.flatnonzero((table["rollout"] == rollout).to_numpy() & table["trainable"].to_numpy())


def test_clean_raw_logprobs_raise_nothing() -> None:
    result = check_alignment(_table())
    assert result["shift"] == 0 and result["shift_by_rollout"] == {} and result["findings"] == []
    assert result["logprob_semantics"] == "raw" and result["estimated_temperature"] == 1.0
    assert result["padded_zero_frac"] == result["missing_trainable_frac"] == result["constant_frac"] == 0.0


@pytest.mark.parametrize("shift", [-1, 1])
def test_a_shifted_rollout_is_flagged_with_its_shift(shift: int) -> None:
    table = _table()
    rows = _rows(table, "r-2")
    # stored[i] holds the log-prob of token i + shift (the end keeps its own value).
    table.loc[rows, "logp_sampler"] = np.roll(table.loc[rows, "logp_sampler"].to_numpy(), -shift)
    result = check_alignment(table)
    assert result["shift_by_rollout"] == {"r-2": shift}
    assert result["shift"] == 0  # three rollouts of four are fine
    [finding] = result["findings"]
    assert finding["kind"] == "shift" and finding["rollout"] == "r-2" and f"by {shift:+d}" in finding["message"]
    everywhere = _table()
    for rollout in everywhere["rollout"].unique():
        rows = _rows(everywhere, rollout)
        everywhere.loc[rows, "logp_sampler"] = np.roll(everywhere.loc[rows, "logp_sampler"].to_numpy(), -shift)
    assert check_alignment(everywhere)["shift"] == shift


def test_padded_zeros_constants_and_missing_logprobs_are_counted() -> None:
    table = _table()
    trainable = int(table["trainable"].sum())
    unsure = np.flatnonzero(table["trainable"].to_numpy() & (table["logp_train"].to_numpy() < math.log(0.9)))
    table.loc[unsure[:5], "logp_sampler"] = 0.0
    rows = _rows(table, "r-1")
    table.loc[rows[10:16], "logp_sampler"] = -20.0  # a clipped placeholder over varied tokens
    table.loc[_rows(table, "r-3")[:3], "logp_sampler"] = np.nan
    result = check_alignment(table)
    assert result["padded_zero_frac"] == 5 / trainable
    assert result["constant_frac"] == 6 / trainable
    assert result["missing_trainable_frac"] == 3 / trainable
    kinds = {f["kind"]: f for f in result["findings"]}
    assert set(kinds) == {"padded_zero", "constant_logprobs", "missing_logprobs"}
    assert kinds["missing_logprobs"]["rollout"] == "r-3" and "-20.0" in kinds["constant_logprobs"]["message"]


def test_temperature_processed_logprobs_are_detected_with_their_temperature() -> None:
    meta = {"engine": "vllm", "temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": "processed"}
    result = check_alignment(_table(temperature=0.7), sampler_meta=meta)
    assert result["logprob_semantics"] == "processed"
    assert 0.55 <= result["estimated_temperature"] <= 0.8
    assert result["semantics"]["frac_likely_raised"] > 0.95
    [finding] = result["findings"]
    assert finding["kind"] == "processed_logprobs" and "temperature=0.7" in finding["fix"]
    hot = check_alignment(_table(temperature=1.5))
    assert hot["logprob_semantics"] == "processed" and hot["estimated_temperature"] > 1.2


def test_raw_logprobs_declared_processed_are_called_out() -> None:
    result = check_alignment(_table(), sampler_meta={"temperature": 0.7, "logprobs": "processed"})
    assert result["logprob_semantics"] == "raw"
    assert [f["kind"] for f in result["findings"]] == ["semantics_mismatch"]


def test_a_table_without_the_columns_is_bad_input() -> None:
    with pytest.raises(MismatchError, match="alignment: token table has no column 'logp_infer'"):
        check_alignment(_table(), replayed="infer")


def test_processing_matches_the_sampler_definitions() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(processed_logprobs(logits, Sampling()), torch.log_softmax(logits, -1))
    assert torch.equal(processed_logprobs(logits, Sampling(temperature=0.5)), torch.log_softmax(logits / 0.5, -1))
    top2 = processed_logprobs(logits, Sampling(top_k=2))
    assert (torch.isfinite(top2).sum(-1) == 2).all() and torch.allclose(top2.exp().sum(-1), torch.ones(6))
    probs = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert processed_logprobs(probs, Sampling(top_p=0.5)).exp().tolist() == [[1.0, 0.0, 0.0]]
    kept = processed_logprobs(probs, Sampling(top_p=0.6)).exp()[0]
    assert torch.allclose(kept, torch.tensor([0.625, 0.375, 0.0]))
    assert Sampling.from_meta({"temperature": 0.7, "top_k": -1, "top_p": 1.0}) == Sampling(temperature=0.7)


def test_processed_token_logprobs_is_the_raw_path_at_identity() -> None:
    generator = torch.Generator().manual_seed(1)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(50, 16, generator=generator))
    hidden, target = torch.randn(9, 16, generator=generator), torch.randint(0, 50, (9,), generator=generator)
    with torch.no_grad():
        raw = token_logprobs(hidden, target, lm_head, chunk=4)
        assert torch.equal(processed_token_logprobs(hidden, target, lm_head, sampling=Sampling(), chunk=4), raw)
        # One chunk for all rows, like the reference: a matmul's bits may depend on its row count.
        hot = processed_token_logprobs(hidden, target, lm_head, sampling=Sampling(temperature=2.0), chunk=16)
        expected = torch.log_softmax(lm_head(hidden) / 2.0, -1).gather(1, target[:, None])[:, 0]
    assert torch.equal(hot, expected.double())


# --- the toy agent at temperature 0.7, one rollout with shifted log-probs --------------------

@pytest.fixture(scope="module")
def processed_run(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("alignment") / "rollouts.jsonl"
    write_rollouts(tiny_checkpoint, path, HarnessConfig(num_rollouts=3, max_turns=2, temperature=0.7,
                                                        faults=("shift_logprobs",)))
    return path, replay_sources(tiny_checkpoint, path, {"train": "hf", "infer": "hf-decode:dtype=bfloat16"})


def test_processed_rollouts_and_the_shifted_one_are_flagged(processed_run) -> None:
    _, replayed = processed_run
    meta = replayed.engines["sampler"]["meta"]
    assert meta["logprobs"] == "processed" and meta["temperature"] == 0.7
    result = check_alignment(replayed.table, replayed="train", sampler_meta=meta)
    assert result["shift_by_rollout"] == {"r-2": 1}  # the harness fault hits the last rollout
    assert result["logprob_semantics"] == "processed" and 0.55 <= result["estimated_temperature"] <= 0.8
    assert {f["kind"] for f in result["findings"]} == {"shift", "processed_logprobs"}


def test_recomputing_the_trainer_at_the_sampler_temperature_closes_the_gap(tiny_checkpoint, processed_run) -> None:
    path, replayed = processed_run
    recomputed = recompute_processed(tiny_checkpoint, path, spec="hf")  # T from meta.sampler
    table, _ = like_for_like(replayed.table, recomputed)
    aligned = table[table["rollout"] != "r-2"]  # the shifted rollout's ratios mean nothing
    pairs = summarize_pairs(aligned, [("train", "sampler"), ("train_processed", "sampler"), ("train", "infer")])
    raw_gap = pairs["train/sampler"]["log_ratio_abs_mean"]
    like_gap = pairs["train_processed/sampler"]["log_ratio_abs_mean"]
    engine_gap = pairs["train/infer"]["log_ratio_abs_mean"]  # fp32 full forward vs bf16 decode, raw
    assert like_gap < raw_gap / 5  # semantics were most of the apparent gap
    assert engine_gap / 2 < like_gap < engine_gap * 2  # what is left is the engines' own gap
    # The sampler's own path, recomputed at its temperature, reproduces its stored numbers exactly.
    rollouts = [r for r in load_rollouts(path) if r.id == "r-0"]
    plan = plan_replay(rollouts)
    decode = replay_processed(plan, "hf-decode:dtype=bfloat16", tiny_checkpoint, Sampling(temperature=0.7))
    stored = plan.table["logp_sampler"].to_numpy()
    generated = plan.table["trainable"].to_numpy()
    np.testing.assert_array_equal(decode[generated], stored[generated])
