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
    from transformers import Gemma2Config, Gemma3TextConfig, MixtralConfig, Qwen3MoeConfig

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
    }


ARCHITECTURES = ("qwen3_moe", "mixtral", "gemma2", "gemma3")


def build_architecture(name: str, out: str | Path, *, tokenizer_from: str | Path, seed: int = 0) -> Path:
    """A random-init checkpoint of `name` (ARCHITECTURES) at `out`, with `tokenizer_from`'s tokenizer.
    Written to a temp dir and renamed: a cache never holds half a checkpoint."""
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
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy(source / file, tmp / file)
    tmp.rename(out)
    return out
