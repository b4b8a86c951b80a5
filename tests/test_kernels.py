"""Module-local error (mismatch.localize.kernels) on the tiny checkpoint: exact zeros where nothing
changes, the changed kernel and only it where one thing changes, stable ranks, clean spec errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mismatch.checkpoint import load_tokenizer
from mismatch.errors import MismatchError, SpecError
from mismatch.localize.kernels import budgeted, module_local_errors

CORPUS = Path(__file__).resolve().parents[1] / "mismatch" / "demo" / "corpus.txt"
ALL_TYPES = {"Embedding", "Linear", "RMSNorm", "RoPE", "attention", "SiLU-mul", "lm_head+log_softmax"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def token_lists(tiny_checkpoint: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_checkpoint)
    lines = [line for line in CORPUS.read_text().splitlines() if line and not line.startswith("#")]
    return [tokenizer.encode(" ".join(lines[i:i + 6])) for i in range(0, 24, 6)]


@pytest.fixture(scope="module")
def bf16_report(tiny_checkpoint: Path, token_lists: list[list[int]]):
    return module_local_errors(tiny_checkpoint, token_lists, candidate="hf:dtype=bfloat16", max_tokens=192)


def test_same_configuration_has_exactly_zero_error_everywhere(tiny_checkpoint, token_lists):
    report = module_local_errors(tiny_checkpoint, token_lists, reference="hf:dtype=float32",
                                 candidate="hf:dtype=float32", max_tokens=192)
    assert {m.type for m in report.by_module} == ALL_TYPES
    assert sum(m.type == "Linear" for m in report.by_module) == 14  # 7 projections x 2 layers
    assert sum(m.type == "RMSNorm" for m in report.by_module) == 5  # 2 per layer + final
    assert [(m.name, m.rel_error, m.max_abs) for m in report.by_module if m.rel_error or m.max_abs] == []
    assert report.num_tokens == 192


def test_bf16_candidate_shows_error_in_every_linear(bf16_report):
    linears = [m for m in bf16_report.by_module if m.type == "Linear"]
    assert linears and all(m.rel_error > 0 and m.max_abs > 0 for m in linears)
    assert all(m.rounding_floor > 0 for m in linears)  # bf16 cannot hold the fp32 outputs
    lm_head = next(m for m in bf16_report.by_module if m.type == "lm_head+log_softmax")
    assert lm_head.max_abs > 0 and lm_head.rounding_floor is None
    errors = [m.rel_error for m in bf16_report.by_module]
    assert errors == sorted(errors, reverse=True)
    by_type = bf16_report.to_dict()["by_type"]
    assert [t["rel_error"] for t in by_type] == sorted((t["rel_error"] for t in by_type), reverse=True)


def test_ranks_are_identical_across_reruns(tiny_checkpoint, token_lists, bf16_report):
    again = module_local_errors(tiny_checkpoint, token_lists, candidate="hf:dtype=bfloat16", max_tokens=192)
    assert again.to_dict() == bf16_report.to_dict()


def test_to_dict_is_strict_json(bf16_report):
    data = json.loads(json.dumps(bf16_report.to_dict(), allow_nan=False))
    assert data["reference"] == "hf:dtype=float32" and data["candidate"] == "hf:dtype=bfloat16"
    assert set(data["by_module"][0]) == {"name", "type", "rel_error", "max_abs", "rounding_floor",
                                         "num_elements"}


def test_eager_attention_changes_only_attention(tiny_checkpoint, token_lists):
    # In an end-to-end comparison everything after the first attention would differ; fed the
    # reference's inputs, only the attention kernels do.
    report = module_local_errors(tiny_checkpoint, token_lists, candidate="hf:attn=eager", max_tokens=192)
    nonzero = {m.name: m.type for m in report.by_module if m.rel_error > 0}
    assert nonzero == {"model.layers.0.self_attn": "attention", "model.layers.1.self_attn": "attention"}
    assert all(m.max_abs == 0 for m in report.by_module if m.type != "attention")


def test_planted_weight_fault_is_the_only_module_with_error(tiny_checkpoint, token_lists, tmp_path):
    faulty = tmp_path / "faulty"
    shutil.copytree(tiny_checkpoint, faulty)
    weights = load_file(faulty / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight"
    weights[key] = weights[key] + 1e-3 * torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, faulty / "model.safetensors", metadata={"format": "pt"})
    report = module_local_errors(tiny_checkpoint, token_lists, candidate=f"hf:checkpoint={faulty}",
                                 max_tokens=128)
    assert report.by_module[0].name == "model.layers.1.mlp.up_proj"
    assert report.by_module[0].rel_error > 1e-4
    assert all(m.rel_error == 0 for m in report.by_module[1:])


def test_non_hf_specs_are_rejected_with_a_clear_message(tiny_checkpoint, token_lists):
    with pytest.raises(SpecError, match=r"^module-local errors need torch configurations of kind 'hf' "
                                        r"\(e\.g\. hf:dtype=bfloat16\), got 'hf-decode:dtype=bfloat16'$"):
        module_local_errors(tiny_checkpoint, token_lists, candidate="hf-decode:dtype=bfloat16")
    with pytest.raises(SpecError, match="unknown option 'dtyp'"):
        module_local_errors(tiny_checkpoint, token_lists, candidate="hf:dtyp=bfloat16")
    with pytest.raises(MismatchError, match="at least one sequence of 2 or more tokens"):
        module_local_errors(tiny_checkpoint, [[5]], candidate="hf:dtype=bfloat16")


def test_budget_cuts_the_last_sequence_and_skips_single_tokens():
    assert budgeted([[1, 2, 3], [4], [5, 6, 7, 8]], 6) == [[1, 2, 3], [5, 6, 7]]
    assert budgeted([[1, 2, 3], [4, 5, 6]], 4) == [[1, 2, 3]]  # one token left: no prediction
    assert budgeted([[1]], 10) == []
