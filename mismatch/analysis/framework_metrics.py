"""Each pair's gap under the names the training frameworks log, computed their way (clamps,
reductions per sequence or per rollout, default thresholds), beside our own metrics.

Flow: token table -> PairArrays per pair -> summary.json["framework_metrics"][pair][framework][key].
The metrics themselves live with the rest of each framework's knowledge (mismatch/frameworks/),
read from its source at the commit its module names; `ours` names our pair metric
when the framework's is the same number, and `note` says how it differs when it is not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis.groups import key_codes
from mismatch.frameworks import MODULES
from mismatch.frameworks._common import FrameworkMetric, PairArrays

FRAMEWORK_METRICS: tuple[FrameworkMetric, ...] = tuple(metric for module in MODULES.values() for metric in module.METRICS)


def pair_arrays(table: pd.DataFrame, a: str, b: str) -> PairArrays:
    """The pair's trainable tokens where both log-probs are defined (a sequence is a rollout's branch).

    Every token table mismatch writes keeps a branch's rows, and a rollout's, together, so a
    group is a stretch of equal keys and is numbered by counting stretches (no sort)."""
    logp_a, logp_b = (table[f"logp_{name}"].to_numpy(np.float64) for name in (a, b))
    keep = table["trainable"].to_numpy(dtype=bool) & ~np.isnan(logp_a - logp_b)
    rollout = key_codes(table["rollout"])[keep]
    branch = key_codes(table["branch"])[keep]
    new_rollout = _starts(rollout)
    return PairArrays(logp_a=logp_a[keep], logp_b=logp_b[keep],
                      seq=np.cumsum(new_rollout | _starts(branch)) - 1, rollout=np.cumsum(new_rollout) - 1)


def _starts(codes: np.ndarray) -> np.ndarray:
    """Where a stretch of equal codes begins."""
    return np.r_[True, codes[1:] != codes[:-1]] if len(codes) else np.zeros(0, dtype=bool)


def framework_metrics(pair: PairArrays) -> dict[str, dict[str, float | None]]:
    """{framework: {key: value}} for one pair; None where the pair has no tokens."""
    out: dict[str, dict[str, float | None]] = {}
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for metric in FRAMEWORK_METRICS:
            value = metric.compute(pair) if len(pair.logp_a) else None
            out.setdefault(metric.framework, {})[metric.key] = value
    return out


def crosswalk_rows() -> list[dict[str, Any]]:
    """The README's and the report's table: each framework key, our metric when it is the same
    number, and how it differs otherwise."""
    return [{"framework": m.framework, "key": m.key, "ours": m.ours, "note": m.note} for m in FRAMEWORK_METRICS]
