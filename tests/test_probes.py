"""Kernel probes: the ULP helper against hand values, each variation against a direct recomputation
or exact arithmetic, and the runner's coverage and JSON on the tiny model's shapes."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mismatch import probes
from mismatch.cli import main
from mismatch.errors import CheckpointError, MismatchError
from mismatch.probes import attention, matmul, norm, reductions, router, softmax
from mismatch.probes.result import SOURCES, measure
from mismatch.probes.shapes import (
    MoEShapes,
    ProbeShapes,
    attn_scale_from_config,
    has_dense_mlp,
    mla_from_config,
    moe_from_config,
    shapes_from_checkpoint,
    sliding_window_from_config,
)
from mismatch.probes.ulp import bitwise_equal, max_ulp_diff, ordinal, ulp_diff

TINY = ProbeShapes(hidden=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate=384, vocab=1024)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ---- ULPs -------------------------------------------------------------------------------------

def test_ulp_hand_values_fp32():
    one_up = torch.nextafter(f32(1.0), f32(2.0))
    assert ulp_diff(f32(1.0), one_up).tolist() == [1]
    assert ulp_diff(f32(-1.0), -one_up).tolist() == [1]
    assert ulp_diff(f32(1.0), f32(2.0)).tolist() == [2 ** 23]  # one binade of fp32
    assert ulp_diff(f32(0.0), f32(-0.0)).tolist() == [0]
    assert bitwise_equal(f32(0.0), f32(-0.0)).tolist() == [False]
    tiny = torch.nextafter(f32(0.0), f32(1.0))  # smallest subnormal
    assert ulp_diff(tiny, -tiny).tolist() == [2]  # -tiny, ±0, +tiny
    largest = f32(torch.finfo(torch.float32).max)
    assert ulp_diff(largest, f32(math.inf)).tolist() == [1]


@pytest.mark.parametrize(("dtype", "mantissa_bits"), [(torch.bfloat16, 7), (torch.float16, 10)])
def test_ulp_counts_every_16_bit_float_exactly_once(dtype, mantissa_bits):
    values = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = values[torch.isfinite(values)].unique()  # sorted; +0 and -0 collapse to one value
    steps = ordinal(finite).diff()
    assert steps.min() == steps.max() == 1
    assert ulp_diff(torch.tensor([1.0], dtype=dtype), torch.tensor([2.0], dtype=dtype)).item() == 2 ** mantissa_bits


def test_measure_counts_bits_abs_and_ulps():
    three_up = torch.nextafter(f32(3.0), f32(4.0)).item()  # 3 + 2**-22: one fp32 ulp above 3
    result = measure(f32(1.0, 2.0, 0.0, 3.0), f32(1.0, 2.0, -0.0, three_up),
                     family="t", op="t", variation="t", source="dtype")
    assert result.bitwise_equal_frac == 0.5  # +0 vs -0 is a bitwise difference
    assert result.max_ulp_diff == 1
    assert result.max_abs_diff == pytest.approx(2 ** -22)
    assert max_ulp_diff(f32(), f32()) == 0


# ---- variations equal direct recomputations ---------------------------------------------------

def test_matmul_row_alone_vs_batch_is_what_a_direct_recomputation_finds():
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x_ND = torch.randn(32, 384, generator=gen).to(dtype)
        w_KD = (torch.randn(128, 384, generator=gen) / 20).to(dtype)
        result = matmul.batch_invariance(x_ND, w_KD, rows_per_call=1, op="down")
        batched_ND = F.linear(x_ND, w_KD)
        alone_ND = torch.stack([F.linear(x_ND[i][None], w_KD)[0] for i in range(32)])
        same = (alone_ND.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                == batched_ND.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        assert result.bitwise_equal_frac == same.double().mean().item()
        assert result.max_abs_diff == (alone_ND.double() - batched_ND.double()).abs().max().item()
        assert result.source == "batch_size" and result.variation == "each row alone vs in a batch of 32"


def test_norm_and_softmax_batch_probes_match_recomputation():
    gen = torch.Generator().manual_seed(2)
    x_ND = torch.randn(16, 128, generator=gen).to(torch.bfloat16)
    w_D = (1 + torch.randn(128, generator=gen) / 10).to(torch.bfloat16)
    alone = torch.cat([norm.rms_norm_hf(x_ND[i:i + 1], w_D) for i in range(16)])
    assert norm.batch_invariance(x_ND, w_D, rows_per_call=1, op="n").bitwise_equal_frac == \
        bitwise_equal(alone, norm.rms_norm_hf(x_ND, w_D)).double().mean().item()
    logits_NV = torch.randn(16, 1024, generator=gen) * 4
    alone = torch.cat([torch.log_softmax(logits_NV[i:i + 1], -1) for i in range(16)])
    assert softmax.batch_invariance(logits_NV, rows_per_call=1, op="s").bitwise_equal_frac == \
        bitwise_equal(alone, torch.log_softmax(logits_NV, -1)).double().mean().item()


def test_hf_rms_norm_matches_transformers_module():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(128, eps=norm.EPS).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(1 + torch.randn(128, generator=torch.Generator().manual_seed(3)) / 10)
        x_ND = torch.randn(8, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        assert torch.equal(norm.rms_norm_hf(x_ND, module.weight), module(x_ND))


# ---- the alternative algorithms compute the same function (differences are rounding only) ----

def test_attention_variants_agree_in_float64():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 16, 32, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 16, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    full = attention.prefill(q, k, v)
    torch.testing.assert_close(attention.decode(q, k, v), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(attention.chunked_prefill(q, k, v, 4), full, rtol=0, atol=1e-12)
    # HF's eager attention takes its softmax in fp32 whatever the input dtype, hence the looser bound.
    torch.testing.assert_close(attention.eager(q, k, v), full, rtol=0, atol=1e-6)
    split = attention.split_kv_decode(q, k, v, num_splits=3, positions=range(8, 16))
    torch.testing.assert_close(split, full[:, :, 8:16], rtol=0, atol=1e-12)


def test_split_k_sharded_softmax_and_sums_agree_in_float64():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(8, 96, generator=gen, dtype=torch.float64)
    w = torch.randn(16, 96, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(matmul.split_k(x, w, 4), F.linear(x, w), rtol=0, atol=1e-12)
    logits = torch.randn(4, 1000, generator=gen, dtype=torch.float64) * 4
    torch.testing.assert_close(softmax.sharded_log_softmax(logits, 3), torch.log_softmax(logits, -1),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(reductions.blocked_sum(x, 4), x.sum(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(norm.blocked_mean_square(4)(x), norm.mean_square(x), rtol=0, atol=1e-12)


def test_reduction_order_and_fma_on_hand_values():
    x = f32(1.0, 1e8, -1e8)[None]  # fp32 spacing at 1e8 is 8, so 1 + 1e8 == 1e8
    assert reductions.sequential_sum(x).item() == 0.0
    assert reductions.sequential_sum(x, reverse=True).item() == 1.0
    assert reductions.exact_sum(x).item() == 1.0
    a = f32(1 + 2 ** -12)  # a*a = 1 + 2**-11 + 2**-24: the last term is lost when a*a is rounded
    c = f32(-(1 + 2 ** -11))
    assert (a * a + c).item() == 0.0
    assert reductions.fma_reference(a, a, c).item() == 2 ** -24


def test_low_precision_partial_sums_differ_from_fp32_accumulation():
    # 1 + 256 x 2**-9 in bf16: each 2**-9 is under half a bf16 ulp of 1 (2**-8), so a bf16 running
    # sum never moves, while fp32 accumulation reaches 1.5.
    x = torch.cat([torch.ones(1), torch.full((256,), 2.0 ** -9)])[None].to(torch.bfloat16)
    assert reductions.sequential_sum(x).item() == 1.0
    assert x.float().sum().item() == 1.5


# ---- the runner ------------------------------------------------------------------------------

def test_run_probes_covers_every_family_and_source_and_is_deterministic():
    results = probes.run_probes(TINY, device="cpu", seed=0)
    # A dense model has no router, a model without gated delta rule layers no linear-attention probe.
    assert {r.family for r in results} == set(probes.FAMILIES) - {"router", "linear_attention"}
    assert {r.source for r in results} == set(SOURCES)
    tf32 = [r for r in results if r.source == "tf32"]
    assert tf32 and all(not r.applicable and "not applicable on cpu" in r.note for r in tf32)
    for r in results:
        if r.applicable:
            assert 0.0 <= r.bitwise_equal_frac <= 1.0 and r.num_elements > 0
            assert (r.max_abs_diff == 0) == (r.max_ulp_diff == 0)
            assert r.bitwise_equal_frac < 1.0 or r.max_abs_diff == 0
    # Lower precision always costs something on random inputs.
    assert all(r.max_abs_diff > 0 for r in results if r.source == "dtype")
    payload = json.dumps([r.to_dict() for r in results], allow_nan=False)
    again = json.dumps([r.to_dict() for r in probes.run_probes(TINY, device="cpu", seed=0)], allow_nan=False)
    assert payload == again
    assert len(probes.format_table(results).splitlines()) == len(results) + 1


def test_shapes_come_from_the_checkpoint_config(tiny_checkpoint):
    assert shapes_from_checkpoint(tiny_checkpoint) == TINY
    assert probes.run_probes(tiny_checkpoint, device="cpu", families=["norm"])[0].op == "rms_norm N=64 D=128"


def test_unknown_family_and_config_without_shapes_are_errors(tmp_path):
    with pytest.raises(MismatchError, match=r"^unknown probe family 'gemm' \(known: matmul, attention, norm, "
                                         r"softmax, reductions, router, linear_attention\)$"):
        probes.run_probes(TINY, families=["gemm"])
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="config.json: no 'num_attention_heads'; probes need"):
        shapes_from_checkpoint(tmp_path)


# ---- MoE, MLA and Gemma: config keys, the router probe, the shapes each architecture really runs -

def test_moe_mla_and_gemma_keys_are_read_as_transformers_names_them():
    mixtral = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336}
    assert moe_from_config(mixtral) == MoEShapes(num_experts=8, top_k=2, intermediate=14336)
    assert not has_dense_mlp(mixtral, moe_from_config(mixtral))  # Mixtral's intermediate_size is the expert's
    qwen = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
            "mlp_only_layers": [], "decoder_sparse_step": 1, "use_sliding_window": False, "sliding_window": 4096}
    assert moe_from_config(qwen).intermediate == 768 and not has_dense_mlp(qwen, moe_from_config(qwen))
    assert has_dense_mlp({**qwen, "mlp_only_layers": [0]}, moe_from_config(qwen))
    assert sliding_window_from_config(qwen) is None  # use_sliding_window switches Qwen's window off
    deepseek = {"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
                "moe_intermediate_size": 2048, "intermediate_size": 18432, "n_shared_experts": 1, "n_group": 8,
                "topk_group": 4, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": 1.0}}
    moe = moe_from_config(deepseek)  # no scoring_func: transformers' DeepseekV3 router is a sigmoid
    assert (moe.scoring, moe.shared_intermediate, moe.num_groups, moe.topk_groups) == ("sigmoid", 2048, 8, 4)
    assert has_dense_mlp(deepseek, moe)
    mla = mla_from_config(deepseek)
    assert mla.qk_head_dim == 192 and mla.q_lora_rank == 1536
    mscale = 0.1 * math.log(40) + 1.0
    assert attn_scale_from_config(deepseek, mla) == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)
    assert attn_scale_from_config({"query_pre_attn_scalar": 144}, None) == 144 ** -0.5
    assert sliding_window_from_config({"sliding_window": 512, "layer_types": ["full_attention"]}) is None
    assert sliding_window_from_config({"sliding_window": 512, "layer_types": ["sliding_attention"]}) == 512
    with pytest.raises(CheckpointError, match="scoring_func 'sparsemax' is not one the probes know"):
        moe_from_config({**mixtral, "scoring_func": "sparsemax"})


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_router_selection_is_transformers_router(arch, architecture_checkpoint):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(architecture_checkpoint(arch))
    shapes = shapes_from_checkpoint(architecture_checkpoint(arch))
    if arch == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Router,
        )
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeTopKRouter as Router,
        )
    module = Router(config)
    gen = torch.Generator().manual_seed(7)
    x_ND = torch.randn(256, shapes.hidden, generator=gen)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * shapes.hidden ** -0.5)
        bias_E = None
        if hasattr(module, "e_score_correction_bias"):
            bias_E = torch.randn(shapes.moe.num_experts, generator=gen) * 0.1
            module.e_score_correction_bias.copy_(bias_E)
        indices_NK = module(x_ND)[2].sort(-1).values
    ours_NK = router.select(router.scores(F.linear(x_ND, module.weight), shapes.moe), shapes.moe, bias_E)
    assert torch.equal(ours_NK, indices_NK)
    if bias_E is not None:  # the bias and the groups matter: without them other experts are picked
        plain = router.select(router.scores(F.linear(x_ND, module.weight), shapes.moe), shapes.moe, None)
        assert not torch.equal(plain, indices_NK)


def test_near_tie_router_flips_in_bf16_and_never_in_its_fp32_control():
    moe = MoEShapes(num_experts=8, top_k=2, intermediate=64)
    gen = torch.Generator().manual_seed(8)
    x_ND = torch.randn(512, 128, generator=gen)
    w_ED = torch.randn(8, 128, generator=gen) / 128 ** 0.5
    tied_gap = router.boundary_gap_ulps(router.scores(F.linear(router.near_ties(x_ND, w_ED, 2), w_ED), moe), 2)
    random_gap = router.boundary_gap_ulps(router.scores(F.linear(x_ND, w_ED), moe), 2)
    assert tied_gap.median() <= 8 and random_gap.median() > 1000  # the construction makes near-ties
    results = {r.variation: r for r in router.near_tie_probes(x_ND, w_ED, moe)}
    control = results["fp32 router vs the same fp32 router again (control: must not flip)"]
    bf16 = results["router GEMM in bfloat16 vs fp32"]
    assert control.num_flipped == 0 and control.bitwise_equal_frac == 1.0
    assert bf16.num_flipped > 512 // 10  # about half of all near-ties go either way
    assert bf16.flipped_frac == bf16.num_flipped / 512
    # On random inputs a bf16 router flips far fewer tokens: the near-tie variant is what finds them.
    plain = router.compare(F.linear(x_ND.bfloat16(), w_ED.bfloat16()), F.linear(x_ND, w_ED), moe, None,
                           op="r", variation="r", source="dtype")
    assert plain.num_flipped < bf16.num_flipped / 4


def _probe_json(checkpoint, tmp_path) -> list[dict]:
    out = tmp_path / "probes.json"
    assert main(["probe", str(checkpoint), "--device", "cpu", "--out", str(out)]) == 0
    return json.loads(out.read_text())["results"]


def _ops(results: list[dict], family: str) -> set[str]:
    return {r["op"] for r in results if r["family"] == family}


def test_probe_on_qwen3_moe_runs_the_experts_and_the_router(architecture_checkpoint, tmp_path, capsys):
    checkpoint = architecture_checkpoint("qwen3_moe")
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, num_experts, expert = config["hidden_size"], config["num_local_experts"], config["moe_intermediate_size"]
    results = _probe_json(checkpoint, tmp_path)
    matmuls = _ops(results, "matmul")
    assert {f"linear router {hidden}->{num_experts}", f"linear experts.down_proj {expert}->{hidden}"} <= matmuls
    assert any(op.endswith(f"experts.gate_up_proj {hidden}->{2 * expert}") for op in matmuls)
    # Every layer is MoE: the dense intermediate_size is in config.json but no layer runs it.
    assert not any(f"{hidden}->{config['intermediate_size']}" in op for op in matmuls)
    routers = [r for r in results if r["family"] == "router"]
    top_k = config["num_experts_per_tok"]
    assert f"router top-{top_k} of {num_experts} (softmax) N=512 D={hidden}" in _ops(results, "router")
    assert all(r["num_flipped"] is not None and r["flipped_frac"] == r["num_flipped"] / 512 for r in routers)
    near_bf16 = next(r for r in routers if r["op"].startswith("near-tie") and "bfloat16" in r["variation"])
    assert near_bf16["num_flipped"] > 0
    assert "top-k flipped for" in capsys.readouterr().out
    assert all(r["num_flipped"] is None for r in results if r["family"] != "router")


def test_probe_on_deepseek_v3_runs_mla_projections_and_grouped_sigmoid_routing(architecture_checkpoint, tmp_path):
    checkpoint = architecture_checkpoint("deepseek_v3")
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    results = _probe_json(checkpoint, tmp_path)
    projections = {part.split(" ")[0] for op in _ops(results, "matmul") for part in op.removeprefix("linear ").split("/")}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "router", "experts.down_proj",
            "shared_experts.down_proj", "down_proj"} <= projections  # first_k_dense_replace: a dense layer too
    assert not {"q_proj", "k_proj"} & projections  # MLA has no plain q/k/v projections
    matmuls = " | ".join(_ops(results, "matmul"))
    assert f"q_b_proj {config['q_lora_rank']}->{heads * qk}" in matmuls
    assert f"kv_a_proj_with_mqa {hidden}->{config['kv_lora_rank'] + config['qk_rope_head_dim']}" in matmuls
    kv_b = f"kv_b_proj {config['kv_lora_rank']}->{heads * (config['qk_nope_head_dim'] + config['v_head_dim'])}"
    assert kv_b in matmuls
    attention_ops = _ops(results, "attention")
    assert f"sdpa causal B=4 H={heads} KV={heads} L=64 d={qk} dv={config['v_head_dim']}" in attention_ops
    assert any(op.startswith(f"MLA causal B=4 H={heads} L=64 kv_lora_rank={config['kv_lora_rank']} ")
               for op in attention_ops)
    groups = f"best {config['topk_group']} of {config['n_group']} groups"
    assert any(f"(sigmoid, {groups}, selection bias)" in op for op in _ops(results, "router"))


def test_probe_on_gemma2_runs_soft_capped_and_sliding_window_attention(architecture_checkpoint, tmp_path):
    checkpoint = architecture_checkpoint("gemma2")
    config = json.loads((checkpoint / "config.json").read_text())
    results = _probe_json(checkpoint, tmp_path)
    attention_ops = _ops(results, "attention")
    cap, window = config["attn_logit_softcapping"], config["sliding_window"]
    assert any(op.startswith(f"eager causal soft-cap {cap:g} ") for op in attention_ops)
    assert any(op.startswith(f"eager sliding window {window} soft-cap {cap:g} ") for op in attention_ops)
    assert any(op.startswith(f"soft-cap {config['final_logit_softcapping']:g} then log_softmax")
               for op in _ops(results, "softmax"))
    dropped = next(r for r in results if r["variation"] == "soft-capping dropped (SDPA) vs applied")
    assert dropped["max_abs_diff"] > 0  # the cap changes the output: a kernel that drops it is not the model
    assert not _ops(results, "router")


def test_mla_absorbed_decode_sliding_and_soft_capped_attention_agree_in_float64():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 16, 24, generator=gen, dtype=torch.float64)  # d = 16 nope + 8 rope
    latent, k_rope = torch.randn(2, 16, 32, generator=gen, dtype=torch.float64), \
        torch.randn(2, 16, 8, generator=gen, dtype=torch.float64)
    w_uk, w_uv = torch.randn(4, 16, 32, generator=gen, dtype=torch.float64), \
        torch.randn(4, 12, 32, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(attention.mla_absorbed_decode(q, latent, k_rope, w_uk, w_uv, scale=0.2),
                               attention.mla_expanded_prefill(q, latent, k_rope, w_uk, w_uv, scale=0.2),
                               rtol=0, atol=1e-12)
    k, v = (torch.randn(2, 2, 16, 24, generator=gen, dtype=torch.float64) for _ in range(2))
    for window, cap in ((5, None), (None, 3.0), (5, 3.0)):
        full = attention.eager(q, k, v, scale=0.3, softcap=cap, window=window)
        # Eager's softmax is fp32 whatever the input dtype, hence the fp32-sized bound.
        torch.testing.assert_close(attention.windowed_decode(q, k, v, scale=0.3, softcap=cap, window=window,
                                                             positions=range(16)), full, rtol=0, atol=1e-6)
        torch.testing.assert_close(attention.fp32_scores(q, k, v, scale=0.3, softcap=cap, window=window)
                                   .double(), full, rtol=0, atol=1e-6)
    # The window and the cap each change the function: the variants are not the plain attention.
    plain = attention.eager(q, k, v, scale=0.3)
    assert not torch.allclose(attention.eager(q, k, v, scale=0.3, window=5), plain)
    assert not torch.allclose(attention.eager(q, k, v, scale=0.3, softcap=3.0), plain)
