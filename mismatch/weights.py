"""Checkpoint diff for weight sync: two safetensors checkpoints compared tensor by tensor, streaming.

Runs before any replay (`mismatch weights A B`): did the engine load what the trainer exported?
Only one chunk of one tensor pair is in memory at a time; sharded checkpoints follow their index.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.errors import CheckpointError
from mismatch.results import json_safe

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_CHUNK_ELEMENTS = 1 << 22  # elements per side per step: 16 MiB each in fp32
# A stale copy by one optimizer step: each tensor moved by at most this part of its norm, and the
# tensors' rms moves within this factor of each other (Adam moves every element by about lr).
STEP_MAX_REL = 1e-2
STEP_MAX_SPREAD = 20.0

# safetensors' dtype codes, named as torch names them.
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorDiff:
    """One tensor present in both checkpoints."""

    name: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    equal: bool                  # same dtype, same shape, same bytes
    num_elements: int            # of A
    # The rest is None when the shapes differ (nothing to compare element by element).
    max_abs_diff: float | None   # max |a - b|, both upcast (fp32, or fp64 for 64-bit/integer tensors)
    max_rel_diff: float | None   # max |a - b| / max(|a|, |b|), 0 where a == b: in [0, 2], no eps
    # Same dtype: fraction of elements with identical bits. Different dtypes: fraction whose
    # upcast values are identical (what a lossless cast would give: bf16 -> fp32 keeps all).
    bitwise_equal_frac: float | None
    # Different dtypes: whether the lower-precision side is exactly the other cast to its dtype
    # (round to nearest even, as torch casts): a sync that cast, not one that corrupted.
    is_cast: bool | None = None
    # Stacked experts (a 3-D "...experts..." tensor, experts first): max |a - b| per expert.
    by_expert: tuple[float, ...] | None = None
    rms_diff: float | None = None     # sqrt(mean (a - b)^2): what one optimizer step moves
    rel_l2_diff: float | None = None  # ||a - b|| / ||a||

    @property
    def dtype_mismatch(self) -> bool:
        return self.dtype_a != self.dtype_b

    @property
    def shape_mismatch(self) -> bool:
        return self.shape_a != self.shape_b

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "equal": self.equal, "dtype_a": self.dtype_a, "dtype_b": self.dtype_b,
               "shape_a": list(self.shape_a), "shape_b": list(self.shape_b),
               "num_elements": self.num_elements, "max_abs_diff": self.max_abs_diff,
               "max_rel_diff": self.max_rel_diff, "bitwise_equal_frac": self.bitwise_equal_frac,
               "rms_diff": self.rms_diff, "rel_l2_diff": self.rel_l2_diff, "is_cast": self.is_cast}
        if self.by_expert is not None:
            out["by_expert"] = list(self.by_expert)
            out["experts_differing"] = [e for e, diff in enumerate(self.by_expert) if diff != 0.0]
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class WeightsReport:
    a: str
    b: str
    tensors: tuple[TensorDiff, ...]  # every name in both, sorted
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    # Names on one side only that are a tied copy of the other side's embedding (an lm_head.weight
    # saved for a model that ties it): the same weights, not a difference.
    tied: tuple[str, ...] = ()
    # Fused expert tensors (experts.gate_up_proj, experts.down_proj) one side saved per expert
    # (experts.N.gate_proj/up_proj/down_proj or w1/w3/w2): compared as the fused tensor, expert by expert.
    regrouped: tuple[str, ...] = ()

    @property
    def differing(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if not t.equal)

    @property
    def identical(self) -> bool:
        """Same tensor names (tied copies aside), and every tensor bit for bit the same."""
        untied = set(self.only_a + self.only_b) - set(self.tied)
        return not (untied or self.differing)

    @property
    def verdict(self) -> str:
        """The whole comparison in one line."""
        notes = [*([f"tied copies: {', '.join(self.tied)}"] if self.tied else []),
                 *([f"{len(self.regrouped)} fused expert tensor(s) matched to per-expert ones"] if self.regrouped else [])]
        if self.identical:
            return "identical" + (f" ({'; '.join(notes)})" if notes else "")
        casts = [t for t in self.differing if t.is_cast]
        if casts and len(casts) == len(self.differing) and not (set(self.only_a + self.only_b) - set(self.tied)):
            dtypes = sorted({min(t.dtype_a, t.dtype_b, key=_precision) for t in casts})
            return f"b is a cast to {', '.join(dtypes)} of a (every differing tensor, nothing else changed)"
        step = self.optimizer_step
        if step is not None:
            return (f"b looks like a by-one-optimizer-step stale copy of a: every tensor moved, by the same "
                    f"small amount (rms |a-b| {step[0]:.1e}..{step[1]:.1e}, at most {step[2]:.1e} of a "
                    "tensor's norm), not a localized fault")
        experts = [f"{t.name}[{e}]" for t in self.differing if t.by_expert
                   for e, diff in enumerate(t.by_expert) if diff != 0.0]
        worst = self.worst
        where = f"; experts: {', '.join(experts[:8])}" if experts else ""
        return (f"{len(self.differing)} tensor(s) differ" + (f", worst {worst.name}" if worst else "") + where)

    @property
    def optimizer_step(self) -> tuple[float, float, float] | None:
        """(smallest rms |a-b|, largest, largest ||a-b||/||a||) when b is a plausible one optimizer
        step away from a, else None. An Adam step moves every element of every tensor by about the
        learning rate: every floating tensor changed in most of its elements, each by a small part
        of its norm, and by rms amounts of one order (a fault is local; a rescale moves each tensor
        by its own norm, tensors of different scales by different amounts)."""
        floats = [t for t in self.tensors if t.dtype_a.startswith(("float", "bfloat")) and t.num_elements]
        if (set(self.only_a + self.only_b) - set(self.tied) or len(floats) < 2
                or any(t.shape_mismatch or t.dtype_mismatch for t in self.tensors)):
            return None
        if any(t.equal or t.bitwise_equal_frac > 0.5 or t.rms_diff is None or t.rel_l2_diff is None
               or not t.rel_l2_diff <= STEP_MAX_REL for t in floats):
            return None
        low, high = min(t.rms_diff for t in floats), max(t.rms_diff for t in floats)
        if not 0 < low or high > STEP_MAX_SPREAD * low:
            return None
        return low, high, max(t.rel_l2_diff for t in floats)

    @property
    def worst(self) -> TensorDiff | None:
        """The differing tensor with the largest max |a - b| (shape mismatches aside)."""
        scored = [t for t in self.differing if t.max_abs_diff is not None]
        return max(scored, key=lambda t: (t.max_abs_diff, t.name), default=None)

    def brief(self, limit: int = 20) -> dict[str, Any]:
        """summary.json `weights[source]`: the verdict and the differing tensors, most changed first
        (by ||a-b||/||a||), each with the experts that differ in a stacked expert tensor."""
        ranked = sorted(self.differing, key=lambda t: (-(t.rel_l2_diff if t.rel_l2_diff is not None else math.inf),
                                                       t.name))
        return json_safe({"a": self.a, "b": self.b, "identical": self.identical, "verdict": self.verdict,
                          "n_differing": len(self.differing), "only_a": list(self.only_a), "only_b": list(self.only_b),
                          "differing": [{"name": t.name, "max_rel_diff": t.max_rel_diff, "rel_l2_diff": t.rel_l2_diff,
                                         "experts_differing": [e for e, d in enumerate(t.by_expert or ()) if d != 0.0]}
                                        for t in ranked[:limit]]})

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (an infinite difference, from NaN facing a number, becomes null)."""
        worst = self.worst
        return json_safe({
            "a": self.a, "b": self.b,
            "summary": {
                "identical": self.identical,
                "n_tensors_a": len(self.tensors) + len(self.only_a),
                "n_tensors_b": len(self.tensors) + len(self.only_b),
                "n_compared": len(self.tensors),
                "n_equal": len(self.tensors) - len(self.differing),
                "n_differing": len(self.differing),
                "n_only_a": len(self.only_a),
                "n_only_b": len(self.only_b),
                "n_dtype_mismatch": sum(t.dtype_mismatch for t in self.tensors),
                "n_shape_mismatch": sum(t.shape_mismatch for t in self.tensors),
                "worst": None if worst is None else {"name": worst.name, "max_abs_diff": worst.max_abs_diff,
                                                     "max_rel_diff": worst.max_rel_diff},
                "n_cast": sum(bool(t.is_cast) for t in self.tensors),
                "optimizer_step": self.optimizer_step is not None,
                "verdict": self.verdict,
            },
            "tied": list(self.tied),
            "regrouped": list(self.regrouped),
            "only_a": list(self.only_a),
            "only_b": list(self.only_b),
            "differing": [t.name for t in self.differing],
            "dtype_mismatches": [t.name for t in self.tensors if t.dtype_mismatch],
            "shape_mismatches": [t.name for t in self.tensors if t.shape_mismatch],
            "tensors": [t.to_dict() for t in self.tensors],
        })


def diff_checkpoints(a_dir: str | Path, b_dir: str | Path, *,
                     chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> WeightsReport:
    """Compare the safetensors weights of two checkpoints (dirs, or single .safetensors files).

    Tensors are matched by name; a sharded checkpoint is read through its
    `model.safetensors.index.json`. Each pair is read `chunk_elements` at a time along its first
    dimension, so memory stays at a few chunks whatever the checkpoint size.
    """
    with ExitStack() as stack:
        source_a = _Source(Path(a_dir), stack)
        source_b = _Source(Path(b_dir), stack)
        regrouped = _regroup_experts(source_a, source_b) + _regroup_experts(source_b, source_a)
        names_a, names_b = set(source_a.names), set(source_b.names)
        tensors = tuple(_diff_tensor(name, source_a, source_b, chunk_elements)
                        for name in sorted(names_a & names_b))
        tied = tuple(sorted(name for name in (names_a ^ names_b) if _tied_copy(name, source_a, source_b)))
    return WeightsReport(a=str(a_dir), b=str(b_dir), tensors=tensors,
                         only_a=tuple(sorted(names_a - names_b)), only_b=tuple(sorted(names_b - names_a)),
                         tied=tied, regrouped=tuple(sorted(regrouped)))


# Per-expert projection names (Qwen-MoE, DeepSeek: gate/up/down_proj; Mixtral: w1/w3/w2) and the
# fused tensor each goes into, as transformers >= 5 fuses them: gate_up_proj [experts, 2 x
# intermediate, hidden] holds gate then up along dim 1 (its forward chunks gate, up in that order),
# down_proj [experts, hidden, intermediate].
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                         r"\.weight$")
_FUSED_PARTS = {"gate_up_proj": (("gate_proj", "w1"), ("up_proj", "w3")), "down_proj": (("down_proj", "w2"),)}


def _regroup_experts(per_expert: _Source, fused: _Source) -> list[str]:
    """Where `fused` holds X.experts.gate_up_proj / X.experts.down_proj and `per_expert` holds every
    expert's projections instead, give `per_expert` the fused tensor built from them (virtually:
    read expert by expert); its per-expert names leave the comparison. The fused names made."""
    parts: dict[tuple[str, str], dict[int, str]] = {}
    for name in per_expert.files:
        match = _PER_EXPERT.match(name)
        if match:
            parts.setdefault((match["prefix"], match["proj"]), {})[int(match["expert"])] = name
    made = []
    for name in fused.files:
        prefix, _, kind = name.rpartition(".")
        if kind not in _FUSED_PARTS or name in per_expert.files or not prefix.endswith(".experts"):
            continue
        shape = tuple(fused.slice(name).get_shape())
        groups = []
        for aliases in _FUSED_PARTS[kind]:
            found = next((parts[(prefix, alias)] for alias in aliases if (prefix, alias) in parts), None)
            if found is None or sorted(found) != list(range(shape[0] if shape else 0)):
                break
            groups.append([found[e] for e in range(shape[0])])
        else:
            stacked = _StackedExperts(per_expert, groups)
            if tuple(stacked.get_shape()) == shape:
                per_expert.add_virtual(name, stacked, [n for group in groups for n in group])
                made.append(name)
    return made


class _StackedExperts:
    """Per-expert tensors read as one fused [experts, ...] tensor: expert e is its projections
    concatenated along their first dimension (gate then up), the way a safetensors slice reads."""

    def __init__(self, source: _Source, groups: list[list[str]]) -> None:
        self.source, self.groups = source, groups
        first = [source.slice(group[0]) for group in groups]
        self.dtype = first[0].get_dtype()
        rows = sum(int(s.get_shape()[0]) for s in first)
        self.shape = (len(groups[0]), rows, *first[0].get_shape()[1:])

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, index: Any) -> Any:
        import torch

        experts = range(self.shape[0])[index] if isinstance(index, slice) else range(self.shape[0])
        return torch.stack([torch.cat([self.source.slice(group[e])[...] for group in self.groups])
                            for e in experts])


# Output-embedding names and the input embeddings a tied model shares them with.
_TIED = {"lm_head.weight": ("model.embed_tokens.weight", "transformer.wte.weight", "embed_tokens.weight")}


def _tied_copy(name: str, source_a: _Source, source_b: _Source) -> bool:
    """`name`, present on one side only, is bit for bit the other side's input embedding."""
    here, there = (source_a, source_b) if name in source_a.names else (source_b, source_a)
    for embedding in _TIED.get(name, ()):
        if embedding in there.files and embedding in here.files:
            copy, original = here.slice(name), there.slice(embedding)
            if tuple(copy.get_shape()) == tuple(original.get_shape()) and copy.get_dtype() == original.get_dtype():
                return bool((copy[...] == original[...]).all())
    return False


def _precision(dtype: str) -> int:
    return {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}.get(dtype, 0)


class _Source:
    """Tensor name -> its safetensors file, with lazily opened (memory-mapped) handles."""

    def __init__(self, root: Path, stack: ExitStack) -> None:
        self.root, self.stack = root, stack
        self.handles: dict[Path, Any] = {}
        self.files: dict[str, Path] = self._weight_map()
        self.virtual: dict[str, Any] = {}  # name -> a slice-like view built from other tensors
        self.absorbed: set[str] = set()    # names a virtual tensor stands for

    @property
    def names(self) -> list[str]:
        """The names compared: the files' own, with virtual tensors in place of what they absorb."""
        return [name for name in self.files if name not in self.absorbed] + list(self.virtual)

    def add_virtual(self, name: str, view: Any, absorbs: list[str]) -> None:
        self.virtual[name] = view
        self.absorbed.update(absorbs)

    def _weight_map(self) -> dict[str, Path]:
        root = self.root
        if root.is_file() and root.suffix == ".safetensors":
            return {name: root for name in self.open(root).keys()}
        if not root.is_dir():
            raise CheckpointError(f"{root}: checkpoint directory not found")
        index = root / INDEX_FILE
        if index.is_file():
            return self._indexed(index)
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            if any(root.glob("*.bin")) or any(root.glob("*.pt")):
                raise CheckpointError(f"{root}: weights are pickle files (.bin/.pt); mismatch reads safetensors "
                                      "only (convert with save_pretrained(safe_serialization=True))")
            raise CheckpointError(f"{root}: no *.safetensors weights")
        files: dict[str, Path] = {}
        for shard in shards:
            for name in self.open(shard).keys():
                if name in files:
                    raise CheckpointError(f"{root}: tensor {name!r} is in both {files[name].name} and "
                                          f"{shard.name} (and there is no {INDEX_FILE} to choose)")
                files[name] = shard
        return files

    def _indexed(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map): "
                                  f"{type(exc).__name__}") from None
        files = {str(name): self.root / str(file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise CheckpointError(f"{index}: names shard {file.name!r}, which does not exist")
            present = set(self.open(file).keys())
            missing = sorted(name for name, f in files.items() if f == file and name not in present)
            if missing:
                raise CheckpointError(f"{index}: tensor {missing[0]!r} is not in {file.name}")
        return files

    def open(self, file: Path):
        if file not in self.handles:
            from safetensors import SafetensorError, safe_open

            try:
                self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
            except (SafetensorError, OSError) as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise CheckpointError(f"{file}: not a readable safetensors file ({reason})") from None
        return self.handles[file]

    def slice(self, name: str):
        if name in self.virtual:
            return self.virtual[name]
        return self.open(self.files[name]).get_slice(name)


def _diff_tensor(name: str, source_a: _Source, source_b: _Source, chunk_elements: int) -> TensorDiff:
    slice_a, slice_b = source_a.slice(name), source_b.slice(name)
    shape_a, shape_b = tuple(slice_a.get_shape()), tuple(slice_b.get_shape())
    dtype_a, dtype_b = (_DTYPE_NAMES.get(s.get_dtype(), s.get_dtype().lower()) for s in (slice_a, slice_b))
    num_elements = math.prod(shape_a)
    if shape_a != shape_b:
        return TensorDiff(name=name, dtype_a=dtype_a, dtype_b=dtype_b, shape_a=shape_a, shape_b=shape_b,
                          equal=False, num_elements=num_elements, max_abs_diff=None, max_rel_diff=None,
                          bitwise_equal_frac=None)
    max_abs = max_rel = 0.0
    num_same = num_cast = 0
    sq_diff: list[float] = []  # per row: summed exactly at the end, so chunking changes no bit
    sq_a: list[float] = []
    stacked = len(shape_a) == 3 and ".experts." in f".{name}."  # [experts, ...]: per-expert maxima
    by_expert = [0.0] * shape_a[0] if stacked else None
    row = math.prod(shape_a[1:]) if shape_a else 1
    first_row = 0
    for chunk_a, chunk_b in zip(_chunks(slice_a, shape_a, chunk_elements),
                                _chunks(slice_b, shape_b, chunk_elements), strict=True):
        chunk_abs, chunk_rel, chunk_same, chunk_sq_diff, chunk_sq_a = _compare(chunk_a, chunk_b, row)
        max_abs, max_rel, num_same = max(max_abs, chunk_abs), max(max_rel, chunk_rel), num_same + chunk_same
        sq_diff += chunk_sq_diff
        sq_a += chunk_sq_a
        if dtype_a != dtype_b:
            num_cast += _num_cast(chunk_a, chunk_b)
        if by_expert is not None:
            for offset, expert_max in enumerate(_row_maxima(chunk_a, chunk_b, row)):
                by_expert[first_row + offset] = max(by_expert[first_row + offset], expert_max)
            first_row += len(chunk_a) // max(row, 1)
    same_frac = num_same / num_elements if num_elements else 1.0
    sum_sq_diff, sum_sq_a = math.fsum(sq_diff), math.fsum(sq_a)
    return TensorDiff(name=name, dtype_a=dtype_a, dtype_b=dtype_b, shape_a=shape_a, shape_b=shape_b,
                      equal=dtype_a == dtype_b and num_same == num_elements, num_elements=num_elements,
                      max_abs_diff=max_abs, max_rel_diff=max_rel, bitwise_equal_frac=same_frac,
                      is_cast=num_cast == num_elements if dtype_a != dtype_b else None,
                      by_expert=tuple(by_expert) if by_expert is not None else None,
                      rms_diff=math.sqrt(sum_sq_diff / num_elements) if num_elements else 0.0,
                      rel_l2_diff=math.sqrt(sum_sq_diff / sum_sq_a) if sum_sq_a > 0 else None)


def _num_cast(a, b) -> int:
    """Elements where the lower-precision side holds exactly the other cast to its dtype."""
    if not (a.is_floating_point() and b.is_floating_point()):
        return 0
    low, high = (a, b) if a.element_size() < b.element_size() else (b, a)
    if low.element_size() == high.element_size():  # bf16 against fp16: neither is the other's cast
        return 0
    return int((_bits(high.to(low.dtype)) == _bits(low)).sum())


def _bits(tensor):
    """The tensor's raw bits as integers of its width (so -0.0 and 0.0, or two NaNs, differ)."""
    import torch

    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _row_maxima(a, b, row: int) -> list[float]:
    """max |a - b| per row of `row` elements (rows: the first dimension) of two flat chunks."""
    import torch

    diff = (a.to(torch.float64) - b.to(torch.float64)).abs().nan_to_num(nan=math.inf).reshape(-1, max(row, 1))
    return [float(x) for x in diff.max(dim=1).values] if diff.numel() else []


def _chunks(tensor_slice, shape: tuple[int, ...], chunk_elements: int) -> Iterator[Any]:
    """The tensor as flat pieces of whole rows (first dimension), about chunk_elements each."""
    if not shape:  # a scalar: safetensors slices need a dimension
        yield tensor_slice[...].reshape(-1)
        return
    row = math.prod(shape[1:])
    step = max(1, chunk_elements // max(row, 1))
    for start in range(0, shape[0], step):
        yield tensor_slice[start:start + step].reshape(-1)


def _compare(a, b, row: int) -> tuple[float, float, int, list[float], list[float]]:
    """(max |a-b|, max relative diff, number of identical elements, sum (a-b)^2 and sum a^2 per row
    of `row` elements) of two flat chunks."""
    import torch

    if a.numel() == 0:
        return 0.0, 0.0, 0, [], []
    # fp32 holds every bf16/fp16 value exactly; 64-bit and integer tensors need fp64.
    exact_in_fp32 = all(t.is_floating_point() and t.element_size() < 8 for t in (a, b))
    upcast = torch.float32 if exact_in_fp32 else torch.float64
    a_up, b_up = a.to(upcast), b.to(upcast)
    # Equal infinities and NaN facing NaN are no difference in value.
    value_same = (a_up == b_up) | (a_up.isnan() & b_up.isnan())
    if a.dtype == b.dtype:
        # Same dtype: count identical bits, so -0.0 against 0.0 (or another NaN payload) differs.
        same = _bits(a) == _bits(b)
    else:
        same = value_same
    abs_diff = torch.where(value_same, 0.0, (a_up - b_up).abs())
    abs_diff = torch.nan_to_num(abs_diff, nan=math.inf)  # NaN on one side only: infinitely apart
    scale = torch.maximum(a_up.abs(), b_up.abs())
    rel_diff = torch.nan_to_num(torch.where(value_same, 0.0, abs_diff / scale), nan=math.inf)
    def row_sums(x) -> list[float]:
        return x.to(torch.float64).square().reshape(-1, max(row, 1)).sum(dim=1).tolist()

    return (float(abs_diff.max()), float(rel_diff.max()), int(same.sum()), row_sums(abs_diff),
            row_sums(a_up.nan_to_num(nan=0.0)))
