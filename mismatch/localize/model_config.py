"""The keys of a checkpoint's config.json the localizers read (layer types, saved dtype, the
sparse-attention indexer's top-k), decoded once into a record; the rest of the file is ignored."""

from __future__ import annotations

from pathlib import Path

import msgspec


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """config.json's keys the localizers read; `text_config`: a multimodal wrapper's (Qwen3.5)
    language model, which holds the LM's own keys."""

    text_config: ModelConfig | None = None
    layer_types: list[str] | None = None
    dtype: str | None = None
    torch_dtype: str | None = None
    index_topk: int | None = None

    @property
    def language_model(self) -> ModelConfig:
        """The language model's own keys: text_config's where the file wraps one, else its own."""
        return self.text_config or self


def read_model_config(checkpoint: str | Path) -> ModelConfig:
    """The checkpoint's config.json as the localizers read it (checked readable before any model loads)."""
    return msgspec.json.decode((Path(checkpoint) / "config.json").read_bytes(), type=ModelConfig, strict=False)
