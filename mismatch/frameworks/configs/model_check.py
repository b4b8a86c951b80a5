"""The model a trainer's config names, against the checkpoint the audit replays: compared offline,
said on the audit's first line, and a clear mismatch refused (unless --force-model).

What can be compared without a model hub: where the config names a local directory with a
config.json, its architecture and sizes (model_type, architectures, vocab_size, hidden_size,
num_hidden_layers, num_attention_heads) against the checkpoint's; where it names a hub id
("Qwen/Qwen3-8B"), only the name, against the checkpoint's directory name and its config.json's
`_name_or_path`. A differing name is said, never refused: a fine-tuned checkpoint is saved under
another name than the model it was trained from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mismatch.checkpoint import ModelConfig, model_config
from mismatch.errors import CheckpointError

# Where each framework's config names its model (the readers set Derived.model from it).
MODEL_KEYS = {"verl": "actor_rollout_ref.model.path", "openrlhf": "--actor.model_name_or_path",
              "slime": "--hf-checkpoint", "prime-rl": "model.name", "trl": "model_name_or_path"}
SIZES = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
Verdict = Literal["same", "same name", "other name", "differs", "not compared"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelCheck:
    named: str           # the model the config names
    verdict: Verdict     # "differs": a compared size differs (refused without --force-model)
    line: str            # the audit's first line

    def to_dict(self) -> dict[str, Any]:
        return {"named": self.named, "verdict": self.verdict, "line": self.line}


def check_model(named: str, checkpoint: Path, key: str) -> ModelCheck:
    """`named` (the config's `key`) against `checkpoint`."""
    ours = _config(checkpoint / "config.json")
    local = Path(named).expanduser()
    if (local / "config.json").is_file():
        theirs = _config(local / "config.json")
        compared = [(field, mine, other) for field, other, mine in zip(SIZES, _sizes(theirs), _sizes(ours), strict=True)
                    if other is not None and mine is not None]  # a size either config.json leaves out: not compared
        differ = [f"{field} {other!r} vs {mine!r}" for field, mine, other in compared if other != mine]
        if differ:
            return ModelCheck(named=named, verdict="differs",
                              line=f"model: the config's {key}={named} is not the checkpoint {checkpoint}: "
                                   f"{'; '.join(differ)} (pass --force-model to audit it anyway)")
        if not compared:  # one config.json unreadable, or the two share no size: nothing says "same"
            return ModelCheck(named=named, verdict="not compared",
                              line=f"model: the config's {key}={named}: its config.json and the checkpoint's "
                                   "give no size both can be read for; not compared, so the audit goes on")
        said = [field for field, mine in zip(SIZES, _sizes(ours), strict=True) if mine is not None]
        return ModelCheck(named=named, verdict="same",
                          line=f"model: the config's {key}={named} has the checkpoint's architecture and sizes "
                               f"({', '.join(said)})")
    names = {_short(checkpoint.resolve().name)} | ({_short(ours.name_or_path)} if ours.name_or_path else set())
    if _short(named) in names:
        return ModelCheck(named=named, verdict="same name",
                          line=f"model: the config's {key}={named}: the checkpoint has that name (compared by name "
                               "only: no config.json of it here)")
    return ModelCheck(named=named, verdict="other name",
                      line=f"model: the config trains {named} ({key}), the audit replays the checkpoint {checkpoint} "
                           f"({', '.join(sorted(names))}): another name; compared by name only (no config.json of "
                           f"{named} here), so the audit goes on")


def _config(path: Path) -> ModelConfig:
    """A config.json's keys compared here; none where it cannot be read or decoded (the checkpoint's
    own checks name what is wrong with ours)."""
    try:
        return model_config(json.loads(path.read_text()), path)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, CheckpointError):
        return ModelConfig()


def _sizes(config: ModelConfig) -> tuple[Any, ...]:
    """The values of SIZES, in its order (None: the config.json does not say)."""
    return (config.model_type, config.architectures, config.vocab_size, config.hidden_size, config.num_hidden_layers,
            config.num_attention_heads)


def _short(name: str) -> str:
    """A model's name as compared: its last path component, lowercased, without a trailing slash."""
    return name.rstrip("/").rpartition("/")[2].lower()
