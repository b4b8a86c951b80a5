"""mismatch: measure, localize and correct the log-prob gap between an RL trainer and its engine.

The library API; `mismatch.cli` is a thin layer over it. Importing it needs neither torch nor vLLM
(engines import their backends on first use).
"""

from __future__ import annotations

__version__ = "0.1.0"

from mismatch.errors import MismatchError, RolloutError  # noqa: E402
from mismatch.metrics import PAIR_METRICS, metrics_by, pair_metrics, summarize_pairs  # noqa: E402
from mismatch.rollouts import iter_rollouts, load_rollouts, validate_file  # noqa: E402
from mismatch.audit import AuditResult, audit  # noqa: E402  (binds the function over the module name)

__all__ = ["PAIR_METRICS", "AuditResult", "MismatchError", "RolloutError", "audit", "iter_rollouts",
           "load_rollouts", "metrics_by", "pair_metrics", "summarize_pairs", "validate_file"]
