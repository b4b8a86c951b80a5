"""The steps of a training run as `mismatch trend` reads them: one audit's results dir per step.

Only summary.json and the small per-rollout table are read (a step of 10⁴ rollouts is ~10⁴ rows
per pair), never tokens.parquet: a run of hundreds of steps is seconds and a step's memory.
What a step keeps is the slice trend uses; the summary itself is dropped once read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mismatch.errors import ResultsError
from mismatch.results import ROLLOUTS_FILE, read_summary

# Token-weighted means over a pair's trainable tokens: the run's value is Σ n_i m_i / Σ n_i over its
# rollouts' own values (rollouts.parquet), so their spread over rollouts gives a CI. The quantiles,
# maxima and ESS do not decompose so: they have a value per step and no CI.
MEAN_METRICS = ("kl_k3", "kl_k1", "kl_k2", "log_ratio_abs_mean", "log_ratio_mean", "chi2_token",
                "prob_abs_diff_mean", "ratio_mean", "bitwise_equal_frac")
Z95 = 1.959963984540054  # the normal 97.5% quantile: the CI is the delta method's, over rollouts
# What an engine reports of its own run (time, counters, the step's checkpoint path) rather than of
# how it is configured: left out when two steps' engines are compared.
_RUN_FACTS = frozenset({"seconds", "tokens_per_s", "load_seconds", "first_replay_seconds", "resumed_blocks",
                        "padding_frac", "checkpoint", "num_rollouts_differing"})
_STEP_IN_NAME = re.compile(r"(\d+)(?!.*\d)")  # the last number in a name: step_12, global_step_12, ckpt-12


@dataclass(kw_only=True, slots=True)
class Step:
    """One step: where it was read, its number, and the parts of its summary trend uses."""

    step: int
    path: Path
    step_from: str                      # "directory name", "checkpoint name", "order" or "meta.step"
    checkpoint: str
    pairs: dict[str, dict[str, Any]]    # pair -> metric -> value (summary.json `pairs`)
    ci: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)  # pair -> metric -> (low, high)
    frameworks: dict[str, dict[str, float]] = field(default_factory=dict)  # pair -> "verl:rollout_corr/kl" -> value
    turns: list[dict[str, Any]] = field(default_factory=list)
    branch_kinds: list[dict[str, Any]] = field(default_factory=list)
    strata: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, Any] | None = None
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # configuration facts only
    headline: str = ""
    has_report: bool = False
    mismatch_version: str = ""  # the audit's own: two versions may measure differently

    def value(self, pair: str, metric: str) -> float:
        value = self.pairs.get(pair, {}).get(metric)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def load_steps(paths: list[Path]) -> list[Step]:
    """Each results dir as a Step, in step order. Steps come from the directories' names (the last
    number in each: step_12, global_step_12), else their checkpoints' names, else the order given;
    two dirs of one step are refused. One dir alone is a step-indexed dump's audit, split by step."""
    if not paths:
        raise ResultsError("trend: no results dirs given")
    seen: dict[Path, Path] = {}
    for path in paths:
        if path.resolve() in seen:
            raise ResultsError(f"trend: {path} is given twice (as {seen[path.resolve()]}); give each step's dir once")
        seen[path.resolve()] = path
    summaries = [(path, read_summary(path)) for path in paths]
    if len(paths) == 1:  # one audit of a step-indexed dump, split by its rollouts' steps
        _check_audit(*summaries[0])
        steps = split_by_step(*summaries[0])
        if len(steps) < 2:
            raise ResultsError(f"trend: {paths[0]} holds {len(steps) or 'no'} training step"
                               f"{'' if len(steps) == 1 else 's'} (rollouts.parquet `step`, from meta.step); give "
                               "one results dir per step, or one audit of a dump whose rollouts carry meta.step")
        return steps
    numbers, source = _step_numbers(summaries)
    steps = [_step(path, summary, number, source) for (path, summary), number in zip(summaries, numbers)]
    steps.sort(key=lambda step: step.step)
    for before, after in zip(steps, steps[1:]):
        if before.step == after.step:
            raise ResultsError(f"trend: {before.path} and {after.path} are both step {before.step} "
                               f"(steps from the {source}); give one results dir per step")
    return steps


def _step_numbers(summaries: list[tuple[Path, dict[str, Any]]]) -> tuple[list[int], str]:
    """Every dir's step from one source, the first that names a step for all of them."""
    for source, names in (("directory name", [path.resolve().name for path, _ in summaries]),
                          ("checkpoint name", [Path(str(summary.get("checkpoint", ""))).name for _, summary in summaries])):
        found = [_STEP_IN_NAME.search(name) for name in names]
        numbers = [int(match.group(1)) for match in found if match is not None]
        if len(numbers) == len(names):  # two of one step are refused, not read in another order
            return numbers, source
    return list(range(len(summaries))), "order"


def _check_audit(path: Path, summary: dict[str, Any]) -> None:
    if summary.get("command") != "audit":
        raise ResultsError(f"{path}: a {summary.get('command')} results dir; trend reads audits (one per step)")


def _step(path: Path, summary: dict[str, Any], number: int, step_from: str) -> Step:
    _check_audit(path, summary)
    localization = summary.get("localization") or {}
    verdicts = summary.get("verdicts") or {}
    first = verdicts.get("train/sampler") or next(iter(verdicts.values()), {})
    step = Step(step=number, path=path, step_from=step_from, checkpoint=str(summary.get("checkpoint", "")),
                pairs=_with_distribution({name: dict(metrics) for name, metrics in (summary.get("pairs") or {}).items()
                                          if isinstance(metrics, dict)}, summary.get("distribution")),
                frameworks=_framework_metrics(summary.get("framework_metrics") or {}),
                turns=list(summary.get("turns") or []), branch_kinds=list(summary.get("branch_kinds") or []),
                strata=dict(summary.get("strata") or {}),
                layers=localization.get("layers") if isinstance(localization.get("layers"), dict) else None,
                engines={source: configuration(engine) for source, engine in (summary.get("engines") or {}).items()
                         if isinstance(engine, dict)},
                headline=str(first.get("text", "")) if isinstance(first, dict) else "",
                has_report=(path / "index.html").is_file(), mismatch_version=str(summary.get("mismatch_version", "")))
    step.ci = _confidence_intervals(path)
    return step


DISTRIBUTION_METRICS = ("kl", "tv_mean", "argmax_agree_frac")  # read as "dist.NAME" (docs/distribution.md)


def _with_distribution(pairs: dict[str, dict[str, Any]], found: Any) -> dict[str, dict[str, Any]]:
    """A step's pair metrics with its --distribution means, where it measured them, as `dist.NAME`
    (the gate's names), so `Step.value(pair, "dist.kl")` reads them like any metric."""
    for pair, entry in (found.items() if isinstance(found, dict) else ()):
        if isinstance(entry, dict) and pair in pairs:
            pairs[pair].update({f"dist.{name}": entry.get(name) for name in DISTRIBUTION_METRICS})
    return pairs


def configuration(engine: dict[str, Any]) -> dict[str, Any]:
    """An engine's facts of how it is configured (kind, spec, options, dtype, versions, the
    sampler's declared meta), flattened to dotted keys; what it reports of its own run left out."""
    flat: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key not in _RUN_FACTS and not str(key).startswith("num_"):
                    walk(item, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = value

    walk(engine, "")
    return flat


def _framework_metrics(found: dict[str, Any]) -> dict[str, dict[str, float]]:
    """summary.json `framework_metrics` as pair -> "framework:name" -> value (numbers only)."""
    out: dict[str, dict[str, float]] = {}
    for pair, frameworks in found.items():
        if not isinstance(frameworks, dict):
            continue
        out[pair] = {f"{framework}:{name}": float(value)
                     for framework, metrics in frameworks.items() if isinstance(metrics, dict)
                     for name, value in metrics.items()
                     if isinstance(value, (int, float)) and not isinstance(value, bool)}
    return out


def _confidence_intervals(path: Path) -> dict[str, dict[str, tuple[float, float]]]:
    """Per pair, each mean metric's 95% CI over rollouts (rollouts.parquet); none without the file."""
    table = _per_rollout(path)
    if table is None:
        return {}
    return {str(pair): {metric: ci for metric, (_, ci) in _means(rows).items() if ci is not None}
            for pair, rows in table.groupby("pair", observed=True, sort=False)}


def _per_rollout(path: Path, extra: tuple[str, ...] = ()) -> Any:
    """rollouts.parquet's pair, token count and mean metrics (and `extra` columns), or None."""
    import pyarrow.parquet as pq

    file = path / ROLLOUTS_FILE
    if not file.is_file():
        return None
    names = pq.read_schema(file).names
    columns = ["pair", "n_tokens", *(m for m in (*MEAN_METRICS, *extra) if m in names)]
    return pq.read_table(file, columns=columns).to_pandas()


def _means(rows: Any) -> dict[str, tuple[float, tuple[float, float] | None]]:
    """Each mean metric over these rollouts' rows: Σ n_i m_i / Σ n_i, and its 95% CI by the delta
    method for a ratio estimator with rollouts as clusters (None with fewer than 2 rollouts)."""
    n = rows["n_tokens"].to_numpy(np.float64)
    out: dict[str, tuple[float, tuple[float, float] | None]] = {}
    for metric in (m for m in MEAN_METRICS if m in rows.columns):
        values = rows[metric].to_numpy(np.float64)
        keep = np.isfinite(values) & (n > 0)
        if not keep.any():
            continue
        weights, kept = n[keep], values[keep]
        estimate = float(np.sum(weights * kept) / weights.sum())
        k, ci = int(keep.sum()), None
        if k >= 2:
            se = math.sqrt(k / (k - 1) * np.sum((weights * (kept - estimate)) ** 2)) / weights.sum()
            ci = (estimate - Z95 * se, estimate + Z95 * se)
        out[metric] = (estimate, ci)
    return out


def split_by_step(path: Path, summary: dict[str, Any]) -> list[Step]:
    """One audit of a step-indexed dump (its rollouts.parquet has each rollout's `step`, from
    meta.step) as one Step per training step: the mean metrics and their CIs per step, from the
    rollouts' own values. What needs the token table per step (quantiles, turns, strata) is not
    there: an audit per step gives it."""
    table = _per_rollout(path, ("step",))
    if table is None or "step" not in table.columns:
        return []
    table = table.dropna(subset=["step"])
    engines = {source: configuration(engine) for source, engine in (summary.get("engines") or {}).items()
               if isinstance(engine, dict)}
    steps = []
    for number, rows in table.groupby("step", sort=True):
        pairs, ci = {}, {}
        for pair, pair_rows in rows.groupby("pair", observed=True, sort=False):
            found = _means(pair_rows)
            pairs[str(pair)] = {"n_tokens": int(pair_rows["n_tokens"].sum()), "n_rollouts": len(pair_rows),
                                **{metric: estimate for metric, (estimate, _) in found.items()}}
            ci[str(pair)] = {metric: interval for metric, (_, interval) in found.items() if interval is not None}
        steps.append(Step(step=int(number), path=path, step_from="meta.step", checkpoint=str(summary.get("checkpoint", "")),
                          pairs=pairs, ci=ci, engines=engines))  # the one report is the whole run's
    return steps
