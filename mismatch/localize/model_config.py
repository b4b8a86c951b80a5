"""The keys of a checkpoint's config.json the localizers read (layer types, saved dtype, the
sparse-attention indexer's top-k), decoded once into a record; the rest of the file is ignored."""

from __future__ import annotations

from pathlib import Path

import msgspec

from mismatch.errors import CheckpointError


class LocalizerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """config.json's keys the localizers read; `text_config`: a multimodal wrapper's (Qwen3.5)
    language model, which holds the LM's own keys."""

    text_config: LocalizerConfig | None = None
    layer_types: list[str] | None = None
    dtype: str | None = None
    torch_dtype: str | None = None
    index_topk: int | None = None

    @property
    def language_model(self) -> LocalizerConfig:
        """The language model's own keys: text_config's where the file wraps one, else its own."""
        return self.text_config or self


def read_model_config(checkpoint: str | Path) -> LocalizerConfig:
    """The checkpoint's config.json as the localizers read it (checked readable before any model
    loads: checkpoint.ModelConfig; these keys it does not read are checked here, one line each)."""
    path = Path(checkpoint) / "config.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=LocalizerConfig, strict=False)
    except msgspec.ValidationError as error:  # e.g. a layer type that is not a string: `$.layer_types[3]`
        raise CheckpointError(f"{path}: {error}") from None
    except (OSError, msgspec.DecodeError) as error:
        raise CheckpointError(f"{path}: not a readable JSON file ({error})") from None
