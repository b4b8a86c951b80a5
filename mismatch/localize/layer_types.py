"""By layer type: the layer localizer's error split by the kind of token mixer each layer runs
(linear attention, full, sliding-window, with sinks, sparse), and the mechanism that differs there.

After `layers` (localize): its `by_layer` rows + the checkpoint's config.json and weight names ->
`summary.json["localization"]["layer_types"]`. Hybrids (Qwen3.5 / Qwen3-Next gated DeltaNet, Kimi
Linear, OLMo-hybrid) run two algorithms for one layer type: the trainer's chunked parallel form over
the whole sequence, the sampler's recurrent step per decoded token. This module says which type the
gap lives in and, from the two configurations compared, which of those paths differ.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch.engines import parse_spec
from mismatch.localize.model_config import read_model_config

if TYPE_CHECKING:
    from mismatch.localize.layers import LayerReport

LINEAR, FULL, SLIDING, SPARSE = "linear_attention", "full_attention", "sliding_attention", "sparse_attention"
SINK_PREFIX = "sink_"  # learned sink logits in the softmax (gpt-oss): sink_full_attention, sink_sliding_attention
MLP = "mlp"            # the MLP / MoE blocks and the norms of every layer, one line of their own

# config.json's layer_types names -> ours. transformers' names: "linear_attention" (Qwen3.5, Qwen3-Next,
# Kimi Linear, OLMo-hybrid), "full_attention", "sliding_attention" (gpt-oss, Gemma), "indexed_attention"
# (DeepSeek-V3.2, GLM-5's DSA).
CONFIG_NAMES = {"linear_attention": LINEAR, "full_attention": FULL, "sliding_attention": SLIDING,
                "indexed_attention": SPARSE}

SPLIT_RULE = ("each layer's token mixer (its attn sub-block) is typed from config.json's layer_types (absent: "
              "full_attention) and the checkpoint's weights (a `sinks` tensor: sink_*; an `indexer`: "
              "sparse_attention); share = the sum of the mixers' local_rel_error over a type's layers over the "
              "sum of every sub-block's local_rel_error (MLPs, MoEs and norms together as `mlp`): the error each "
              "part introduces fed the same input, not what it inherits. lead_type = the largest share.")


@dataclass(kw_only=True, slots=True, frozen=True)
class TypeShare:
    """One layer type's part of the locally introduced error."""

    layer_type: str
    layers: tuple[int, ...]
    local_rel_error_sum: float   # sum over its layers of the mixer's local_rel_error
    local_rel_error_max: float
    share: float                 # of the sum over every sub-block


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerTypeSplit:
    a: str
    b: str
    by_type: tuple[TypeShare, ...]   # largest share first
    lead_type: str | None            # None: a and b agree at every sub-block
    jump_type: str | None            # the type of the layers localizer's jump_layer
    mechanism: str | None            # the paths that differ in the lead type, in words

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "rule": SPLIT_RULE, "lead_type": self.lead_type,
                "jump_type": self.jump_type, "mechanism": self.mechanism,
                "by_type": [{f.name: (list(v) if isinstance(v := getattr(t, f.name), tuple) else v)
                             for f in fields(t)} for t in self.by_type]}


def layer_types(checkpoint: str | Path, num_layers: int) -> list[str]:
    """Each decoder layer's mixer type (LINEAR, FULL, SLIDING, SPARSE; sinks prefixed SINK_PREFIX)."""
    root = Path(checkpoint)
    declared = read_model_config(root).language_model.layer_types or [FULL] * num_layers
    types = [CONFIG_NAMES.get(name, name) for name in declared[:num_layers]]
    names = _weight_names(root)
    for index in range(len(types)):
        own = [name for name in names if re.search(rf"\blayers\.{index}\.", name)]
        if any(name.endswith(".indexer.wk.weight") for name in own):
            types[index] = SPARSE
        if any(name.endswith("attn.sinks") for name in own):
            types[index] = SINK_PREFIX + types[index]
    return types


def _weight_names(root: Path) -> list[str]:
    """The tensor names a checkpoint stores (the safetensors headers only: no weight is read)."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as handle:
            names.extend(handle.keys())
    return names


def split_by_layer_type(checkpoint: str | Path, layers: LayerReport) -> LayerTypeSplit:
    """The layers localizer's report split by layer type, per SPLIT_RULE."""
    rows = [row for row in layers.by_layer if row.block != "residual"]
    num_layers = 1 + max((row.layer for row in layers.by_layer), default=-1)
    types = layer_types(checkpoint, num_layers)
    buckets: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        bucket = types[row.layer] if row.block == "attn" else MLP
        # a sub-block whose local error was not measured (or not finite) introduces none we can count
        error = row.local_rel_error if row.local_rel_error is not None and math.isfinite(row.local_rel_error) else 0.0
        buckets.setdefault(bucket, []).append((row.layer, error))
    total = sum(error for parts in buckets.values() for _, error in parts)
    shares = sorted((TypeShare(layer_type=name, layers=tuple(sorted({layer for layer, _ in parts})),
                               local_rel_error_sum=sum(e for _, e in parts),
                               local_rel_error_max=max(e for _, e in parts),
                               share=sum(e for _, e in parts) / total if total else 0.0)
                     for name, parts in buckets.items()), key=lambda t: -t.share)
    lead = shares[0].layer_type if shares and total > 0 else None
    jump = layers.jump_layer
    return LayerTypeSplit(a=layers.a, b=layers.b, by_type=tuple(shares), lead_type=lead,
                          jump_type=types[jump] if isinstance(jump, int) and jump < len(types) else None,
                          mechanism=mechanism(lead, layers.a, layers.b, _saved_dtype(checkpoint)) if lead else None)


def _saved_dtype(checkpoint: str | Path) -> str:
    """The dtype `dtype=auto` loads: the one config.json names."""
    config = read_model_config(checkpoint)
    return config.dtype or config.torch_dtype or "auto"


def mechanism(layer_type: str, a: str, b: str, saved_dtype: str = "auto") -> str | None:
    """What the two configurations run differently in `layer_type`'s layers, in words. None for the
    MLP line (the kernel localizer and the routing agreement speak for those), and None when the
    sides differ in both path and dtype: the split cannot tell those two apart."""
    if layer_type == MLP:
        return None
    spec_a, spec_b = parse_spec(a), parse_spec(b)
    paths = {spec_a.kind, spec_b.kind}
    dtypes = {_dtype(spec.options.get("dtype", "auto"), saved_dtype) for spec in (spec_a, spec_b)}
    if len(paths) > 1 and len(dtypes) > 1:
        return None
    between = " vs ".join(sorted(dtypes))
    base = layer_type.removeprefix(SINK_PREFIX)
    sinks = " (with learned sink logits)" if layer_type.startswith(SINK_PREFIX) else ""
    decode = paths == {"hf", "hf-decode"}
    if base == LINEAR:
        states = {spec.options.get("state_dtype", "auto") for spec in (spec_a, spec_b) if spec.kind == "hf-decode"}
        state = next((f" (recurrent state in {s})" for s in states if s != "auto"), "")
        return (f"the linear-attention layers' chunked prefill vs recurrent decode{state}" if decode
                else f"the linear-attention layers' recurrence in {between}{state}")
    words = {FULL: "full-attention", SLIDING: "sliding-window attention", SPARSE: "sparse-attention"}.get(base, base)
    if base == SPARSE:
        return (f"the {words} layers' indexer top-k selection and attention over the selected keys"
                + (" (full forward vs KV-cached decode)" if decode else f" in {between}"))
    if decode:
        return f"the {words} layers'{sinks} full forward vs KV-cached decode"
    return f"the {words} layers'{sinks} kernels in {between}"


def _dtype(option: str, saved: str) -> str:
    from mismatch.checkpoint import normalize_dtype

    resolved = normalize_dtype(option)
    return saved if resolved == "auto" else resolved
