"""Kernel probes: the ULP helper against hand values, each variation against a direct recomputation
or exact arithmetic, and the runner's coverage and JSON on the tiny model's shapes."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import probes
from mismatch.errors import CheckpointError, MismatchError
from probes import attention, matmul, norm, reductions, softmax
from probes.result import SOURCES, measure
from probes.shapes import ProbeShapes, shapes_from_checkpoint
from probes.ulp import bitwise_equal, max_ulp_diff, ordinal, ulp_diff

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
    assert {r.family for r in results} == set(probes.FAMILIES) - {"router"}  # a dense model has no router
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
                                         r"softmax, reductions, router\)$"):
        probes.run_probes(TINY, families=["gemm"])
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="config.json: no 'num_attention_heads'; probes need"):
        shapes_from_checkpoint(tmp_path)
