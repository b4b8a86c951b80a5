"""A trainer's own config file as engine specs: `--train verl:ppo.yaml` replays the trainer as that
config computes old log-probs, and the engine as that config's rollout engine is set up.

Spec form: `FRAMEWORK:PATH[,side=train|infer][,OPTION=VALUE...]`. The path ends at the first comma;
`side` picks the trainer's old-log-prob forward (`train`), the rollout engine (`infer`) or, where
the framework batches it otherwise, the policy update's forward (`update`), by default the side of the flag
it is given to (`--train`, `--reference`, `--a`/`--b`: the trainer; `--infer`: the engine); any
other OPTION=VALUE is an option of the derived engine and wins over what the config gave (e.g.
`device=cuda`, `tensor_parallel_size=2`). One reader per framework (derived.py: what a reader
returns); each reads with the framework's own loader where the release is installed, else the
documented subset of its keys.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.engines.spec import parse_spec
from mismatch.errors import SpecError
from mismatch.frameworks.configs.derived import SIDES, Derived, Machine, Setting, Side, spec_text

READERS: dict[str, str] = {
    "verl": "mismatch.frameworks.configs.verl",
    "trl": "mismatch.frameworks.configs.trl",
    "openrlhf": "mismatch.frameworks.configs.openrlhf",
    "slime": "mismatch.frameworks.configs.slime",
    "prime-rl": "mismatch.frameworks.configs.prime_rl",
}
# The side a config spec replays when it names none: the flag's (a diff's --a/--b compare trainer
# settings, as verl#6280's micro-batch question asks; `side=infer` compares engine settings).
SOURCE_SIDES: dict[str, Side] = {"infer": "infer"}
# Options of a config's rollout engine that `--train FRAMEWORK:FILE,OPTION=VALUE` may give: the trainer's
# forward has no such limit, so they go to the rollout engine the same config derives (--infer left unset).
ENGINE_SIDE_OPTIONS = ("max_model_len",)


@dataclass(kw_only=True, slots=True, frozen=True)
class Resolved:
    spec: str  # the engine spec the source replays
    from_config: dict[str, Any]  # summary.json engines.<source>.from_config


def config_framework(text: str) -> str | None:
    """The framework a spec's config names (`verl:ppo.yaml` → verl), None for an engine spec."""
    kind, sep, _ = text.strip().partition(":")
    return kind if sep and kind in READERS else None


def read_config(framework: str, path: Path, machine: Machine | None = None) -> Derived:
    """The framework's reader on `path` (one line and SpecError for a missing file or a bad key)."""
    if not path.is_file():
        raise SpecError(f"{path}: {framework} config not found")
    reader = importlib.import_module(READERS[framework])
    return reader.derive(path, machine if machine is not None else Machine.here())


def resolve(text: str, source: str, machine: Machine | None = None) -> Resolved:
    """A config spec as the engine spec `source` replays, with the table of what the config set."""
    framework = config_framework(text)
    if framework is None:
        raise SpecError(f"engine spec {text!r} names no framework config (known: {', '.join(READERS)})")
    path_text, _, inline = text.strip().partition(":")[2].partition(",")
    overrides = _overrides(text, inline)
    side = overrides.pop("side", SOURCE_SIDES.get(source, "train"))
    if side not in SIDES:
        raise SpecError(f"engine spec {text!r}: side={side!r} is not one of: {', '.join(SIDES)}")
    derived = read_config(framework, Path(path_text.strip()).expanduser(), machine)
    if side not in derived.specs:
        raise SpecError(f"engine spec {text!r}: a {framework} config has no side {side!r} "
                        f"(it has: {', '.join(derived.specs)})")
    base = parse_spec(derived.specs[side])
    if side != "infer" and base.kind == "hf":  # the rollout engine's context: _rollout_side carries it there
        overrides = {key: value for key, value in overrides.items() if key not in ENGINE_SIDE_OPTIONS}
    spec = spec_text(base.kind, {**base.options, **overrides})
    return Resolved(spec=spec, from_config={**derived.for_side(side), "spec": spec, "derived_spec": base.text,
                                            "overrides": overrides})


def _overrides(text: str, inline: str) -> dict[str, str]:
    overrides: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in inline.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SpecError(f"engine spec {text!r}: expected KEY=VALUE after the config path, got {item!r}")
        overrides[key.strip()] = value.strip()
    return overrides


__all__ = ["ENGINE_SIDE_OPTIONS", "READERS", "Derived", "Machine", "Resolved", "Setting", "config_framework", "read_config", "resolve"]
