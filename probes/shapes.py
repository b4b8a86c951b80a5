"""The model's own shapes, which probes run their ops at: kernels pick tiles and code paths by shape.

Read from a checkpoint's config.json (no weights are loaded, transformers' key names) or given by
hand for tests. MoE, MLA and Gemma configs add what their layers really run: experts, latent ranks,
soft-caps and sliding windows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mismatch.checkpoint import checkpoint_info
from mismatch.errors import CheckpointError

SCORINGS = ("softmax", "sigmoid")


@dataclass(kw_only=True, slots=True, frozen=True)
class MoEShapes:
    """Routed experts: what the router picks among, and what each picked expert computes."""

    num_experts: int
    top_k: int
    intermediate: int              # one expert's MLP width
    shared_intermediate: int = 0   # the always-on shared expert(s), 0 when there are none
    scoring: str = "softmax"       # router logits -> scores: softmax, or sigmoid (DeepSeek-V3)
    num_groups: int = 1            # group-limited routing: experts in groups, topk_groups of them kept
    topk_groups: int = 1

    def __post_init__(self) -> None:
        assert self.scoring in SCORINGS, self.scoring
        assert 0 < self.top_k < self.num_experts, "top-k picks some experts, not all"
        assert self.num_experts % self.num_groups == 0 and 0 < self.topk_groups <= self.num_groups


@dataclass(kw_only=True, slots=True, frozen=True)
class LinearShapes:
    """Gated delta rule layers (Qwen3-Next, Qwen3.5, OLMo-hybrid): the heads the recurrence runs on
    (queries and keys are repeated to the value heads before it) and each head's widths."""

    num_value_heads: int
    key_head_dim: int
    value_head_dim: int


@dataclass(kw_only=True, slots=True, frozen=True)
class MLAShapes:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv, a decoupled rotary part."""

    q_lora_rank: int | None  # None: q is projected from the hidden state directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(kw_only=True, slots=True, frozen=True)
class ProbeShapes:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int | None  # the dense MLP's width; None when every layer's MLP is routed experts
    vocab: int
    tokens: int = 64  # rows per op: a short prefill; batch and chunk variations split these
    moe: MoEShapes | None = None
    mla: MLAShapes | None = None
    attn_scale: float | None = None      # None: head_dim ** -0.5
    attn_softcap: float | None = None    # scores -> cap * tanh(scores / cap) before the softmax
    final_softcap: float | None = None   # the same on the lm_head's logits
    sliding_window: int | None = None    # keys a query sees, itself included, in sliding layers
    linear: LinearShapes | None = None   # the gated delta rule layers of a hybrid, None without any

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "grouped-query heads must divide evenly"
        assert self.tokens >= 8 and self.tokens % 4 == 0, "chunk variations split tokens into 4"
        assert self.intermediate is not None or self.moe is not None, "a model has some MLP"

    @property
    def mlp_intermediate(self) -> int:
        """The MLP width most tokens go through: the experts' when the model has experts."""
        return self.moe.intermediate if self.moe is not None else self.intermediate


def shapes_from_checkpoint(path: str | Path, *, tokens: int = 64) -> ProbeShapes:
    info = checkpoint_info(path)  # validates the directory with the project's one set of rules
    config = json.loads((info.path / "config.json").read_text())
    missing = [key for key in ("hidden_size", "num_attention_heads", "intermediate_size") if key not in config]
    if missing:
        raise CheckpointError(f"{info.path / 'config.json'}: no {missing[0]!r}; probes need a decoder "
                              "config (hidden_size, num_attention_heads, intermediate_size)")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    moe, mla = moe_from_config(config), mla_from_config(config)
    return ProbeShapes(hidden=hidden, num_heads=num_heads,
                       # MLA's kv_b_proj gives every head its own k and v, whatever num_key_value_heads says.
                       num_kv_heads=num_heads if mla else int(config.get("num_key_value_heads") or num_heads),
                       head_dim=int(config.get("head_dim") or hidden // num_heads),
                       intermediate=int(config["intermediate_size"]) if has_dense_mlp(config, moe) else None,
                       vocab=info.vocab_size, tokens=tokens, moe=moe, mla=mla,
                       attn_scale=attn_scale_from_config(config, mla),
                       attn_softcap=_float_or_none(config.get("attn_logit_softcapping")),
                       final_softcap=_float_or_none(config.get("final_logit_softcapping")),
                       sliding_window=sliding_window_from_config(config), linear=linear_from_config(config))


def linear_from_config(config: dict[str, Any]) -> LinearShapes | None:
    """The gated delta rule layers' shapes, by the names Qwen3-Next, Qwen3.5 and OLMo-hybrid's configs
    share; None for a model without them (Kimi Linear's KDA layers name theirs otherwise)."""
    keys = ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if "linear_attention" not in (config.get("layer_types") or []) or not all(config.get(key) for key in keys):
        return None
    return LinearShapes(num_value_heads=int(config["linear_num_value_heads"]),
                        key_head_dim=int(config["linear_key_head_dim"]),
                        value_head_dim=int(config["linear_value_head_dim"]))


def moe_from_config(config: dict[str, Any]) -> MoEShapes | None:
    # Qwen3-MoE num_experts (saved as num_local_experts by transformers 5), Mixtral num_local_experts,
    # DeepSeek n_routed_experts.
    num_experts = next((int(config[key]) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                        if config.get(key)), 0)
    if num_experts == 0:
        return None
    # Mixtral has no moe_intermediate_size: its intermediate_size is the expert's width.
    intermediate = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    if config.get("n_shared_experts"):  # DeepSeek: the shared experts run as one MLP this wide
        shared = intermediate * int(config["n_shared_experts"])
    else:  # Qwen2-MoE names its shared expert's width; Qwen3-MoE and Mixtral have none
        shared = int(config.get("shared_expert_intermediate_size") or 0)
    # transformers' DeepseekV3 router always scores with a sigmoid and stores no scoring_func;
    # DeepSeek's own configs (and vLLM) name it.
    default_scoring = "sigmoid" if config.get("model_type") == "deepseek_v3" else "softmax"
    scoring = config.get("scoring_func") or default_scoring
    if scoring not in SCORINGS:
        raise CheckpointError(f"config.json: scoring_func {scoring!r} is not one the probes know "
                              f"({', '.join(SCORINGS)})")
    # Kimi Linear names its top-k num_experts_per_token; the others num_experts_per_tok.
    top_k = config.get("num_experts_per_tok") or config.get("num_experts_per_token")
    if not top_k:
        raise CheckpointError("config.json: an MoE config without num_experts_per_tok (the router's top-k)")
    return MoEShapes(num_experts=num_experts, top_k=int(top_k),
                     intermediate=intermediate, shared_intermediate=shared, scoring=scoring,
                     num_groups=int(config.get("n_group") or 1), topk_groups=int(config.get("topk_group") or 1))


def has_dense_mlp(config: dict[str, Any], moe: MoEShapes | None) -> bool:
    """Whether some layer runs the dense intermediate_size MLP: DeepSeek's first_k_dense_replace
    layers, Qwen-MoE's mlp_only_layers or the layers between every decoder_sparse_step-th."""
    if moe is None:
        return True
    return bool(config.get("first_k_dense_replace")) or bool(config.get("mlp_only_layers")) \
        or int(config.get("decoder_sparse_step") or 1) > 1


def mla_from_config(config: dict[str, Any]) -> MLAShapes | None:
    if not config.get("kv_lora_rank"):
        return None
    q_lora_rank = config.get("q_lora_rank")
    return MLAShapes(q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
                     kv_lora_rank=int(config["kv_lora_rank"]),
                     qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                     qk_rope_head_dim=int(config["qk_rope_head_dim"]), v_head_dim=int(config["v_head_dim"]))


def attn_scale_from_config(config: dict[str, Any], mla: MLAShapes | None) -> float | None:
    """The scores' scale when it is not head_dim ** -0.5: Gemma's query_pre_attn_scalar, and MLA's
    qk_head_dim ** -0.5 times YaRN's mscale squared (transformers' yarn_apply_mscale)."""
    if mla is not None:
        scale = mla.qk_head_dim ** -0.5
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        factor, mscale_all_dim = float(rope.get("factor") or 1.0), float(rope.get("mscale_all_dim") or 0.0)
        if rope.get("rope_type", rope.get("type", "default")) != "default" and mscale_all_dim and factor > 1:
            scale *= (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2
        return scale
    if config.get("query_pre_attn_scalar"):
        return float(config["query_pre_attn_scalar"]) ** -0.5
    return None


def sliding_window_from_config(config: dict[str, Any]) -> int | None:
    """The window when some layer slides: Qwen's use_sliding_window switches it off, and Gemma's
    layer_types say which layers are "sliding_attention"."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def randn(*shape: int, gen: torch.Generator, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """fp32 normal values drawn on the CPU, so CPU and CUDA runs probe the very same inputs."""
    return (torch.randn(shape, generator=gen) * scale).to(device)
