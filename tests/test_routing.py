"""MoE routing on a tiny random-init Qwen3-MoE: flips between bf16 and fp32 passes measured per
layer, the gap split by flip, and Rollout Routing Replay (routing=replay) closing the flipped
tokens' gap to the level of the rest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mismatch.pipeline.audit import audit
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
    err = capsys.readouterr().err
    assert "routing=replay follows the rollouts' routed_experts, and they store none; then it follows --infer, " \
           "which must be an engine that records the experts it routes" in err and len(err.strip().splitlines()) == 1
    assert main([args[0], str(moe), *args[1:], "--train", "hf:routing=maybe"]) == 2
    assert "option routing='maybe' is not one of: own, replay" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_following_the_infer_pass_is_said_when_the_rollouts_store_no_routing(own_and_replayed, capsys) -> None:
    """R3 in training forces the rollout engine's experts; with none stored the audit's trainer
    follows --infer's replay instead, and the output says so (the stored case says nothing)."""
    from mismatch.cli.printing import print_findings
    from mismatch.results.summary_model import partial_summary

    own, replayed = (partial_summary(summary) for summary in own_and_replayed)
    print_findings(replayed)
    assert "routing: --train routing=replay followed --infer's experts: the rollouts store no routed_experts" \
           in capsys.readouterr().out
    print_findings(own)
    assert "routing:" not in capsys.readouterr().out


def test_routing_survives_a_resume(moe, tmp_path) -> None:
    """The routing of finished blocks is kept in the work dir with their log-probs: a rerun that
    replays nothing has every stream's routing back, bit for bit."""
    from mismatch.replay import ReplayOptions, replay_sources
    from mismatch.results import WorkDir

    roles = {"train": "hf:dtype=bfloat16", "infer": "hf:dtype=float32"}
    first = replay_sources(moe, EXAMPLE, roles, ReplayOptions(block_size=4, work=WorkDir(tmp_path / ".o.work", {"run": 1})))
    assert sorted(p.name for p in (tmp_path / ".o.work").glob("train-routing-*.npz"))[0] == "train-routing-000000.npz"
    again = replay_sources(moe, EXAMPLE, roles, ReplayOptions(block_size=4, work=WorkDir(tmp_path / ".o.work", {"run": 1})))
    assert again.engines["train"]["resumed_blocks"] == 3  # 12 rollouts, 4 a block: nothing replayed
    for role in roles:
        assert len(again.routing[role]) == len(first.routing[role]) == len(first.plan.requests)
        for a, b in zip(first.routing[role], again.routing[role]):
            assert np.array_equal(a.experts, b.experts) and np.array_equal(a.margin, b.margin)


def test_the_audit_recommends_routing_replay_exactly_when_flips_carry_most_of_the_gap(own_and_replayed) -> None:
    from mismatch.advise.diagnose import ROUTING_SHARE
    from mismatch.analysis.routing import routing_share

    own, _ = own_and_replayed
    share = routing_share(own["routing"]["train/infer"])
    kinds = [r["kind"] for r in own["recommendations"]]
    assert ("routing_replay" in kinds) == (share >= ROUTING_SHARE)
    if "routing_replay" in kinds:
        assert "router_replay:" in own["config_snippets"]["verl"]


def test_sharded_routing_merges_to_one_runs_counts(moe, tmp_path) -> None:
    from mismatch.pipeline.merge import merge
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


def _store_sampler(rollouts: Path, routed, logps, out: Path) -> Path:
    """The rollouts as an engine pass sampled them: its log-probs, and each segment's routed_experts
    as it routed them. A token's row is the experts of the position holding it, from whichever
    stream fed it (a parent's last token is fed only as a child's context); a token no stream fed
    gets null."""
    import json

    lines, streams = [], iter(routed)
    own_logps = iter(logps)
    for line in rollouts.read_text().splitlines():
        raw = json.loads(line)
        branches = {branch["id"]: branch for branch in raw["branches"]}
        rows = {bid: [[None] * len(s["tokens"]) for s in b["segments"]] for bid, b in branches.items()}
        for branch, stream in zip(raw["branches"], streams):  # plan order: rollout by rollout, branch by branch
            logp, start = next(own_logps), 0
            for segment in branch["segments"]:
                if "logprobs" in segment:
                    segment["logprobs"] = logp[start: start + len(segment["tokens"])].tolist()
                start += len(segment["tokens"])
            path, node, stop = [], branch, None  # (branch id, tokens of it in the stream), root first
            while node is not None:
                path.insert(0, (node["id"], stop))
                node, stop = branches.get(node["parent"]), node["fork_at"]
            places = [(bid, k, t) for bid, upto in path
                      for k, segment in enumerate(branches[bid]["segments"]) for t in range(len(segment["tokens"]))]
            places = [p for bid, upto in path for p in [q for q in places if q[0] == bid][:upto]]
            for position, (bid, k, t) in enumerate(places[: len(stream.experts)]):
                rows[bid][k][t] = rows[bid][k][t] or stream.experts[position].tolist()
        for bid, branch in branches.items():
            for segment, stored in zip(branch["segments"], rows[bid]):
                segment["routed_experts"] = stored
        lines.append(json.dumps(raw))
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def stored_fp32(moe, tmp_path_factory) -> tuple[Path, list]:
    """The example rollouts as an fp32 pass would have sampled them: its log-probs, and the experts
    it routed each token to (a sampler that returned its routing, as vLLM's
    enable_return_routed_experts does)."""
    from mismatch.engines import load_engine
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts

    engine = load_engine("hf:dtype=float32", str(moe))
    try:
        logps = engine.replay(plan_replay(load_rollouts(EXAMPLE)).requests)
        routed = list(engine.routed)
    finally:
        engine.close()
    return _store_sampler(EXAMPLE, routed, logps, tmp_path_factory.mktemp("stored") / "routed.jsonl"), routed


def test_stored_routing_is_agreed_against_and_replayed(moe, stored_fp32, tmp_path) -> None:
    """R3 as trainers run it: the trainer follows the routing the rollout engine stored. Each pass's
    agreement with the stored routing is measured (pairs X/sampler); with routing=replay the experts
    the trainer uses are the stored ones at every position, and the gap on flipped tokens falls."""
    rollouts, routed = stored_fp32
    specs = {"train": "hf:dtype=bfloat16", "infer": "hf:dtype=float32"}
    own = audit(moe, rollouts, **specs, out=tmp_path / "own").summary
    replayed = audit(moe, rollouts, train="hf:dtype=bfloat16,routing=replay", infer="hf:dtype=float32",
                     out=tmp_path / "r3").summary
    assert own["routing"]["infer/sampler"]["flip_rate"] == 0.0  # the config that stored it agrees bit for bit
    assert own["pairs"]["infer/sampler"]["bitwise_equal_frac"] == 1.0
    before, after = own["routing"]["train/sampler"], replayed["routing"]["train/sampler"]
    assert before["frac_tokens_with_flip"] > 0 and before["n_tokens"] == own["pairs"]["train/sampler"]["n_tokens"]
    assert before["margin_at_flips_median"] is not None  # the recorded side's margin (the stored has none)
    assert after["with_flip"]["kl_k3"] < 0.1 * before["with_flip"]["kl_k3"]
    assert after["with_flip"]["kl_k3"] < 5 * after["without_flip"]["kl_k3"]  # the dense level
    assert replayed["pairs"]["train/sampler"]["kl_k3"] < 0.5 * own["pairs"]["train/sampler"]["kl_k3"]
    assert replayed["engines"]["train"]["routing"] == {"moe_layers": 2, "mode": "replay", "from": "sampler"}


def test_routing_replay_uses_the_stored_experts_at_every_position(moe, stored_fp32) -> None:
    """The experts modules of a routing=replay pass receive exactly the stored selection: no flip is
    left (summary.json's routing keeps what the pass's own router would have chosen)."""
    from mismatch.engines import load_engine
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts

    _, routed = stored_fp32
    requests = plan_replay(load_rollouts(EXAMPLE)).requests
    engine = load_engine("hf:dtype=bfloat16,routing=replay", str(moe))
    used: list[np.ndarray] = []

    def record(module, args, kwargs) -> None:
        selected = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
        used.append(selected.sort(dim=-1).values.numpy())

    modules = [m for name, m in engine.model.named_modules() if name.endswith("mlp.experts")]
    hooks = [module.register_forward_pre_hook(record, with_kwargs=True) for module in modules]
    try:
        for request, stream in zip(requests, routed, strict=True):
            engine.replay([request], forced_experts=[stream.experts])
            fed = len(request.tokens) - 1  # the last position predicts nothing and is forced anywhere
            assert np.array_equal(np.stack([u[:fed] for u in used], axis=1), stream.experts)
            used.clear()
    finally:
        for hook in hooks:
            hook.remove()
        engine.close()


def test_stored_routing_that_cannot_be_this_models_is_refused_before_any_replay(moe, stored_fp32, tiny_checkpoint,
                                                                                tmp_path, capsys) -> None:
    import json

    rollouts, _ = stored_fp32
    def run(checkpoint: Path, lines: list[dict], train: str = "hf:routing=replay") -> str:
        path = tmp_path / "r.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        assert main(["audit", str(checkpoint), "--rollouts", str(path), "--train", train, "--infer", "sampler",
                     "--out", str(tmp_path / "o")]) == 2
        return capsys.readouterr().err

    lines = [json.loads(line) for line in rollouts.read_text().splitlines()]
    lines[1]["branches"][0]["segments"][2]["routed_experts"][3] = None
    err = run(moe, lines)
    assert "routing=replay follows the stored routed_experts, which have no row for rollout 'r-1' branch 'main' " \
           "position 32, a position the trainer feeds (1 such in that stream)" in err
    assert "which have no row for rollout 'r-1' branch 'sub-1'" not in err
    err = run(tiny_checkpoint, lines, train="hf")
    assert "routed_experts stored, but" in err and "config.json names no experts (a dense model routes nothing)" in err
    for segment in lines[0]["branches"][0]["segments"]:
        segment["routed_experts"] = [row and row[:1] for row in segment["routed_experts"]]
    for line in lines[1:]:
        for branch in line["branches"]:
            for segment in branch["segments"]:
                segment.pop("routed_experts")
    err = run(moe, lines)
    assert "rollout 'r-0': routed_experts has 1 layers x top-2 per token, but the model routes 2 layers x top-2" in err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def undeclared_top_k(moe, tmp_path_factory) -> Path:
    """Rollouts the fp32 decode path sampled from the MoE model under top-k 20, its processed
    log-probs stored undeclared (meta.sampler keeps top_k, drops `logprobs`): a processing the
    audit finds only in the data (a random-init model has no likely token a temperature would move)."""
    import json

    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

    path = tmp_path_factory.mktemp("top_k") / "rollouts.jsonl"
    write_rollouts(moe, path, HarnessConfig(num_rollouts=3, max_turns=2, top_k=20, dtype="float32"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        line["meta"]["sampler"].pop("logprobs")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_routing_replay_trainers_like_for_like_pass_forces_the_engines_experts(moe, undeclared_top_k, tmp_path) -> None:
    """R3's like-for-like pass: the trainer under the sampler's processing follows the experts its
    own pass followed (--infer's here, as R3 forces the rollout engine's), so train_processed and
    train differ by the processing alone. Checked against the engines run by hand: bit for bit the
    forced replay, and not the trainer's own routing (bf16 flips against fp32 at some token)."""
    import pandas as pd

    from mismatch.engines import load_engine
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts
    from mismatch.streams import Sampling

    result = audit(moe, undeclared_top_k, train="hf:dtype=bfloat16,routing=replay", infer="hf:dtype=float32",
                   out=tmp_path / "o")
    summary = result.summary
    assert summary["alignment"]["logprob_semantics"] == "truncated"
    assert "train_processed/sampler" in summary["pairs"]
    table = pd.read_parquet(tmp_path / "o" / "tokens.parquet")
    requests = plan_replay(load_rollouts(undeclared_top_k)).requests
    infer = load_engine("hf:dtype=float32", str(moe))
    try:
        infer.replay(requests)
        experts = [stream.experts for stream in infer.routed]
    finally:
        infer.close()
    top_k = Sampling(top_k=20)
    forced, own = load_engine("hf:dtype=bfloat16,routing=replay", str(moe)), load_engine("hf:dtype=bfloat16", str(moe))
    try:
        expected = np.concatenate(forced.replay(requests, forced_experts=experts, processing=top_k))
        unforced = np.concatenate(own.replay(requests, processing=top_k))
    finally:
        forced.close()
        own.close()
    column = table["logp_train_processed"].to_numpy()
    np.testing.assert_array_equal(column, expected)
    assert not np.array_equal(column, unforced, equal_nan=True)
    # The like-for-like pair is the processing removed: far below the raw pair's gap (the median
    # token's: a bf16 trainer's top 20 differs from the fp32 sampler's at a few near-ties, -inf there).
    stored, raw = table["logp_sampler"].to_numpy(), table["logp_train"].to_numpy()
    both = np.isfinite(column) & np.isfinite(stored)
    assert both.sum() > 0.9 * np.isfinite(stored).sum()
    assert np.median(np.abs(column - stored)[both]) < 0.2 * np.median(np.abs(raw - stored)[both])
