"""What every release driver shares: read the payload, answer one JSON line, and the import-time
stand-ins for the few runtime packages (ray, deepspeed, ...) that a framework's config or loss
module imports at module level but never calls on the paths the drivers drive."""

from __future__ import annotations

import json
import os
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any


class _Absent(types.ModuleType):
    """A module that can be imported and have names taken from it, and raises if anything of it is
    called: a stand-in, never a fake that answers."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent_callable(f"{self.__name__}.{name}")


def _absent_callable(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is an import-time stand-in in the release tests; it was called")

    class Absent:  # usable as a base class and as a decorator, like ray.remote
        def __init_subclass__(cls, **kwargs: Any) -> None:
            pass

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            return call(*args, **kwargs)

    Absent.__name__ = name.rsplit(".", 1)[-1]
    return Absent


def stand_in(*names: str) -> None:
    """Register import-time stand-ins for `names` (and their parents) unless really installed."""
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in sys.modules:
                module = _Absent(sub)
                module.__path__ = []  # a package, so submodules import
                sys.modules[sub] = module


def release() -> tuple[str, str]:
    framework, _, version = os.environ["MISMATCH_RELEASE"].partition("==")
    return framework, version


def main(handler: Callable[[dict[str, Any]], Any], refusals: tuple[type[BaseException], ...] = (Exception,)) -> None:
    """Run `handler` on the payload; print {"result": ...}, or {"refused": "Type: message"} when the
    release raised one of `refusals` (SystemExit counts: argparse refuses that way). A payload
    {"batch": [payload, ...]} runs each in turn in this one process (imports paid once) and answers
    {"result": [answer, ...]}."""
    payload = json.loads(sys.stdin.read())
    if "batch" in payload:
        print(json.dumps({"result": [_answer(handler, item, refusals) for item in payload["batch"]]}, default=float))
        return
    print(json.dumps(_answer(handler, payload, refusals), default=float))


def _answer(handler: Callable[[dict[str, Any]], Any], payload: dict[str, Any],
            refusals: tuple[type[BaseException], ...]) -> dict[str, Any]:
    try:
        result = handler(payload)
    except (*refusals, SystemExit) as error:
        traceback.print_exc()
        message = str(error) or repr(error)
        return {"refused": f"{type(error).__name__}: {message}"}
    return {"result": result}
