"""Engine spec strings and TOML files, parsed into a kind plus typed options.

`hf:dtype=bfloat16,attn=sdpa` → EngineSpec(kind="hf", options={...}); each engine declares its
options as a keyword-only dataclass and `options_from` checks keys and converts values.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mismatch.errors import SpecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

T = TypeVar("T")


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineSpec:
    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    text: str  # as the user wrote it, for summary.json and messages


def parse_spec(text: str) -> EngineSpec:
    text = text.strip()
    if not text:
        raise SpecError("empty engine spec")
    if text.startswith(("http://", "https://")):
        return EngineSpec(kind="http", options={"url": text}, text=text)
    if text.endswith(".toml"):
        return _spec_from_toml(Path(text))
    if text == "sampler":  # the log-probs stored with the rollouts
        return EngineSpec(kind="stored", options={"name": "sampler"}, text=text)
    kind, _, rest = text.partition(":")
    if kind == "stored":  # stored:NAME — a segment's extra_logprobs[NAME]
        if not rest.strip():
            raise SpecError(f"engine spec {text!r}: expected stored:NAME")
        return EngineSpec(kind="stored", options={"name": rest.strip()}, text=text)
    if kind == "python":
        return _python_spec(text, rest)
    return EngineSpec(kind=kind.strip(), options=_inline_options(text, rest), text=text)


def _python_spec(text: str, rest: str) -> EngineSpec:
    """`python:MODULE:CALLABLE[,KEY=VALUE,...]`, MODULE a dotted name or a path to a .py file."""
    # The target ends at the first comma: a value may then hold a colon (`url=http://h:80`), and a
    # module path with a comma in it goes in a TOML's `target` instead.
    target, _, inline = rest.partition(",")
    target = target.strip()
    module_name, sep, callable_name = target.rpartition(":")
    if not sep or not module_name or not callable_name:
        raise SpecError(f"engine spec {text!r}: expected python:MODULE:CALLABLE")
    options = _inline_options(text, inline)
    if "target" in options:  # the key a TOML names MODULE:CALLABLE by; inline it would replace it
        raise SpecError(f"engine spec {text!r}: 'target' is not an option here: MODULE:CALLABLE "
                        f"comes before the first comma")
    return EngineSpec(kind="python", options={"target": target, **options}, text=text)


def _inline_options(text: str, rest: str) -> dict[str, Any]:
    """`key=value,...` as strings; each engine types them (`options_from`, or a python: factory's
    annotations) as it would a TOML's."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SpecError(f"engine spec {text!r}: expected KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    return options


def _spec_from_toml(path: Path) -> EngineSpec:
    if not path.is_file():
        raise SpecError(f"{path}: engine TOML not found")
    try:
        table = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: invalid TOML: {exc}") from None
    kind = table.pop("engine", None)
    if not isinstance(kind, str):
        raise SpecError(f"{path}: missing `engine = \"KIND\"` (e.g. \"hf\", \"vllm\")")
    return EngineSpec(kind=kind, options=table, text=str(path))


def options_from(cls: type[T], spec: EngineSpec) -> T:
    """Build an engine's options dataclass from a spec: unknown keys and bad values are errors."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(spec.options) - set(fields))
    if unknown:
        raise SpecError(f"engine {spec.kind!r}: unknown option {unknown[0]!r} "
                        f"(valid: {', '.join(sorted(fields))})")
    values = {key: convert_option(f"engine {spec.kind!r}", key, raw, hints[key])
              for key, raw in spec.options.items()}
    return cls(**values)


def scalar_type(hint: Any) -> type | None:
    """`int`, `float | None` → int, float; None for a hint that is not one plain scalar (`Any`, a
    `Literal`, `list[int]`, `int | str`, none at all), whose values a python: factory gets as written."""
    allowed = _allowed(hint)
    return allowed[0] if len(allowed) == 1 and allowed[0] in (str, bool, int, float) else None


def _allowed(hint: Any) -> list[Any]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return [t for t in typing.get_args(hint) if t is not type(None)]
    return [hint]


def convert_option(label: str, key: str, raw: Any, hint: Any) -> Any:
    """One option's value (a spec's string, a TOML's value) as the type `hint` names; `label` starts
    the error, e.g. "engine 'hf'"."""
    target = _allowed(hint)[0]
    if isinstance(raw, target) and not (target is int and isinstance(raw, bool)):
        return raw
    text = str(raw).strip()
    try:
        if target is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        return target(text)
    except ValueError:
        raise SpecError(f"{label}: option {key}={raw!r} is not a valid {target.__name__}") from None
