"""Several drivers' payloads in one process, so a release's packages are imported once for every
test that asks something of it: {"DRIVER": [payload, ...], ...} -> {"result": {"DRIVER": [answer, ...]}}."""

from __future__ import annotations

import importlib
import json
import sys

from _driver import _answer

if __name__ == "__main__":
    asked = json.loads(sys.stdin.read())
    answers = {}
    for name, payloads in asked.items():
        module = importlib.import_module(name)
        refusals = getattr(module, "REFUSALS", (Exception,))
        answers[name] = [_answer(module.handle, payload, refusals) for payload in payloads]
    print(json.dumps({"result": answers}, default=float))
