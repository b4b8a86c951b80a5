"""mismatch: measure, localize and correct the log-prob gap between an RL trainer and its engine.

The library API; `mismatch.cli` is a thin layer over it. The public names load on first use
(PEP 562), so `import mismatch` and `mismatch --help` pay for neither pandas, torch nor vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mismatch.version import __version__  # noqa: E402  (a leaf: no import)

from mismatch.errors import MismatchError, RolloutError  # noqa: E402  (light: no third-party import)

# public name -> the module that defines it
_LAZY = {
    "PAIR_METRICS": "mismatch.analysis.metrics", "metrics_by": "mismatch.analysis.metrics",
    "pair_metrics": "mismatch.analysis.metrics", "summarize_pairs": "mismatch.analysis.metrics",
    "iter_rollouts": "mismatch.rollouts", "load_rollouts": "mismatch.rollouts",
    "validate_file": "mismatch.rollouts",
    "AuditResult": "mismatch.pipeline.audit", "audit": "mismatch.pipeline.audit",
}

if TYPE_CHECKING:
    from mismatch.analysis.metrics import PAIR_METRICS, metrics_by, pair_metrics, summarize_pairs
    from mismatch.pipeline.audit import AuditResult, audit
    from mismatch.rollouts import iter_rollouts, load_rollouts, validate_file


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mismatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["PAIR_METRICS", "AuditResult", "MismatchError", "RolloutError", "audit", "iter_rollouts",
           "load_rollouts", "metrics_by", "pair_metrics", "summarize_pairs", "validate_file"]
