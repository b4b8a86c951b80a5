"""`python:MODULE:CALLABLE`: a user's own engine (Megatron, TorchTitan, anything) in the audit.

The callable is a factory `factory(checkpoint: str, **options) -> engine`, the options from the
spec (`python:MODULE:CALLABLE,key=value`) or a TOML; the engine needs only
`replay(requests, progress=None) -> list[np.ndarray]` (see `mismatch.engines.Engine`); `describe()`
and `close()` are optional. `examples/custom_engine.py` wraps a plain torch module this way.
Everything the user's code does, it does inside `_user_code`: what it raises, a `sys.exit`, and
what it returns that is no list of number arrays are one `EngineError` line (exit 2).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from mismatch.engines.contract import ProgressFn, ReplayRequest
from mismatch.engines.spec import EngineSpec, convert_option, scalar_type
from mismatch.errors import EngineError, MismatchError, SpecError

T = TypeVar("T")
# Kinds of arrays that hold numbers: float, signed and unsigned int (not bool, str, object).
NUMBER_KINDS = "fiu"


def _user_code(label: str, what: str, call: Callable[[], T]) -> T:
    """`call()`, the user's code: an exception it raises, or a sys.exit it calls (which would end
    the run with its code and no results), becomes one EngineError line; the traceback stays
    chained for MISMATCH_DEBUG=1. KeyboardInterrupt is an interrupt still, and a MismatchError
    the user's code raises on purpose is its own message."""
    try:
        return call()
    except MismatchError:
        raise
    except SystemExit as exc:
        code = "" if exc.code is None else repr(exc.code)
        raise EngineError(f"{label}: {what} called sys.exit({code})") from exc
    except Exception as exc:
        reason = " ".join(str(exc).split())[:300]
        raise EngineError(f"{label}: {what} raised {type(exc).__name__}"
                          f"{': ' + reason if reason else ''} (MISMATCH_DEBUG=1 shows where)") from exc


def import_target(target: str) -> Any:
    """`pkg.module:name` or `path/to/file.py:name` → the object."""
    module_name, _, attr = target.rpartition(":")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise SpecError(f"python engine {target!r}: file {path} not found")
        spec = importlib.util.spec_from_file_location(f"mismatch_user_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        _user_code(f"python engine {target!r}", "importing it", lambda: spec.loader.exec_module(module))
    else:
        module = _user_code(f"python engine {target!r}", "importing it", lambda: _import(target, module_name))
    if not hasattr(module, attr):
        raise SpecError(f"python engine {target!r}: {module_name} has no attribute {attr!r}")
    return getattr(module, attr)


def _import(target: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"python engine {target!r}: cannot import {module_name}: {exc}") from None


def factory_options(factory: Callable[..., Any], spec: EngineSpec,
                    options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `factory` gets: each option checked against its signature and typed
    by its annotation (`batch: int` turns "8" into 8), as a backend's options dataclass would."""
    label = f"python engine {spec.text!r}"
    signature = _signature(factory)
    if signature is None:
        return dict(options)
    parameters = list(signature.parameters.values())[1:]  # the first one takes the checkpoint
    named = {p.name: p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        unknown = sorted(set(options) - set(named))
        if unknown:
            raise SpecError(f"{label}: unknown option {unknown[0]!r} "
                            f"(valid: {', '.join(sorted([*named, 'checkpoint']))})")
    typed = {}
    for key, raw in options.items():
        target = scalar_type(named[key].annotation) if key in named else None
        typed[key] = raw if target is None else convert_option(label, key, raw, target)
    return typed


def _signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(factory, eval_str=True)
    except (TypeError, ValueError):  # some C callables have none: their options go as written
        return None
    except Exception:  # an annotation of the user's that does not evaluate: names still hold
        return inspect.signature(factory)


class UserEngine:
    """Wraps the user's engine: fills in describe/close and checks what replay returns."""

    def __init__(self, inner: Any, spec_text: str, options: dict[str, Any]) -> None:
        if not callable(getattr(inner, "replay", None)):
            raise SpecError(f"python engine {spec_text!r}: the factory returned "
                            f"{type(inner).__name__}, which has no replay(requests) method")
        self.inner = inner
        self.spec_text = spec_text
        self.options = options

    @classmethod
    def from_spec(cls, spec: EngineSpec, checkpoint: str) -> UserEngine:
        options = dict(spec.options)
        factory = import_target(options.pop("target"))
        # Every spec accepts checkpoint=PATH (ARCHITECTURE.md, "Engine specs"): it replaces the
        # audited checkpoint as the factory's first argument rather than reaching it as a second one.
        replaced = options.pop("checkpoint", None)
        keywords = factory_options(factory, spec, options)
        name = target_name(spec)
        engine = _user_code(f"python engine {spec.text!r}", name,
                            lambda: factory(checkpoint if replaced is None else str(replaced), **keywords))
        return cls(engine, spec.text, {**keywords, "checkpoint": replaced})

    @property
    def _label(self) -> str:
        return f"python engine {self.spec_text!r}"

    def describe(self) -> dict[str, Any]:
        extra = _user_code(self._label, "describe", self.inner.describe) \
            if callable(getattr(self.inner, "describe", None)) else {}
        if not isinstance(extra, dict):
            raise EngineError(f"{self._label}: describe returned {type(extra).__name__}, not a dict")
        return {"kind": "python", "spec": self.spec_text, "options": self.options,
                "logprob_semantics": "unknown", **extra}

    def replay(self, requests: Sequence[ReplayRequest], *,
               progress: ProgressFn | None = None) -> list[np.ndarray]:
        returned = _user_code(self._label, "replay", lambda: self.inner.replay(requests, progress=progress))
        if isinstance(returned, (str, bytes, dict)) or not isinstance(returned, Iterable):
            raise EngineError(f"{self._label}: replay returned {type(returned).__name__}, not a list of arrays "
                              "(one per request)")
        results = _user_code(self._label, "replay", lambda: list(returned))  # a generator runs their code
        if len(results) != len(requests):
            raise EngineError(f"{self._label}: replay returned {len(results)} "
                              f"arrays for {len(requests)} requests")
        return [self._checked(index, request, logp) for index, (request, logp) in enumerate(zip(requests, results))]

    def _checked(self, index: int, request: ReplayRequest, logp: Any) -> np.ndarray:
        """One request's log-probs as float64: an array (or list, tensor) of numbers of its shape."""
        where = f"{self._label}: request {index}"
        array = _user_code(self._label, f"request {index}: converting its result", lambda: np.asarray(logp))
        if array.dtype.kind not in NUMBER_KINDS:
            raise EngineError(f"{where}: returned an array of {array.dtype}, not of numbers")
        if array.shape != (request.num_scored,):
            raise EngineError(f"{where}: got {array.shape} log-probs, expected ({request.num_scored},)")
        return array.astype(np.float64, copy=False)

    def close(self) -> None:
        if callable(getattr(self.inner, "close", None)):
            _user_code(self._label, "close", self.inner.close)


def target_name(spec: EngineSpec) -> str:
    """The callable's name in a spec's MODULE:CALLABLE target (`make` of python:engine.py:make)."""
    return str(spec.options.get("target", "")).rpartition(":")[2] or "the factory"

