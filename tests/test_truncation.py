"""Truncated sampling (issue #46): the kept set as format v1 data, the semantics step telling it
from a temperature, its parameter estimated on the trainer's own distributions, `sampling=replay`
renormalizing over the kept set, and the cause leading the diagnosis: on replies sampled for real
from the tiny checkpoint with top-p, top-k and min-p (hf-decode, fp32)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mismatch.analysis.truncation import TruncationEvidence
from mismatch.engines.processing import kept_mask, processed_logprobs
from mismatch.errors import MismatchError
from mismatch.rollouts import load_rollouts
from mismatch.streams import Sampling

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The stated tolerances of the estimate: a top-p or min-p within one grid step (0.01) of the one
# sampled with, a top-k exact.
TOLERANCE = {"top_p": 0.011, "min_p": 0.011, "top_k": 0}
CASES = {"top_p": 0.8, "top_k": 5, "min_p": 0.1}


# --- the kept set, as vLLM computes it -------------------------------------------------------

def test_kept_mask_follows_vllms_rules_for_min_p_top_k_and_top_p() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.06, 0.04]])
    logits = probs.log()
    kept = lambda **kw: kept_mask(logits, Sampling(**kw))[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(top_p=0.7) == [0, 1]            # 0.5 < 0.7 <= 0.75: the head reaching p
    assert kept(top_p=0.76) == [0, 1, 2]
    assert kept(top_k=3) == [0, 1, 2]
    assert kept(min_p=0.4) == [0, 1]            # p >= 0.2
    assert kept(min_p=0.1) == [0, 1, 2, 3]      # 0.06 >= 0.05, 0.04 < 0.05
    # top-p on what top-k kept, renormalized (vLLM's apply_top_k_top_p): 0.5/0.9 < 0.6 <= 0.75/0.9
    assert kept(top_k=3, top_p=0.6) == [0, 1]
    processed = processed_logprobs(logits, Sampling(top_k=2))[0]
    assert torch.isinf(processed[2:]).all() and math.isclose(float(processed[:2].exp().sum()), 1.0, rel_tol=1e-6)


def test_kept_token_logprobs_renormalize_over_recorded_then_declared_sets_and_say_which() -> None:
    from mismatch.engines.processing import SUPPORT_SOURCES, kept_token_logprobs
    from mismatch.streams import KeptSets

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(8, 32, bias=False)
    hidden = torch.randn(4, 8)
    targets = torch.tensor([3, 5, 7, 9])
    logp_raw = torch.log_softmax(lm_head(hidden).float(), dim=-1)
    # Row 0 recorded {3, 4}; rows 1-3 recorded none. Row 3 is a prompt token: never truncated.
    kept = KeptSets(offsets=np.array([0, 2, 2, 2, 2]), ids=np.array([3, 4], dtype=np.int32))
    truncation = Sampling(top_k=4)
    logp, source = kept_token_logprobs(hidden, targets, lm_head, kept=kept, truncation=truncation,
                                       sampled=np.array([True, True, True, False]))
    assert [SUPPORT_SOURCES[i] for i in source] == ["recorded", "declared", "declared", "full"]
    assert logp[0].item() == pytest.approx((logp_raw[0, 3] - torch.logsumexp(logp_raw[0, [3, 4]], 0)).item(), abs=1e-6)
    top4 = kept_mask(lm_head(hidden).float(), truncation)
    for row in (1, 2):  # the declared top-k on this replay's logits, the target kept even outside it
        keep = top4[row].clone()
        keep[targets[row]] = True
        expected = logp_raw[row, targets[row]] - torch.logsumexp(logp_raw[row][keep], 0)
        assert logp[row].item() == pytest.approx(expected.item(), abs=1e-6)
    assert logp[3].item() == pytest.approx(logp_raw[3, 9].item(), abs=1e-6)


# --- format v1: sampling_mask ----------------------------------------------------------------

def _write(tmp_path: Path, mask: object, meta: dict | None = None) -> Path:
    rollout = {"id": "r", "meta": meta or {}, "branches": [{"id": "m", "segments": [
        {"role": "user", "tokens": [1, 2]},
        {"role": "assistant", "tokens": [5, 6, 7], "logprobs": [-0.1, 0.0, -0.2], "sampling_mask": mask}]}]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rollout) + "\n")
    return path


def test_sampling_mask_is_read_as_csr_with_empty_rows_unrecorded(tmp_path: Path) -> None:
    path = _write(tmp_path, {"offsets": [0, 2, 2, 5], "token_ids": [5, 9, 1, 7, 8]})
    kept = load_rollouts(path, vocab_size=16)[0].branches[0].segments[1].sampling_mask
    assert kept.offsets.tolist() == [0, 2, 2, 5] and kept.ids.tolist() == [5, 9, 1, 7, 8]
    assert kept.recorded.tolist() == [True, False, True]


@pytest.mark.parametrize(("mask", "message"), [
    ({"offsets": [0, 2, 2], "token_ids": [5, 9]},
     "sampling_mask.offsets: 3 offsets for 3 tokens (one more than the tokens"),
    ({"offsets": [0, 2, 2, 5], "token_ids": [5, 9, 1, 3, 8]},
     "sampling_mask: token 2: its kept set does not hold the token sampled there (7)"),
    ({"offsets": [0, 2, 2, 5], "token_ids": [5, 9, 1, 7, 99]},
     "sampling_mask.token_ids: token id 99 at index 4 is out of range (0 <= id < 16)"),
    ({"offsets": [0, 3, 2, 5], "token_ids": [5, 9, 1, 7, 8]},
     "sampling_mask.offsets: must start at 0, never decrease and end at len(token_ids) = 5"),
    ([[5], [6], [7]], "sampling_mask: must be an object {\"offsets\": [...], \"token_ids\": [...]}"),
])
def test_a_bad_sampling_mask_is_one_line_naming_file_line_rollout_and_field(tmp_path: Path, mask, message) -> None:
    with pytest.raises(MismatchError) as caught:
        load_rollouts(_write(tmp_path, mask), vocab_size=16)
    text = str(caught.value)
    assert "\n" not in text and f"{tmp_path / 'r.jsonl'}:1: rollout 'r': branches[0].segments[1]." in text
    assert message in text


def test_meta_sampler_processing_keys_are_checked(tmp_path: Path) -> None:
    with pytest.raises(MismatchError, match=r"meta\.sampler\.top_p: must be a number in \(0, 1\], got \"0\.8\""):
        load_rollouts(_write(tmp_path, None, {"sampler": {"top_p": "0.8"}}), vocab_size=16)


# --- truncation told from temperature on real distributions ----------------------------------

def _sampled(rng: np.random.Generator, sampling: Sampling, n: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """(stored processed, replayed raw) log-probs of tokens drawn under `sampling` from peaky random
    distributions over 256 tokens."""
    logits = torch.from_numpy(rng.normal(0, 3.0, (n, 256))).float()
    processed = processed_logprobs(logits, sampling)
    raw = torch.log_softmax(logits, dim=-1)
    tokens = torch.multinomial(processed.exp(), 1, generator=torch.Generator().manual_seed(0))[:, 0]
    rows = torch.arange(n)
    return processed[rows, tokens].double().numpy(), raw[rows, tokens].double().numpy()


@pytest.mark.parametrize(("sampling", "truncated"), [
    (Sampling(top_p=0.8), True), (Sampling(top_k=5), True), (Sampling(min_p=0.1), True),
    (Sampling(temperature=0.7), False), (Sampling(temperature=1.3), False), (Sampling(), False),
])
def test_truncation_is_told_from_temperature(sampling: Sampling, truncated: bool) -> None:
    evidence = TruncationEvidence()
    stored, replayed = _sampled(np.random.default_rng(0), sampling)
    evidence.add(stored, replayed)
    result = evidence.result()
    assert result["truncated"] is truncated, result
    if truncated:  # the ratio's mean is the kept mass: exp(replayed - stored), <= 1
        assert result["kept_mass_mean"] == pytest.approx(np.mean(np.exp(replayed - stored)), rel=1e-9)


# --- the tiny checkpoint, sampled for real ---------------------------------------------------

def _strip_declaration(path: Path, out: Path) -> Path:
    """The same replies with meta.sampler silent about truncation and no sampling mask."""
    lines = []
    for line in path.read_text().splitlines():
        rollout = json.loads(line)
        for key in ("top_p", "top_k", "min_p", "logprobs"):
            rollout["meta"]["sampler"].pop(key)
        for branch in rollout["branches"]:
            for segment in branch["segments"]:
                segment.pop("sampling_mask", None)
        lines.append(json.dumps(rollout))
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def truncated_rollouts(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 hf-decode replies sampled with each truncation, storing processed log-probs and masks."""
    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

    root = tmp_path_factory.mktemp("truncated")
    out = {}
    for kind, value in CASES.items():
        path = root / f"{kind}.jsonl"
        write_rollouts(tiny_checkpoint, path, HarnessConfig(num_rollouts=2, dtype="float32", sampling_mask=True,
                                                            max_turns=2, **{kind: value}))
        out[kind] = path
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CASES))
def test_an_undeclared_truncation_is_estimated_with_its_parameter(tiny_checkpoint, truncated_rollouts, tmp_path,
                                                                   kind) -> None:
    from mismatch.replay.plan import plan_replay
    from mismatch.replay.truncation import estimate_truncation, support_profiles

    path = _strip_declaration(truncated_rollouts[kind], tmp_path / "undeclared.jsonl")
    plan = plan_replay(load_rollouts(path, vocab_size=1024))
    estimate = estimate_truncation(support_profiles(plan, plan.stored["sampler"], "hf:dtype=float32", tiny_checkpoint))
    assert estimate["kind"] == kind, estimate
    assert abs(estimate["value"] - CASES[kind]) <= TOLERANCE[kind], estimate
    assert estimate["confidence"] >= 0.95 and all(o["confidence"] < estimate["confidence"]
                                                  for o in estimate["others"].values())


@pytest.mark.slow
def test_undeclared_top_p_audit_names_truncation_first_and_the_replay_returns_to_fp32_noise(
        tiny_checkpoint, truncated_rollouts, tmp_path) -> None:
    import mismatch

    undeclared = _strip_declaration(truncated_rollouts["top_p"], tmp_path / "undeclared.jsonl")
    summary = mismatch.audit(tiny_checkpoint, undeclared, out=tmp_path / "a", train="hf:dtype=float32",
                             infer="hf-decode:dtype=float32").summary
    lead = summary["diagnosis"]["causes"][0]
    assert lead["kind"] == "truncated_sampling", summary["diagnosis"]["causes"]
    assert lead["where"]["source"] == "estimated" and abs(lead["where"]["top_p"] - 0.8) <= TOLERANCE["top_p"]
    ratios = summary["alignment"]["truncation"]["ratios"]
    assert ratios["without_replay"]["ratio_mean"] < 0.99  # the kept mass
    assert ratios["with_replay"]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert summary["recommendations"][0]["kind"] == "replay_kept_set"
    assert "temperature" not in lead["title"]

    # Declared, with the kept sets recorded: the trainer renormalized over them is fp32 noise.
    replayed = mismatch.audit(tiny_checkpoint, truncated_rollouts["top_p"], out=tmp_path / "b",
                              train="hf:dtype=float32,sampling=replay",
                              infer="hf-decode:dtype=float32,sampling=replay").summary
    assert replayed["engines"]["train"]["sampling_replay"]["recorded"] > 0
    assert replayed["pairs"]["train/sampler"]["kl_k3"] < 1e-10
    assert replayed["pairs"]["train/sampler"]["log_ratio_abs_max"] < 1e-4
    assert replayed["pairs"]["infer/sampler"]["bitwise_equal_frac"] == 1.0  # the sampler's own path, same run
    assert replayed["diagnosis"]["causes"] == [] or replayed["diagnosis"]["causes"][0]["kind"] != "truncated_sampling"


@pytest.mark.slow
def test_a_declaration_the_data_refute_is_named_and_the_estimate_replayed(tiny_checkpoint, truncated_rollouts,
                                                                         tmp_path) -> None:
    from mismatch.advise.truncation import _parameter_words
    from mismatch.replay.plan import plan_replay
    from mismatch.results.section_records import Truncation
    from mismatch.results.summary_model import from_builtins
    from mismatch.replay.truncation import sampler_truncation

    rollouts = load_rollouts(truncated_rollouts["top_p"], vocab_size=1024)
    plan = plan_replay(rollouts)
    right = sampler_truncation(plan, {**rollouts[0].meta["sampler"]}, "hf:dtype=float32", tiny_checkpoint)
    assert right["replayed_from"] == "declared" and right["declared_fit"] >= 0.95
    wrong = sampler_truncation(plan, {**rollouts[0].meta["sampler"], "top_p": 0.9}, "hf:dtype=float32",
                               tiny_checkpoint)
    assert wrong["declared_fit"] < 0.9 and wrong["replayed_from"].startswith("estimate")
    assert wrong["replayed"]["top_p"] == pytest.approx(0.8)
    words, where = _parameter_words(from_builtins(wrong, Truncation))  # as alignment.truncation reads it
    assert "fix meta.sampler" in words and where.misdeclared is True
