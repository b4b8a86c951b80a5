"""Layer localizer on the tiny checkpoint: planted weight faults are named, fp32 vs bf16, decode path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mismatch.engines import ReplayRequest, load_engine
from mismatch.errors import MismatchError, SpecError
from mismatch.localize.layers import _budget, block_kind, compare_layers, compare_layers_on_rollouts

EXAMPLE_ROLLOUTS = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
MAX_TOKENS = 160  # scored positions per comparison: enough signal, under a second each
SUB_BLOCKS = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]  # execution order


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def planted(src: Path, root: Path, tensor: str) -> Path:
    """Copy of the checkpoint with one tensor perturbed by 10% of its own spread."""
    dst = root / tensor
    if not dst.exists():
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        weight = tensors[tensor]
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        tensors[tensor] = weight + 0.1 * weight.std() * noise
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def layers(checkpoint: Path, a: str, b: str, max_tokens: int = MAX_TOKENS):
    return compare_layers_on_rollouts(checkpoint, EXAMPLE_ROLLOUTS, a=a, b=b, max_tokens=max_tokens)


@pytest.mark.parametrize(("tensor", "layer", "block", "module"), [
    ("model.layers.1.mlp.down_proj.weight", 1, "mlp", "mlp"),
    ("model.layers.0.post_attention_layernorm.weight", 0, "norm", "post_attention_layernorm"),
    ("model.layers.1.self_attn.o_proj.weight", 1, "attn", "self_attn"),
])
def test_planted_weight_fault_is_named_by_layer_and_sub_block(tiny_checkpoint, tmp_path_factory, tensor, layer,
                                                              block, module) -> None:
    faulty = planted(tiny_checkpoint, tmp_path_factory.mktemp("faults"), tensor)
    report = layers(tiny_checkpoint, f"hf:dtype=float32,checkpoint={faulty}", "hf:dtype=float32")
    assert (report.jump_layer, report.jump_block, report.jump_module) == (layer, block, module)
    assert report.num_tokens == MAX_TOKENS and report.embed_rel_error == 0.0
    step = [*SUB_BLOCKS, "output"].index
    for row in report.by_layer:
        if (row.layer, step(row.module)) < (layer, step(module)):  # upstream of the fault: bit for bit
            assert row.rel_error == 0.0, row
        if row.block != "residual":  # only the faulty sub-block introduces error of its own
            assert (row.local_rel_error > 0) == ((row.layer, row.module) == (layer, module)), row
    faulty_row = report.row(layer, module)
    assert faulty_row.local_rel_error > 1e-3 and faulty_row.input_rel_error == 0.0
    assert report.residual()[-1].logit_lens_abs_diff > 1e-4


def test_fp32_vs_bf16_is_small_but_nonzero_in_every_layer(tiny_checkpoint) -> None:
    report = layers(tiny_checkpoint, "hf:dtype=bfloat16", "hf:dtype=float32")
    assert 0 < report.embed_rel_error < 2.0 ** -8  # bf16 rounding of the embedding table
    for row in report.by_layer:
        assert 0 < row.rel_error < 0.02, row
        if row.block == "residual":
            assert 0 < row.logit_lens_abs_diff < 0.05, row
        else:
            assert row.local_rel_error > 0, row  # every sub-block rounds in bf16
    assert report.jump_layer in (0, 1) and report.jump_block in ("attn", "mlp", "norm")


def test_identical_configurations_agree_bit_for_bit(tiny_checkpoint) -> None:
    report = layers(tiny_checkpoint, "hf:dtype=float32", "hf:dtype=float32", max_tokens=48)
    assert all(row.rel_error == 0.0 and row.rel_error_token_max == 0.0 for row in report.by_layer)
    assert (report.jump_layer, report.jump_block) == (None, None)
    summary = report.to_dict()
    json.dumps(summary, allow_nan=False)
    assert [(r["layer"], r["module"]) for r in summary["by_layer"]] == \
        [(i, m) for i in (0, 1) for m in [*SUB_BLOCKS, "output"]]
    assert summary["output_logp_abs_diff_mean"] == 0.0


def test_last_layer_logit_lens_is_the_engines_own_logprob(tiny_checkpoint) -> None:
    rng = np.random.default_rng(0)
    token_lists = [rng.integers(10, 1000, 40), rng.integers(10, 1000, 25)]
    report = compare_layers(tiny_checkpoint, token_lists, a="hf-decode:dtype=float32", b="hf:dtype=float32")
    assert report.num_sequences == 2 and report.num_tokens == 39 + 24
    requests = [ReplayRequest(tokens=t, generated=np.arange(len(t)) > 0, score_from=1) for t in token_lists]
    expected = {}
    for spec in ("hf:dtype=float32", "hf-decode:dtype=float32"):
        engine = load_engine(spec, str(tiny_checkpoint))
        # One request per call: the localizer runs sequences alone, the hf engine would batch them.
        expected[spec] = np.concatenate([engine.replay([r])[0] for r in requests]).mean()
        engine.close()
    last = report.residual()[-1]
    assert last.logit_lens_logp_b == pytest.approx(expected["hf:dtype=float32"], abs=1e-9)
    assert last.logit_lens_logp_a == pytest.approx(expected["hf-decode:dtype=float32"], abs=1e-6)


def test_decode_path_is_hooked_position_by_position(tiny_checkpoint, tmp_path_factory) -> None:
    # fp32 decode vs fp32 full forward: only rounding apart, so captures line up position by position.
    report = layers(tiny_checkpoint, "hf-decode:dtype=float32", "hf:dtype=float32")
    assert all(row.rel_error < 1e-5 for row in report.by_layer)
    assert report.row(0, "self_attn").local_rel_error > 0  # the KV-cached attention kernel differs
    assert report.row(0, "input_layernorm").local_rel_error == 0.0  # a norm of one row is a norm
    # A fault on the decode side (or on the reference side) is still found where it is.
    faulty = planted(tiny_checkpoint, tmp_path_factory.mktemp("faults"), "model.layers.1.mlp.down_proj.weight")
    for a, b in [(f"hf-decode:dtype=float32,checkpoint={faulty}", "hf:dtype=float32"),
                 ("hf:dtype=float32", f"hf-decode:dtype=float32,checkpoint={faulty}")]:
        report = layers(tiny_checkpoint, a, b, max_tokens=64)
        assert (report.jump_layer, report.jump_block) == (1, "mlp")


def test_bf16_decode_vs_full_forward_is_introduced_by_attention(tiny_checkpoint) -> None:
    """The prefill/decode mismatch: the MLP's output differs more, but only by what it inherits."""
    report = layers(tiny_checkpoint, "hf-decode:dtype=bfloat16", "hf:dtype=bfloat16")
    assert report.jump_block == "attn" and report.jump_module == "self_attn"
    for layer in (0, 1):
        attn, mlp = report.row(layer, "self_attn"), report.row(layer, "mlp")
        assert attn.local_rel_error > 10 * mlp.local_rel_error
        assert mlp.rel_error > attn.local_rel_error  # inherited error dominates what the MLP shows


def test_budget_cuts_the_last_sequence_and_skips_unscored_ones() -> None:
    def request(length: int, score_from: int) -> ReplayRequest:
        return ReplayRequest(tokens=np.arange(length), generated=np.ones(length, bool), score_from=score_from)

    kept = _budget([request(1, 0), request(10, 4), request(10, 10), request(20, 0), request(5, 1)], 10)
    assert [(len(r.tokens), r.score_from) for r in kept] == [(10, 4), (5, 0)]
    assert sum(len(r.tokens) - max(r.score_from, 1) for r in kept) == 10
    with pytest.raises(MismatchError, match="needs at least one sequence with a scored token"):
        _budget([request(1, 0)], 10)


def test_block_kinds() -> None:
    linear = torch.nn.Linear(2, 2)
    assert [block_kind(n, linear) for n in ["input_layernorm", "post_attention_layernorm", "self_attn",
                                            "mlp", "pre_feedforward_layernorm", "dropout"]] == \
        ["norm", "norm", "attn", "mlp", "norm", None]
    # Phi-3's residual dropouts carry "attn" and "mlp" in their names.
    dropout = torch.nn.Dropout(0.0)
    assert [block_kind(n, dropout) for n in ["resid_attn_dropout", "resid_mlp_dropout"]] == [None, None]


def test_non_torch_engines_and_bad_tokens_are_refused(tiny_checkpoint) -> None:
    with pytest.raises(SpecError) as err:
        compare_layers(tiny_checkpoint, [[1, 2, 3]], a="sampler", b="hf")
    assert str(err.value) == ("--a sampler: the layer localizer hooks torch models; use an engine of kind "
                              "hf or hf-decode (e.g. hf:dtype=bfloat16), not 'stored'")
    with pytest.raises(MismatchError, match=r"^token id 5000 is outside the vocabulary \(1024 ids\) of hf$"):
        compare_layers(tiny_checkpoint, [[1, 2, 5000]], a="hf", b="hf")
