"""MoE routing on a tiny random-init Qwen3-MoE: flips between bf16 and fp32 passes measured per
layer, the gap split by flip, and Rollout Routing Replay (routing=replay) closing the flipped
tokens' gap to the level of the rest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mismatch.audit import audit
from mismatch.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"


@pytest.fixture(scope="module")
def moe(architecture_checkpoint) -> Path:
    return architecture_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def own_and_replayed(moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("routing")
    own = audit(moe, EXAMPLE, train="hf:dtype=bfloat16", infer="hf:dtype=float32", out=out / "own")
    replayed = audit(moe, EXAMPLE, train="hf:dtype=bfloat16,routing=replay", infer="hf:dtype=float32",
                     out=out / "replayed")
    return own.summary, replayed.summary


def test_flips_between_bf16_and_fp32_are_measured_per_layer(own_and_replayed) -> None:
    own, _ = own_and_replayed
    routing = own["routing"]["train/infer"]
    assert routing["moe_layers"] == 2 and len(routing["flip_rate_by_layer"]) == 2
    assert 0 < routing["flip_rate"] < 0.1 and routing["frac_tokens_with_flip"] >= routing["flip_rate"]
    assert routing["with_flip"]["n_tokens"] + routing["without_flip"]["n_tokens"] == routing["n_tokens"]
    # A flip happens at a near-tie: its margin is far below the typical one.
    assert routing["margin_at_flips_median"] < routing["margin_median"]
    # Flipped tokens carry a gap well above the rest's.
    assert routing["with_flip"]["kl_k3"] > 10 * routing["without_flip"]["kl_k3"]
    assert own["engines"]["train"]["routing"] == {"moe_layers": 2, "mode": "own"}


def test_routing_replay_brings_the_flipped_tokens_to_the_dense_level(own_and_replayed) -> None:
    own, replayed = own_and_replayed
    before, after = own["routing"]["train/infer"], replayed["routing"]["train/infer"]
    # The engine's own router would have flipped the same tokens: R3 forced the reference's experts.
    assert after["frac_tokens_with_flip"] == before["frac_tokens_with_flip"]
    assert after["with_flip"]["kl_k3"] < 0.1 * before["with_flip"]["kl_k3"]
    assert after["with_flip"]["kl_k3"] < 5 * after["without_flip"]["kl_k3"]  # the dense level
    assert replayed["pairs"]["train/infer"]["log_ratio_abs_max"] < own["pairs"]["train/infer"]["log_ratio_abs_max"]
    assert replayed["engines"]["train"]["routing"]["mode"] == "replay"


def test_routing_replay_needs_a_router_and_an_engine_to_follow(moe, tiny_checkpoint, tmp_path, capsys) -> None:
    args = ["audit", "--rollouts", str(EXAMPLE), "--out", str(tmp_path / "o")]
    assert main([args[0], str(tiny_checkpoint), *args[1:], "--train", "hf:routing=replay", "--infer", "hf"]) == 2
    assert "this model has no MoE router to replay" in capsys.readouterr().err
    assert main([args[0], str(moe), *args[1:], "--train", "hf:routing=replay", "--infer", "sampler"]) == 2
    assert "which must be a torch engine (hf, hf-decode) to record experts" in capsys.readouterr().err
    assert main([args[0], str(moe), *args[1:], "--train", "hf:routing=maybe"]) == 2
    assert "option routing='maybe' is not one of: own, replay" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_routing_survives_a_resume(moe, tmp_path) -> None:
    """The routing of finished blocks is kept in the work dir with their log-probs: a rerun that
    replays nothing has every stream's routing back, bit for bit."""
    from mismatch.replay import replay_sources
    from mismatch.results import WorkDir

    roles = {"train": "hf:dtype=bfloat16", "infer": "hf:dtype=float32"}
    first = replay_sources(moe, EXAMPLE, roles, block_size=4, work=WorkDir(tmp_path / ".o.work", {"run": 1}))
    assert sorted(p.name for p in (tmp_path / ".o.work").glob("train-routing-*.npz"))[0] == "train-routing-000000.npz"
    again = replay_sources(moe, EXAMPLE, roles, block_size=4, work=WorkDir(tmp_path / ".o.work", {"run": 1}))
    assert again.engines["train"]["resumed_blocks"] == 3  # 12 rollouts, 4 a block: nothing replayed
    for role in roles:
        assert len(again.routing[role]) == len(first.routing[role]) == len(first.plan.requests)
        for a, b in zip(first.routing[role], again.routing[role]):
            assert np.array_equal(a.experts, b.experts) and np.array_equal(a.margin, b.margin)


def test_the_audit_recommends_routing_replay_exactly_when_flips_carry_most_of_the_gap(own_and_replayed) -> None:
    from mismatch.advise.recommend import ROUTING_SHARE
    from mismatch.analysis.routing import routing_share

    own, _ = own_and_replayed
    share = routing_share(own["routing"]["train/infer"])
    kinds = [r["kind"] for r in own["recommendations"]]
    assert ("routing_replay" in kinds) == (share >= ROUTING_SHARE)
    if "routing_replay" in kinds:
        assert "router_replay:" in own["config_snippets"]["verl"]


def test_sharded_routing_merges_to_one_runs_counts(moe, tmp_path) -> None:
    from mismatch.merge import merge
    from mismatch.replay import Shard

    specs = {"train": "hf:dtype=bfloat16", "infer": "hf:dtype=float32"}
    whole = audit(moe, EXAMPLE, **specs, out=tmp_path / "whole", block_size=4).summary["routing"]["train/infer"]
    for index in range(2):
        audit(moe, EXAMPLE, **specs, out=tmp_path / f"s{index}", block_size=4, shard=Shard(index=index, count=2))
    merged = merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m")["routing"]["train/infer"]
    for key in ("n_tokens", "moe_layers"):
        assert merged[key] == whole[key]
    np.testing.assert_allclose(merged["flip_rate_by_layer"], whole["flip_rate_by_layer"], rtol=1e-12)
    np.testing.assert_allclose(merged["with_flip"]["kl_k3"], whole["with_flip"]["kl_k3"], rtol=1e-9)
    assert merged["not_merged"] == ["margin_at_flips_median", "margin_median"]


def test_hf_decode_replays_the_routing_it_is_given(moe, tmp_path) -> None:
    """The decode path forces the reference's experts chunk by chunk, as the packed path does."""
    own = audit(moe, EXAMPLE, train="hf-decode:dtype=bfloat16", infer="hf:dtype=float32", out=tmp_path / "own")
    forced = audit(moe, EXAMPLE, train="hf-decode:dtype=bfloat16,routing=replay", infer="hf:dtype=float32",
                   out=tmp_path / "forced")
    before, after = own.summary["routing"]["train/infer"], forced.summary["routing"]["train/infer"]
    assert before["frac_tokens_with_flip"] > 0
    assert after["with_flip"]["kl_k3"] < 0.2 * before["with_flip"]["kl_k3"]
    assert forced.summary["engines"]["train"]["routing"]["mode"] == "replay"
