"""Each pair's gap under the names the training frameworks log, computed their way (clamps,
reductions per sequence or per rollout, default thresholds), beside our own metrics.

Flow: token table, chunk by chunk (analysis/chunked.py) -> PairArrays per pair and chunk -> each
metric's values -> one reduction over all chunks -> summary.json["framework_metrics"][pair][framework][key].
The metrics themselves live with the rest of each framework's knowledge (its module beside this
one), read from its source at the commit its module names; `ours` names our pair metric
when the framework's is the same number, and `note` says how it differs when it is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis.chunked import Chunk, Chunks, run_passes
from mismatch.results.chunks import table_chunks
from mismatch.analysis.moments import Moments
from mismatch.analysis.radix_select import RadixSelect
from mismatch.analysis.groups import dot
from mismatch.frameworks.pair_arrays import PairArrays
from mismatch.frameworks.protocol import FrameworkMetric, Target
from mismatch.frameworks.registry import MODULES

Settings = dict[str, dict[str, Any]]  # framework -> its correction settings (its own names)


def settings_used(targets: Sequence[Target] | Settings = ()) -> Settings:
    """Each framework's settings: a target's (over its defaults), the others' defaults; also
    summary.json["framework_settings"], what the metrics were computed with. `targets`: Targets, or
    framework -> settings (AuditOptions.framework_settings)."""
    chosen = ({name: dict(values) for name, values in targets.items()} if isinstance(targets, dict)
              else {target.framework: target.settings for target in targets})
    return {name: {**module.DEFAULTS, **chosen.get(name, {})} for name, module in MODULES.items()}


def declared_settings(sampler_meta: Any) -> Settings:
    """settings_used() with what the run declared in its rollouts' meta.sampler.framework_settings
    (a dump hook records its trainer's IS settings there: TRL's), so the audit's framework metrics
    are the ones the run logged. Each is checked as `--for` checks it (registry.parse_target); an
    undeclared or unreadable one stays at the release's default."""
    from mismatch.errors import MismatchError
    from mismatch.frameworks.registry import parse_target

    declared = sampler_meta.get("framework_settings") if isinstance(sampler_meta, dict) else None
    targets = []
    for name, values in (declared.items() if isinstance(declared, dict) else ()):
        if name not in MODULES or not isinstance(values, dict) or not values:
            continue
        text = f"{name}:" + ",".join(f"{key}={_setting_text(value)}" for key, value in values.items())
        try:
            target = parse_target(text, detect=False)
            MODULES[name].metrics({**MODULES[name].DEFAULTS, **target.settings})  # a mode its metrics know
        except (MismatchError, ValueError, TypeError, KeyError):
            continue
        targets.append(target)
    return settings_used(targets)


def _setting_text(value: Any) -> str:
    """A JSON value as `--for` writes it: null, true/false, the number or the string."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def build_metrics(settings: Settings) -> tuple[FrameworkMetric, ...]:
    """The metrics of the frameworks in `settings`, at those settings. The settings decide what a
    weight statistic logs (verl's ESS at its rollout_is level and threshold, TRL's ratio after its
    mode's mask or truncation, ...)."""
    return tuple(metric for name, values in settings.items() for metric in MODULES[name].metrics(values))


# Each framework's metrics at its newest read release's default correction settings.
FRAMEWORK_METRICS: tuple[FrameworkMetric, ...] = build_metrics(settings_used())


def chunk_pair_arrays(chunk: Chunk, a: str, b: str) -> PairArrays:
    """The pair's trainable tokens where both log-probs are defined, with their sequence (a
    rollout's branch) and rollout, from the chunk's shared trainable view (made once)."""
    pair = chunk.pair(f"logp_{a}", f"logp_{b}")
    view = pair.view
    return PairArrays(logp_a=pair.logp_a, logp_b=pair.logp_b, seq=view.spans.spread(view.span_seq),
                      rollout=view.spans.spread(view.span_rollout), log_ratio=pair.log_ratio, tokens=pair)


class _Reduction:
    """One metric's values from every chunk, reduced as FrameworkMetric.reduce says."""

    def __init__(self, how: str) -> None:
        self.how, self.n = how, 0
        self.total, self.total_sq, self.top, self.bottom = 0.0, 0.0, -math.inf, math.inf
        self.moments = Moments()  # std, Pearson

    def add(self, values: np.ndarray) -> None:
        count = values.shape[-1]
        if not count:
            return
        if self.how in ("std", "pearson"):
            self.moments.add(values)
        elif self.how == "max":
            self.top = max(self.top, float(values.max()))
        elif self.how == "min":
            self.bottom = min(self.bottom, float(values.min()))
        else:  # mean, ess, ess_eps (and median's count; its order statistics take passes of their own)
            self.total += float(values.sum())
            self.total_sq += dot(values, values) if self.how in ("ess", "ess_eps") else 0.0
        self.n += count

    def merge(self, other: _Reduction) -> None:
        self.moments.merge(other.moments)
        self.top, self.bottom = max(self.top, other.top), min(self.bottom, other.bottom)
        self.total += other.total
        self.total_sq += other.total_sq
        self.n += other.n

    def value(self) -> float:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if self.how == "mean":
                return self.total / self.n
            if self.how == "max":
                return self.top
            if self.how == "min":
                return self.bottom
            if self.how == "ess":
                return float(np.float64(self.total) ** 2 / (self.n * np.float64(self.total_sq)))
            if self.how == "ess_eps":
                return float((np.float64(self.total) / self.n + 1e-8) ** 2 / (np.float64(self.total_sq) / self.n))
            comoment = self.moments.comoment
            assert comoment is not None
            if self.how == "std":
                return float(np.sqrt(comoment[0, 0] / (self.n - 1))) if self.n > 1 else math.nan
            return float(comoment[0, 1] / np.sqrt(comoment[0, 0] * comoment[1, 1]))


class FrameworkMetrics:
    """{"A/B": {framework: {key: value}}} over the chunks' trainable tokens (an Analysis): every
    reduction in pass 0, which also histograms each median's values; the medians' few more passes
    (RadixSelect) after it."""

    def __init__(self, pairs: Sequence[tuple[str, str]], settings: Settings | None = None) -> None:
        self.pairs, self.settings = list(pairs), settings if settings is not None else settings_used()
        self.metrics = build_metrics(self.settings)
        self.reductions = {(pair, metric.key): _Reduction(metric.reduce) for pair in self.pairs
                           for metric in self.metrics}
        self.medians = {(pair, metric.key): RadixSelect() for pair in self.pairs
                        for metric in self.metrics if metric.reduce == "median"}
        self.pending: set[tuple[tuple[str, str], str]] = set()

    def __getstate__(self) -> dict[str, Any]:
        # The metrics' values are closures over their settings: pickled as the settings, rebuilt.
        return {key: value for key, value in vars(self).items() if key != "metrics"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.metrics = build_metrics(self.settings)

    def wants(self, index: int) -> bool:
        if index == 0:
            return True
        if index == 1:  # the medians' ranks, now that pass 0 counted their values
            self.pending = {key for key, select in self.medians.items() if select.n}
        self.pending = {key for key in self.pending
                        if self.medians[key].end_pass(lambda n: sorted({(n - 1) // 2, n // 2}))}
        return bool(self.pending)

    def add(self, chunk: Chunk, index: int) -> None:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for a, b in self.pairs:
                arrays = chunk.memo(("pair_arrays", a, b), lambda a=a, b=b: chunk_pair_arrays(chunk, a, b))
                if not len(arrays.logp_a):
                    continue
                # Keys that reduce the same values differently (verl's per-sequence mean weight: its
                # mean, std, max, min) share one computation of them per pair and chunk.
                made: dict[int, np.ndarray] = {}
                for metric in self.metrics:
                    key = ((a, b), metric.key)
                    if index == 0:
                        values = _made(made, metric, arrays)
                        self.reductions[key].add(values)
                        if key in self.medians:
                            self.medians[key].add(values)
                    elif key in self.pending:
                        self.medians[key].add(_made(made, metric, arrays))

    def merge(self, other: FrameworkMetrics, index: int) -> None:
        if index == 0:
            for key, reduction in self.reductions.items():
                reduction.merge(other.reductions[key])
        for key, select in self.medians.items():
            if index == 0 or key in self.pending:
                select.merge(other.medians[key])

    def result(self) -> dict[str, dict[str, dict[str, float | None]]]:
        out: dict[str, dict[str, dict[str, float | None]]] = {}
        for a, b in self.pairs:
            found: dict[str, dict[str, float | None]] = {}
            for metric in self.metrics:
                reduction = self.reductions[(a, b), metric.key]
                value = None
                if reduction.n:
                    value = (float(np.mean(self.medians[(a, b), metric.key].values)) if metric.reduce == "median"
                             else reduction.value()) + metric.offset
                found.setdefault(metric.framework, {})[metric.key] = value
            out[f"{a}/{b}"] = found
        return out


def _made(made: dict[int, np.ndarray], metric: FrameworkMetric, arrays: PairArrays) -> np.ndarray:
    """metric.values(arrays), made once per values function (the metrics hold them: ids stay theirs)."""
    key = id(metric.values)
    if key not in made:
        made[key] = metric.values(arrays)
    return made[key]


def framework_metrics(chunks: Chunks, pairs: Sequence[tuple[str, str]],
                      settings: Settings | None = None) -> dict[str, dict[str, dict[str, float | None]]]:
    """FrameworkMetrics of a table's chunks (every framework at its defaults without `settings`);
    None where the pair has no tokens."""
    found = FrameworkMetrics(pairs, settings)
    run_passes(chunks, [found])
    return found.result()


def table_framework_metrics(table: pd.DataFrame, pairs: Sequence[tuple[str, str]],
                            settings: Settings | None = None) -> dict[str, Any]:
    """`framework_metrics` of a token table in memory."""
    return framework_metrics(table_chunks(table), pairs, settings)


def crosswalk_rows() -> list[dict[str, Any]]:
    """The README's and the report's table: each framework key, our metric when it is the same
    number, and how it differs otherwise."""
    return [{"framework": m.framework, "key": m.key, "ours": m.ours, "note": m.note} for m in FRAMEWORK_METRICS]
