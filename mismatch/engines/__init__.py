"""Engines turn token sequences into teacher-forced per-token log-probs.

One module per backend; `load_engine(spec, checkpoint)` is the registry, `contract.py` what every
engine provides (and the capabilities a backend may declare past it). Backends import their
heavy dependencies (torch, vllm) lazily so the core stays importable without them. A pip-installed
package adds a spec kind through the `mismatch.engines` entry-point group (README.md beside this
file says what a backend provides).
"""

from __future__ import annotations

import importlib
from typing import Any

from mismatch.engines.contract import (
    BASIC,
    Capabilities,
    CapableEngine,
    Engine,
    ProgressFn,
    ReplayRequest,
    capabilities_of,
)
from mismatch.engines.spec import EngineSpec, parse_spec
from mismatch.errors import SpecError

TORCH_KINDS = ("hf", "hf-decode")  # torch models in this process: hooks (localize) and attn checks apply
MODEL_KINDS = ("hf", "hf-decode", "vllm")  # engines that run the checkpoint's model themselves

_BACKENDS: dict[str, str] = {
    "hf": "mismatch.engines.hf:HFEngine",
    "hf-decode": "mismatch.engines.hf_decode:HFDecodeEngine",
    "vllm": "mismatch.engines.vllm:VLLMEngine",
    "http": "mismatch.engines.http:HTTPEngine",
    "python": "mismatch.engines.user:UserEngine",
}


ENTRY_POINT_GROUP = "mismatch.engines"


def _plugins() -> dict[str, Any]:
    """Spec kinds other packages register (`[project.entry-points."mismatch.engines"]`, name =
    "pkg.module:Backend"); a built-in kind cannot be shadowed. Read at each call: cheap, and a
    package installed after import is seen."""
    from importlib.metadata import entry_points

    found = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name not in _BACKENDS and point.name not in ("stored", "sampler"):
            found.setdefault(point.name, point)
    return found


def engine_kinds() -> tuple[str, ...]:
    return (*_BACKENDS, *sorted(_plugins()))


def check_spec(spec: str | EngineSpec) -> EngineSpec:
    """Every problem of a spec that shows without loading a model (unknown engine, unknown option,
    a value of the wrong type, an unknown dtype), so a typo costs nothing: every command checks
    all its specs before its first replay. Returns the parsed spec."""
    from mismatch.checkpoint import normalize_dtype
    from mismatch.engines.spec import options_from
    from mismatch.errors import CheckpointError

    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind in ("stored", "python"):  # a python: engine's options are its factory's to check
        return parsed
    backend = _backend(parsed)
    options = options_from(backend.options_cls, parsed)
    if hasattr(options, "dtype"):
        try:
            normalize_dtype(options.dtype)
        except CheckpointError as exc:
            raise SpecError(f"engine {parsed.kind!r}: {exc}") from None
    if parsed.kind == "vllm":  # values against vLLM's own arg schema (imports vLLM, loads nothing)
        from mismatch.engines.vllm import check_options

        check_options(options)
    checked = getattr(backend, "check_options", None)  # a backend's own checks of its values
    if callable(checked):
        checked(options, parsed.text)
    return parsed


def _backend(parsed: EngineSpec) -> Any:
    target = _BACKENDS.get(parsed.kind)
    if target is not None:
        module_name, _, class_name = target.partition(":")
        return getattr(importlib.import_module(module_name), class_name)
    plugin = _plugins().get(parsed.kind)
    if plugin is None:
        raise SpecError(f"unknown engine {parsed.kind!r} in spec {parsed.text!r} "
                        f"(known: {', '.join(engine_kinds())})")
    try:
        backend = plugin.load()
    except Exception as exc:  # a plug-in that does not import is the user's install to fix
        raise SpecError(f"engine {parsed.kind!r} ({plugin.value}, entry point of "
                        f"{getattr(plugin.dist, 'name', '?')}): cannot load it: {exc}") from None
    for needed in ("options_cls", "from_spec"):
        if not hasattr(backend, needed):
            raise SpecError(f"engine {parsed.kind!r} ({plugin.value}): has no {needed} "
                            "(see mismatch/engines/README.md)")
    return backend


def engine_capabilities(spec: str | EngineSpec) -> Capabilities:
    """What the engine a spec names can do past the basic contract, known before it loads (the
    backend class declares it): stored log-probs and `python:` engines, nothing more."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind in ("stored", "python"):
        return BASIC
    return capabilities_of(_backend(parsed))


def probe_top_logprobs(spec: str | EngineSpec, k: int) -> None:
    """Before any replay (--distribution K): an engine whose top-K depends on how it was started
    (a server's --max-logprobs) asks for it once (its backend's `probe_top_logprobs(spec, k)`,
    raising SpecError); others are known from their class alone."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind in ("stored", "python"):
        return
    probe = getattr(_backend(parsed), "probe_top_logprobs", None)
    if callable(probe):
        probe(parsed, k)


def load_engine(spec: str | EngineSpec, checkpoint: str) -> Engine:
    """Build the engine a spec names; every spec accepts `checkpoint=PATH` to replay other weights."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind == "stored":
        raise SpecError(f"{parsed.text!r} names stored log-probs, not an engine to run")
    return _backend(parsed).from_spec(parsed, checkpoint)


__all__ = ["MODEL_KINDS", "TORCH_KINDS", "Capabilities", "CapableEngine", "Engine", "EngineSpec", "ProgressFn",
           "ReplayRequest", "check_spec", "engine_capabilities", "engine_kinds", "load_engine", "parse_spec"]
