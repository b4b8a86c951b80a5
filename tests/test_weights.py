"""Checkpoint diff (weight sync) on copies of the tiny checkpoint with planted faults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mismatch import weights
from mismatch.errors import CheckpointError
from mismatch.weights import diff_checkpoints

FAULT = "model.layers.1.mlp.down_proj.weight"


def edited_copy(src: Path, dst: Path, edit) -> Path:
    """Copy of checkpoint `src` whose tensors dict went through `edit` (in place) before saving."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def plant_fault(tensors: dict[str, torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = tensors[FAULT]
    tensors[FAULT] = weight + 0.1 * weight.std() * torch.randn(weight.shape, generator=generator)


def test_identical_copies_are_all_equal(tiny_checkpoint, tmp_path) -> None:
    copy = shutil.copytree(tiny_checkpoint, tmp_path / "copy")
    report = diff_checkpoints(tiny_checkpoint, copy)
    assert report.identical and report.worst is None
    assert len(report.tensors) == 21 and not report.only_a and not report.only_b
    assert all(t.equal and t.max_abs_diff == 0.0 and t.bitwise_equal_frac == 1.0 for t in report.tensors)
    summary = report.to_dict()["summary"]
    assert summary["n_differing"] == 0 and summary["n_equal"] == 21 and summary["identical"]


def test_planted_fault_is_the_one_tensor_named(tiny_checkpoint, tmp_path) -> None:
    faulty = edited_copy(tiny_checkpoint, tmp_path / "faulty", plant_fault)
    report = diff_checkpoints(tiny_checkpoint, faulty)
    assert [t.name for t in report.differing] == [FAULT]
    assert report.worst.name == FAULT and not report.identical
    expected = (load_file(tiny_checkpoint / "model.safetensors")[FAULT]
                - load_file(faulty / "model.safetensors")[FAULT]).abs().max().item()
    assert report.worst.max_abs_diff == expected
    assert report.worst.bitwise_equal_frac < 0.01 and report.worst.dtype_a == report.worst.dtype_b == "float32"
    as_dict = report.to_dict()
    assert as_dict["differing"] == [FAULT] and as_dict["summary"]["worst"]["name"] == FAULT
    json.dumps(as_dict, allow_nan=False)


def test_bf16_cast_copy_shows_dtype_mismatches_and_small_diffs(tiny_checkpoint, tmp_path) -> None:
    def to_bf16(tensors):
        tensors.update({name: t.to(torch.bfloat16) for name, t in tensors.items()})

    cast = edited_copy(tiny_checkpoint, tmp_path / "bf16", to_bf16)
    report = diff_checkpoints(tiny_checkpoint, cast)
    summary = report.to_dict()["summary"]
    assert summary["n_dtype_mismatch"] == summary["n_differing"] == 21
    for tensor in report.tensors:
        assert (tensor.dtype_a, tensor.dtype_b) == ("float32", "bfloat16")
        assert 0 < tensor.max_rel_diff <= 2.0 ** -8  # round to nearest bf16: half an ulp of 8 bits
        assert tensor.bitwise_equal_frac < 0.05
    # Casting back is lossless, so the bf16 copy and its fp32 upcast agree value for value.
    back = edited_copy(cast, tmp_path / "back", lambda ts: ts.update({n: t.float() for n, t in ts.items()}))
    upcast = diff_checkpoints(cast, back)
    assert all(t.bitwise_equal_frac == 1.0 and t.max_abs_diff == 0.0 and not t.equal for t in upcast.tensors)


def test_renamed_and_reshaped_tensors(tiny_checkpoint, tmp_path) -> None:
    def rename_and_transpose(tensors):
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name + "_renamed"] = tensors.pop(name)
        tensors["lm_head.weight"] = tensors["lm_head.weight"].T.contiguous()

    edited = edited_copy(tiny_checkpoint, tmp_path / "edited", rename_and_transpose)
    report = diff_checkpoints(tiny_checkpoint, edited)
    assert report.only_a == ("model.layers.0.mlp.down_proj.weight",)
    assert report.only_b == ("model.layers.0.mlp.down_proj.weight_renamed",)
    head = next(t for t in report.tensors if t.name == "lm_head.weight")
    assert head.shape_mismatch and head.shape_a == (1024, 128) and head.shape_b == (128, 1024)
    assert head.max_abs_diff is None and not head.equal
    assert report.to_dict()["shape_mismatches"] == ["lm_head.weight"]
    assert [t.name for t in report.differing] == ["lm_head.weight"]


def test_sharded_checkpoint_is_read_through_its_index(tiny_checkpoint, tmp_path) -> None:
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, sharded / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, members in shards.items() for n in members}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert diff_checkpoints(tiny_checkpoint, sharded).identical
    index["weight_map"][names[0]] = "model-00003-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        diff_checkpoints(tiny_checkpoint, sharded)
    assert str(err.value) == (f"{sharded / 'model.safetensors.index.json'}: names shard "
                              "'model-00003-of-00002.safetensors', which does not exist")


def test_tensors_stream_in_chunks_with_the_same_answer(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    faulty = edited_copy(tiny_checkpoint, tmp_path / "faulty", plant_fault)
    whole = diff_checkpoints(tiny_checkpoint, faulty)
    sizes: list[int] = []
    compare = weights._compare
    monkeypatch.setattr(weights, "_compare", lambda a, b, row: sizes.append(a.numel()) or compare(a, b, row))
    chunked = diff_checkpoints(tiny_checkpoint, faulty, chunk_elements=1000)
    assert chunked == whole
    # Whole rows only: 7 rows of 128 (896 elements) is the biggest piece under 1000.
    assert max(sizes) == 896 and len(sizes) > 21 * 10


def test_bits_not_values_for_same_dtype(tmp_path) -> None:
    save_file({"x": torch.tensor([0.0, float("nan"), 1.0, float("inf")])}, tmp_path / "a.safetensors")
    save_file({"x": torch.tensor([-0.0, float("nan"), 1.0, float("inf")])}, tmp_path / "b.safetensors")
    (tensor,) = diff_checkpoints(tmp_path / "a.safetensors", tmp_path / "b.safetensors").tensors
    assert tensor.bitwise_equal_frac == 0.75 and not tensor.equal  # -0.0 has other bits
    assert tensor.max_abs_diff == 0.0 and tensor.max_rel_diff == 0.0  # but the same value
    save_file({"x": torch.tensor([0.0, 1.0, 2.0, float("nan")])}, tmp_path / "c.safetensors")
    (tensor,) = diff_checkpoints(tmp_path / "a.safetensors", tmp_path / "c.safetensors").tensors
    assert tensor.max_abs_diff == float("inf") and tensor.bitwise_equal_frac == 0.25


def test_bad_checkpoints_are_one_line_errors(tiny_checkpoint, tmp_path) -> None:
    with pytest.raises(CheckpointError) as err:
        diff_checkpoints(tmp_path / "nope", tiny_checkpoint)
    assert str(err.value) == f"{tmp_path / 'nope'}: checkpoint directory not found"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(CheckpointError, match=r"weights are pickle files \(\.bin/\.pt\)"):
        diff_checkpoints(tiny_checkpoint, pickled)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError) as err:
        diff_checkpoints(empty, tiny_checkpoint)
    assert str(err.value) == f"{empty}: no *.safetensors weights"
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(CheckpointError) as err:
        diff_checkpoints(tiny_checkpoint, garbage)
    message = str(err.value)
    assert message.startswith(f"{garbage / 'model.safetensors'}: not a readable safetensors file (")
    assert "\n" not in message


def test_a_cast_copy_is_recognized_in_one_line(tiny_checkpoint, tmp_path) -> None:
    cast = edited_copy(tiny_checkpoint, tmp_path / "bf16",
                       lambda ts: ts.update({name: t.to(torch.bfloat16) for name, t in ts.items()}))
    summary = diff_checkpoints(tiny_checkpoint, cast).to_dict()["summary"]
    assert summary["n_cast"] == 21
    assert summary["verdict"] == "b is a cast to bfloat16 of a (every differing tensor, nothing else changed)"
    faulty = edited_copy(cast, tmp_path / "bf16-faulty", plant_fault)
    assert diff_checkpoints(tiny_checkpoint, faulty).to_dict()["summary"]["verdict"].startswith("21 tensor(s) differ")


def test_a_tied_lm_head_saved_on_one_side_is_no_difference(tiny_checkpoint, tmp_path, capsys) -> None:
    from mismatch.cli import main

    def tie(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    tied = edited_copy(tiny_checkpoint, tmp_path / "tied", tie)
    dropped = edited_copy(tied, tmp_path / "dropped", lambda ts: ts.pop("lm_head.weight"))
    report = diff_checkpoints(tied, dropped)
    assert report.only_a == ("lm_head.weight",) and report.tied == ("lm_head.weight",) and report.identical
    assert main(["weights", str(tied), str(dropped), "--fail-on-diff"]) == 0
    assert "identical (tied copies: lm_head.weight)" in capsys.readouterr().out
    other = edited_copy(dropped, tmp_path / "other",
                        lambda ts: ts.update({"model.embed_tokens.weight": ts["model.embed_tokens.weight"] * 1.01}))
    assert not diff_checkpoints(tied, other).identical  # lm_head no longer the other side's embedding


def test_stacked_experts_are_named_by_expert(tmp_path) -> None:
    generator = torch.Generator().manual_seed(0)
    experts = torch.randn(8, 16, 4, generator=generator)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"model.layers.1.mlp.experts.down_proj": experts}, str(a))
    changed = experts.clone()
    changed[5, 3, 1] += 0.5
    save_file({"model.layers.1.mlp.experts.down_proj": changed}, str(b))
    report = diff_checkpoints(a, b, chunk_elements=64)  # experts spread over several chunks
    tensor = report.to_dict()["tensors"][0]
    assert tensor["experts_differing"] == [5] and tensor["by_expert"][5] == pytest.approx(0.5)
    assert report.verdict == ("1 tensor(s) differ, worst model.layers.1.mlp.experts.down_proj; "
                              "experts: model.layers.1.mlp.experts.down_proj[5]")


def _fused(tensors: dict[str, torch.Tensor]) -> None:
    """The per-expert projections of every MoE layer as transformers >= 5 fuses them in memory:
    experts.gate_up_proj [experts, 2 x intermediate, hidden] (gate, then up), experts.down_proj."""
    prefixes = sorted({name.split(".experts.")[0] + ".experts" for name in tensors if ".experts." in name})
    for prefix in prefixes:
        count = 1 + max(int(name[len(prefix) + 1:].split(".")[0]) for name in tensors if name.startswith(prefix + "."))
        take = [[tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(count)] for proj in ("gate_proj", "up_proj", "down_proj")]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(take[0], take[1])])
        tensors[f"{prefix}.down_proj"] = torch.stack(take[2])


def test_per_expert_and_fused_expert_layouts_are_matched(architecture_checkpoint, tmp_path, capsys) -> None:
    """One side saves each expert's projections, the other the fused tensors: compared expert by
    expert, so the same weights are identical and a fault in one expert is named by its index."""
    from mismatch.cli import main

    checkpoint = architecture_checkpoint("qwen3_moe")  # saved per expert: experts.N.gate_proj.weight
    fused = edited_copy(checkpoint, tmp_path / "fused", _fused)
    report = diff_checkpoints(checkpoint, fused)
    assert report.identical and report.regrouped == ("model.layers.0.mlp.experts.down_proj",
                                                     "model.layers.0.mlp.experts.gate_up_proj",
                                                     "model.layers.1.mlp.experts.down_proj",
                                                     "model.layers.1.mlp.experts.gate_up_proj")
    assert report.verdict == "identical (4 fused expert tensor(s) matched to per-expert ones)"

    def fault(tensors: dict[str, torch.Tensor]) -> None:
        _fused(tensors)
        tensors["model.layers.1.mlp.experts.gate_up_proj"][5, 70] += 0.01  # expert 5's up_proj, row 6

    faulty = edited_copy(checkpoint, tmp_path / "faulty", fault)
    report = diff_checkpoints(faulty, checkpoint)  # the fused side first this time
    [differing] = report.differing
    assert differing.name == "model.layers.1.mlp.experts.gate_up_proj" and not report.only_a and not report.only_b
    assert [e for e, diff in enumerate(differing.by_expert) if diff] == [5]
    assert report.verdict.endswith("experts: model.layers.1.mlp.experts.gate_up_proj[5]")
    assert main(["weights", str(checkpoint), str(faulty), "--fail-on-diff"]) != 0
    assert "model.layers.1.mlp.experts.gate_up_proj[5]" in capsys.readouterr().out


def _adam_step(tensors: dict[str, torch.Tensor]) -> None:
    """One Adam step's worth of change: every element moves by about the learning rate (its
    first step is lr x the gradient's sign), whatever the tensor's scale."""
    generator = torch.Generator().manual_seed(1)
    for name, weight in tensors.items():
        tensors[name] = weight - 1e-5 * torch.randn(weight.shape, generator=generator).sign()


def test_a_copy_one_optimizer_step_stale_is_recognized_in_one_line(tiny_checkpoint, tmp_path) -> None:
    stale = edited_copy(tiny_checkpoint, tmp_path / "stale", _adam_step)
    report = diff_checkpoints(tiny_checkpoint, stale)
    assert len(report.differing) == len(report.tensors) == 21 and report.optimizer_step is not None
    assert report.verdict.startswith("b looks like a by-one-optimizer-step stale copy of a: every tensor moved, "
                                     "by the same small amount (rms |a-b| 1.0e-05..1.0e-05")
    assert report.to_dict()["summary"]["optimizer_step"] is True
    # Not a stale step: a fault in one tensor on top of it, every tensor rescaled, one tensor untouched.
    for name, edit in {
        "fault": lambda t: (_adam_step(t), plant_fault(t)),
        "rescaled": lambda t: t.update({k: v * 1.001 for k, v in t.items()}),
        "one_kept": lambda t: (lambda kept: (_adam_step(t), t.update({FAULT: kept})))(t[FAULT].clone()),
    }.items():
        report = diff_checkpoints(tiny_checkpoint, edited_copy(tiny_checkpoint, tmp_path / name, edit))
        assert report.optimizer_step is None and "optimizer" not in report.verdict, name
