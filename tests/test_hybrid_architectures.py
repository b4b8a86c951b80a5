"""The models trained now (issue #47): hybrid linear attention (Qwen3.5, Qwen3-Next, Qwen3.5-MoE, Kimi
Linear, OLMo-hybrid), sparse attention with an indexer (GLM-5's glm_moe_dsa), attention sinks and MoE
(gpt-oss, MiniMax-M2), as tiny random-init checkpoints: audited hf vs hf-decode with --localize, the
error split by layer type, the diagnosis naming the mechanism, DSA's index flips and index replay.

Short rollouts (a 70-token prompt, 12 sampled tokens): the torch fallbacks of the linear-attention
kernels decode a token in a tenth of a second here, so the example's thousands would take minutes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mismatch.advise.levels import gap_level
from mismatch.results.summary_model import partial_metrics, partial_summary
from mismatch.demo.architectures import NEW_ARCHITECTURES
from mismatch.localize.layer_types import SPLIT_RULE, layer_types, mechanism
from mismatch.pipeline.audit import audit
from mismatch.present.headline import audit_banner

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def short_rollouts(tmp_path_factory) -> Path:
    """Two rollouts cut from the example's streams: 70 prompt tokens (past the chunked algorithm's
    64-token chunk), then 12 sampled ones (decoded one by one by hf-decode)."""
    lines = []
    for line in EXAMPLE.read_text().splitlines():
        rollout = json.loads(line)
        flat = [t for segment in rollout["branches"][0]["segments"] for t in segment["tokens"]]
        if len(flat) >= 82:
            lines.append(json.dumps({"id": rollout["id"], "branches": [{
                "id": "main", "kind": "main", "parent": None, "fork_at": None,
                "segments": [{"role": "user", "tokens": flat[:70]}, {"role": "assistant", "tokens": flat[70:82]}]}]}))
        if len(lines) == 2:
            break
    path = tmp_path_factory.mktemp("short") / "rollouts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# Each architecture's layer types as the split reads them (config.json + weight names).
TYPES = {
    "qwen3_5": ["linear_attention", "full_attention"],
    "qwen3_next": ["linear_attention", "full_attention"],
    "qwen3_5_moe": ["linear_attention", "full_attention"],
    "kimi_linear": ["linear_attention", "full_attention"],
    "olmo_hybrid": ["linear_attention", "full_attention"],
    "glm_moe_dsa": ["sparse_attention", "sparse_attention"],
    "gpt_oss": ["sink_sliding_attention", "sink_full_attention"],
    "minimax_m2": ["full_attention", "full_attention"],
}


@pytest.mark.parametrize("name", list(TYPES))
def test_layer_types_are_read_from_config_and_weights(name, architecture_checkpoint) -> None:
    assert layer_types(architecture_checkpoint(name), 2) == TYPES[name]


def test_a_llama_without_layer_types_is_full_attention(architecture_checkpoint) -> None:
    assert layer_types(architecture_checkpoint("llama3"), 2) == ["full_attention", "full_attention"]


def test_the_mechanism_is_named_only_when_one_thing_differs() -> None:
    assert mechanism("linear_attention", "hf-decode:dtype=bfloat16", "hf:dtype=bfloat16") == \
        "the linear-attention layers' chunked prefill vs recurrent decode"
    assert mechanism("linear_attention", "hf:dtype=bfloat16", "hf:dtype=float32") == \
        "the linear-attention layers' recurrence in bfloat16 vs float32"
    # dtype=auto is the saved dtype: float32 here, so only the path differs.
    assert mechanism("sink_full_attention", "hf-decode:dtype=float32", "hf", "float32") == \
        "the full-attention layers' (with learned sink logits) full forward vs KV-cached decode"
    # Both the path and the dtype differ: the split cannot tell them apart, so it names neither.
    assert mechanism("linear_attention", "hf-decode:dtype=bfloat16", "hf:dtype=float32") is None
    assert mechanism("mlp", "hf-decode:dtype=bfloat16", "hf:dtype=bfloat16") is None


@pytest.mark.parametrize("name", NEW_ARCHITECTURES)
def test_each_new_architecture_is_audited_and_the_diagnosis_names_its_layer_type(
        name, architecture_checkpoint, short_rollouts, tmp_path) -> None:
    """hf vs hf-decode in bfloat16 with --localize: a gap, split by layer type; the layer_type cause
    is claimed only when its size test passes (the lead mixer type introduces >= half the local
    error, in a model of more than one mixer type), else listed in diagnosis.refused with why; it
    never blames weights both sides share, and no stored log-probs is no identity cause."""
    checkpoint = architecture_checkpoint(name)
    summary = audit(checkpoint, short_rollouts, train="hf-decode:dtype=bfloat16", infer="hf:dtype=bfloat16",
                    out=tmp_path / "o", localize_models=True).summary
    split = summary["localization"]["layer_types"]
    assert split["rule"] == SPLIT_RULE
    assert {t["layer_type"] for t in split["by_type"]} == {*TYPES[name], "mlp"}
    errors = [t["local_rel_error_sum"] for t in split["by_type"]]
    assert errors == sorted(errors, reverse=True)
    # None only when every sub-block fed the same input agrees bit for bit (measured here in bf16: Kimi Linear, gpt-oss).
    assert split["lead_type"] == (split["by_type"][0]["layer_type"] if errors[0] > 0 else None)
    assert abs(sum(t["share"] for t in split["by_type"]) - (1.0 if errors[0] > 0 else 0.0)) < 1e-9
    causes, refused = summary["diagnosis"]["causes"], summary["diagnosis"]["refused"]
    assert {"weights", "identity"}.isdisjoint(c["kind"] for c in causes)  # one checkpoint; no stored log-probs
    level = gap_level(partial_metrics(summary["pairs"]["train/infer"]))
    found = next((c for c in causes if c["kind"] == "layer_type"), None)
    refusal = next((r for r in refused if r["kind"] == "layer_type"), None)
    lead = next((t for t in split["by_type"] if t["layer_type"] == split["lead_type"]), None)
    if split["mechanism"] is None or level == "exact":
        assert found is None and refusal is None
    elif len(set(TYPES[name])) == 1:  # one mixer type: the whole model's path, not a layer type's
        assert found is None and refusal["test"] == "size"
        assert refusal["why"].startswith(f"every layer runs {TYPES[name][0]}: the split singles out no layer type")
    elif lead["share"] < 0.5:
        assert found is None and refusal["why"].startswith(f"spread, not concentrated: the {lead['layer_type']} layers")
    else:
        assert refusal is None
        assert found["title"].startswith(f"{split['mechanism']}: {lead['share']:.0%} of the layers' local error")
        assert found["where"]["layer_type"] == split["lead_type"]
        assert found["minor"] == (level == "negligible")  # located, not a gap to fix, when negligible
    assert ("index_flips" in summary["localization"]) == (name == "glm_moe_dsa")
    flips = next((c for c in causes if c["kind"] == "index_flips"), None)
    if flips is not None:  # flips carry the gap: they lead, with their replay
        assert flips is causes[0] and summary["localization"]["index_flips"]["k3_share_with_flip"] >= 0.5
        assert audit_banner(partial_summary(summary)).headline.startswith("DSA index flips carry")


def _perturbed_indexer(checkpoint: Path, out: Path) -> Path:
    """A copy whose indexers score keys differently (every other weight the same): their top-k flips."""
    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(checkpoint, out))
    weights = load_file(copy / "model.safetensors")
    names = [name for name in weights if ".indexer.weights_proj." in name]
    assert len(names) == 2
    for name in names:
        weights[name] = -weights[name]  # the heads' weights negated: another ranking of the keys
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_a_perturbed_indexer_flips_keys_and_index_replay_removes_the_gap(architecture_checkpoint, short_rollouts,
                                                                          tmp_path) -> None:
    """The indexer's weights only choose keys: forced to the reference's choice, the perturbed
    model is the reference bit for bit (both computed in this run), so replay removes the whole gap."""
    from mismatch.localize.index_flips import index_flips
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts

    checkpoint = architecture_checkpoint("glm_moe_dsa")
    perturbed = _perturbed_indexer(checkpoint, tmp_path / "perturbed")
    requests = plan_replay(load_rollouts(short_rollouts)).requests
    flips = index_flips(str(checkpoint), requests, a=f"hf:dtype=float32,checkpoint={perturbed}",
                        b="hf:dtype=float32").to_dict()
    assert flips["index_topk"] == 8 and [row["layer"] for row in flips["by_layer"]] == [0, 1]
    for row in flips["by_layer"]:
        assert row["n_queries_past_topk"] > 0 and 0 < row["frac_queries_flipped"] <= 1
    assert flips["frac_tokens_with_flip"] > 0
    assert flips["with_flip"]["k3_sum"] > 0
    assert flips["without_flip"]["k3_sum"] == 0.0  # the first top-k positions: every key, on both sides
    assert flips["k3_share_with_flip"] == 1.0
    assert flips["replayed_with_flip"]["k3_sum"] == 0.0 and flips["replayed_with_flip"]["log_ratio_abs_mean"] == 0.0
    assert flips["removed_k3_frac"] == 1.0


def _with_selections(rollouts: Path, selected: list[np.ndarray], out: Path) -> Path:
    """The rollouts with each token's recorded selection (format v1 `indexer_topk`), split by segment."""
    lines = []
    for line, rows in zip(rollouts.read_text().splitlines(), selected, strict=True):
        rollout = json.loads(line)
        start = 0
        for segment in rollout["branches"][0]["segments"]:
            segment["indexer_topk"] = rows[start:start + len(segment["tokens"])].tolist()
            start += len(segment["tokens"])
        lines.append(json.dumps(rollout))
    out.write_text("\n".join(lines) + "\n")
    return out


def test_index_replay_uses_the_recorded_selection_when_the_rollouts_carry_it(architecture_checkpoint, short_rollouts,
                                                                             tmp_path) -> None:
    """The reference's selections written into the rollouts (as an engine that records them would):
    replay forces the perturbed indexer to them and removes the whole gap, saying "recorded". Its
    neighbour: the perturbed model's own selections recorded, forced on itself, remove nothing."""
    from mismatch.localize.index_flips import index_flips, selections
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts

    checkpoint = architecture_checkpoint("glm_moe_dsa")
    perturbed = str(_perturbed_indexer(checkpoint, tmp_path / "perturbed"))
    requests = plan_replay(load_rollouts(short_rollouts)).requests
    a, b = f"hf:dtype=float32,checkpoint={perturbed}", "hf:dtype=float32"
    for source, removed in ((b, 1.0), (a, 0.0)):
        recorded = _with_selections(short_rollouts, selections(str(checkpoint), source, requests),
                                    tmp_path / f"recorded-{removed}.jsonl")
        flips = index_flips(str(checkpoint), plan_replay(load_rollouts(recorded)).requests, a=a, b=b).to_dict()
        assert flips["replay_selection"] == "recorded"
        assert flips["num_queries_recorded"] == sum(len(r.tokens) for r in requests)
        assert flips["k3_share_with_flip"] == 1.0 and flips["with_flip"]["k3_sum"] > 0
        assert flips["removed_k3_frac"] == removed
    simulated = index_flips(str(checkpoint), requests, a=a, b=b).to_dict()
    assert simulated["replay_selection"] == "simulated" and simulated["num_queries_recorded"] == 0


def test_a_recorded_selection_past_its_query_is_refused_before_any_model_loads(architecture_checkpoint,
                                                                                 short_rollouts, tmp_path) -> None:
    from mismatch.errors import MismatchError
    from mismatch.localize.index_flips import index_flips
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts

    requests = plan_replay(load_rollouts(short_rollouts)).requests
    rows = [np.tile(np.arange(8, dtype=np.int32), (len(r.tokens), 2, 1)) for r in requests]  # query 0 selects key 7
    bad = plan_replay(load_rollouts(_with_selections(short_rollouts, rows, tmp_path / "bad.jsonl"))).requests
    with pytest.raises(MismatchError, match="index replay: request 0: indexer_topk at position 0 layer 0 selects key 7, "
                                            "after its query"):
        index_flips(str(architecture_checkpoint("glm_moe_dsa")), bad, a="hf:checkpoint=/nonexistent", b="hf")


def test_layers_cli_reports_the_split_and_the_index_flips(architecture_checkpoint, short_rollouts, tmp_path,
                                                          capsys) -> None:
    from mismatch.cli import main

    checkpoint = architecture_checkpoint("glm_moe_dsa")
    perturbed = _perturbed_indexer(checkpoint, tmp_path / "perturbed")
    args = ["layers", str(checkpoint), "--rollouts", str(short_rollouts), "--a",
            f"hf:dtype=float32,checkpoint={perturbed}", "--b", "hf:dtype=float32"]
    assert main([*args, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["layer_types"]["lead_type"] == "sparse_attention"
    assert found["index_flips"]["removed_k3_frac"] == 1.0
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "layer types: the sparse-attention layers' indexer top-k selection" in printed
    assert "index replay removes 100%" in printed


def test_bf16_index_flips_are_measured_and_replay_removes_their_part(architecture_checkpoint, short_rollouts,
                                                                     tmp_path) -> None:
    """bf16 vs fp32: the indexer's top-k flips on rounding; replay (bf16 forced to fp32's keys) leaves
    the bf16 rounding of the tokens without a flip as it was, and shrinks the flipped tokens' gap."""
    summary = audit(architecture_checkpoint("glm_moe_dsa"), short_rollouts, train="hf:dtype=bfloat16",
                    infer="hf:dtype=float32", out=tmp_path / "o", localize_models=True).summary
    flips = summary["localization"]["index_flips"]
    assert flips["a"] == "hf:dtype=bfloat16" and flips["b"] == "hf:dtype=float32"
    assert flips["frac_tokens_with_flip"] > 0
    assert flips["replayed_with_flip"]["k3_sum"] < flips["with_flip"]["k3_sum"]
    kinds = [c["kind"] for c in summary["diagnosis"]["causes"]]
    share = flips["k3_share_with_flip"]
    assert ("index_flips" in kinds) == (share is not None and share >= 0.5)
    if "index_flips" in kinds:
        assert any(r["kind"] == "index_replay" and "#48305" in r["why"] for r in summary["recommendations"])
    assert np.isfinite(summary["pairs"]["train/infer"]["kl_k3"])


HYBRIDS = [name for name, types in TYPES.items() if "linear_attention" in types]


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_bf16_recurrent_state_puts_the_gap_in_the_linear_attention_layers(name, architecture_checkpoint,
                                                                            short_rollouts, tmp_path) -> None:
    """The sampler keeping its linear-attention state in bfloat16 (as a serving engine's state cache
    of the model's dtype does) against the trainer's chunked float32 recurrence: the gap grows, the
    linear-attention layers introduce most of it, and the diagnosis leads with them, its size test
    stated; only MoE routing flips (downstream of those layers' rounding) may come first. Its
    neighbours: the float32 state (the test above) and float32 on both sides (below)."""
    checkpoint = architecture_checkpoint(name)
    own = audit(checkpoint, short_rollouts, train="hf-decode:dtype=bfloat16", infer="hf:dtype=bfloat16",
                out=tmp_path / "own").summary["pairs"]["train/infer"]
    summary = audit(checkpoint, short_rollouts, train="hf-decode:dtype=bfloat16,state_dtype=bfloat16",
                    infer="hf:dtype=bfloat16", out=tmp_path / "bf16", localize_models=True).summary
    assert summary["engines"]["train"]["options"]["state_dtype"] == "bfloat16"
    assert summary["pairs"]["train/infer"]["kl_k3"] > 5 * own["kl_k3"]
    assert gap_level(partial_metrics(summary["pairs"]["train/infer"])) in ("small", "large")
    split = summary["localization"]["layer_types"]
    lead = split["by_type"][0]
    assert split["lead_type"] == lead["layer_type"] == "linear_attention" and lead["share"] >= 0.5
    words = "the linear-attention layers' chunked prefill vs recurrent decode (recurrent state in bfloat16)"
    assert split["mechanism"] == words
    causes = summary["diagnosis"]["causes"]
    kinds = [c["kind"] for c in causes]
    cause = causes[kinds.index("layer_type")]
    assert set(kinds[:kinds.index("layer_type")]) <= {"routing_flips"}
    assert cause["title"].startswith(f"{words}: {lead['share']:.0%} of the layers' local error")
    assert cause["where"]["layers"] == [0] and not cause["minor"]
    assert any(r["kind"] == "align_linear_attention" and "mamba_ssm_cache_dtype" in r["why"]
               for r in summary["recommendations"])
    if kinds[0] == "layer_type":
        assert audit_banner(partial_summary(summary)).headline.startswith(
            f"The linear-attention layers' chunked prefill vs recurrent decode (recurrent state in bfloat16): "
            f"{lead['share']:.0%} of the layers' local error")


@pytest.mark.parametrize(("name", "dtype"), [("qwen3_5", "float32"), ("minimax_m2", "bfloat16"),
                                             ("gpt_oss", "float32")])
def test_the_layer_type_does_not_lead_when_the_gap_is_not_concentrated_in_one(name, dtype, architecture_checkpoint,
                                                                               short_rollouts, tmp_path) -> None:
    """The neighbours: float32 on both sides (every part differs at float32 rounding, the MLPs' one-row
    matmuls as much as the mixers), a full-attention-only model (MiniMax-M2: its one mixer type is the
    whole model's path), gpt-oss's sink layers in float32 (spread over both types and the MLPs)."""
    summary = audit(architecture_checkpoint(name), short_rollouts, train=f"hf:dtype={dtype}",
                    infer=f"hf-decode:dtype={dtype}", out=tmp_path / "o", localize_models=True).summary
    split = summary["localization"]["layer_types"]
    assert "layer_type" not in {c["kind"] for c in summary["diagnosis"]["causes"]}
    refusal = next((r for r in summary["diagnosis"]["refused"] if r["kind"] == "layer_type"), None)
    if split["mechanism"] is None:  # the MLPs lead, or nothing differs: no mixer to name
        assert refusal is None and split["lead_type"] in ("mlp", None)
    elif name == "minimax_m2":
        assert refusal["why"].startswith("every layer runs full_attention")
        assert summary["diagnosis"]["causes"][0]["kind"] == "kernel_path"
    else:
        assert split["by_type"][0]["share"] < 0.5 and refusal["why"].startswith("spread, not concentrated")


def test_an_unknown_state_dtype_is_refused(architecture_checkpoint) -> None:
    from mismatch.engines import load_engine
    from mismatch.errors import SpecError

    with pytest.raises(SpecError, match="state_dtype='fp8' is not one of: auto, float32, bfloat16, float16"):
        load_engine("hf-decode:state_dtype=fp8", str(architecture_checkpoint("qwen3_5")))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear", "llama3"])
def test_the_linear_attention_probe_measures_the_two_paths_and_the_state_dtype(name, architecture_checkpoint) -> None:
    """`mismatch probe`'s linear_attention family on the gated delta rule layers' shapes: chunked
    prefill vs recurrent decode differ at float32 rounding; a bfloat16 state moves the output far
    more; with bfloat16 in and out the path's difference is nearly all rounded away (the hf vs
    hf-decode table in RESULTS.md: the hybrids' bf16 gap lives in their full-attention layers)."""
    from mismatch.probes import run_probes

    results = run_probes(architecture_checkpoint(name), device="cpu", families=["linear_attention"])
    if name in ("kimi_linear", "llama3"):  # no gated delta rule (Kimi's KDA layers name their shapes otherwise)
        assert results == []
        return
    path, state, rounded = results
    assert path.source == "prefill_decode" and path.dtype == "float32" and 0 < path.max_abs_diff < 1e-5
    assert state.source == "dtype" and state.max_abs_diff > 100 * path.max_abs_diff
    assert rounded.dtype == "bfloat16" and rounded.bitwise_equal_frac > 0.99


@pytest.mark.parametrize("keys, at", [({"layer_types": ["full_attention", 3]}, "$.layer_types[1]"),
                                      ({"index_topk": "many"}, "$.index_topk"),
                                      ({"text_config": {"layer_types": "linear_attention"}}, "$.text_config.layer_types")])
def test_a_localizer_key_of_another_type_is_one_checkpoint_error_naming_the_file_and_key(
        tmp_path: Path, keys: dict, at: str) -> None:
    from mismatch.errors import CheckpointError
    from mismatch.localize.model_config import read_model_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next", **keys}))
    with pytest.raises(CheckpointError) as raised:
        read_model_config(tmp_path)
    said = str(raised.value)
    assert said.startswith(f"{tmp_path / 'config.json'}: ") and at in said and "\n" not in said
