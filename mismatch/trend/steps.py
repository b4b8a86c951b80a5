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
from mismatch.results.section_records import LayerLocalization, NextTokenGap, Stratum
from mismatch.results.summary_model import BranchKindRow, Summary, TurnRow, present, to_builtins

# Token-weighted means over a pair's trainable tokens: the run's value is Σ n_i m_i / Σ n_i over its
# rollouts' own values (rollouts.parquet), so their spread over rollouts gives a CI. ESS is a function
# of two such means (_ess); the quantiles and maxima do not decompose so: a value per step, no CI here.
MEAN_METRICS = ("kl_k3", "kl_k1", "kl_k2", "log_ratio_abs_mean", "log_ratio_mean", "chi2_token",
                "prob_abs_diff_mean", "ratio_mean", "bitwise_equal_frac")
Z95 = 1.959963984540054  # the normal 97.5% quantile: the CI is the delta method's, over rollouts
# What an engine reports of its own run (time, counters, the step's checkpoint path) rather than of
# how it is configured: left out when two steps' engines are compared.
_RUN_FACTS = frozenset({"seconds", "tokens_per_s", "load_seconds", "first_replay_seconds", "resumed_blocks",
                        "padding_frac", "checkpoint", "num_rollouts_differing"})
# A step in a name: ASCII digits ending it (step_12, global_step_12, ckpt-12, 12), after a separator or a
# letter. Not a sign (step_-7, -7), an exponent (step_1e3), a decimal (step_1.5) or another script's digit.
_STEP_IN_NAME = re.compile(r"(?:^|(?<=[A-Za-z])[-+]?|(?<=[_.\s]))([0-9]+)$", re.ASCII)
_NOT_A_STEP = re.compile(r"(?:[_.\s][-+]|^[-+]|[0-9][eE.]|[0-9][eE][-+])[0-9]+$", re.ASCII)
ORDERS = ("names", "given")  # `--order`: steps from the names (strict), or the order the dirs are given in


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
    turns: list[TurnRow] = field(default_factory=list)
    branch_kinds: list[BranchKindRow] = field(default_factory=list)
    strata: dict[str, dict[str, Stratum]] = field(default_factory=dict)  # pair -> dimension -> its buckets
    layers: LayerLocalization | None = None  # the layer localizer's findings, where it ran
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # configuration facts only
    headline: str = ""
    has_report: bool = False
    mismatch_version: str = ""  # the audit's own: two versions may measure differently

    def value(self, pair: str, metric: str) -> float:
        value = self.pairs.get(pair, {}).get(metric)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def load_steps(paths: list[Path], *, order: str = "names") -> list[Step]:
    """Each results dir as a Step, in step order. With `order` "names", steps come from the
    directories' names (the ASCII digits ending each: step_12, global_step_12, ckpt-12), else from
    their checkpoints' names, when every one of them has one; otherwise the run is refused (one dir
    renamed `latest` must not silently reorder it). With "given", the order the dirs are given in.
    Two dirs of one step are refused. One dir alone is a step-indexed dump's audit, split by step."""
    if order not in ORDERS:
        raise ResultsError(f"trend: --order {order!r}: expected one of {', '.join(ORDERS)}")
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
    numbers, source = _step_numbers(summaries) if order == "names" else (list(range(len(paths))), "order")
    steps = [_step(path, summary, number, source) for (path, summary), number in zip(summaries, numbers)]
    steps.sort(key=lambda step: step.step)
    for before, after in zip(steps, steps[1:]):
        if before.step == after.step:
            raise ResultsError(f"trend: {before.path} and {after.path} are both step {before.step} "
                               f"(steps from the {source}); give one results dir per step")
    return steps


def _step_numbers(summaries: list[tuple[Path, Summary]]) -> tuple[list[int], str]:
    """Every dir's step from one source, the first that names a step for all of them; refused when
    neither does (the dirs' names say which lack one)."""
    dir_names = [path.resolve().name for path, _ in summaries]
    for source, names in (("directory name", dir_names),
                          ("checkpoint name", [Path(summary.checkpoint).name for _, summary in summaries])):
        numbers = [step_in_name(name) for name in names]
        if all(number is not None for number in numbers):  # two of one step are refused, not read in another order
            return [int(number) for number in numbers if number is not None], source
    without = [str(path) for (path, _), name in zip(summaries, dir_names) if step_in_name(name) is None]
    shown = ", ".join(without[:3]) + (f" and {len(without) - 3} more" if len(without) > 3 else "")
    raise ResultsError(f"trend: {shown}: no step number in the name (ASCII digits ending it, no sign: step_12), "
                       "nor in every checkpoint's name; rename it, or pass --order given to take the dirs in the "
                       "order given")


def step_in_name(name: str) -> int | None:
    """The step a directory or checkpoint name ends in (strict: see _STEP_IN_NAME), or None."""
    if _NOT_A_STEP.search(name) or any(c.isdigit() and not c.isascii() for c in name):
        return None
    found = _STEP_IN_NAME.search(name)
    return int(found.group(1)) if found is not None else None


def _check_audit(path: Path, summary: Summary) -> None:
    """An audit's dir (read_summary held its summary to the model) whose rollouts.parquet is the
    one it recorded (results.verify)."""
    from mismatch.results.verify import check_tables

    if summary.command != "audit":
        raise ResultsError(f"{path}: a {summary.command} results dir; trend reads audits (one per step)")
    check_tables(path, summary, tables=(ROLLOUTS_FILE,), required=())


def check_named(steps: list[Step], pair: str, metric: str) -> None:
    """Every step has `pair` and a value of `metric` (FRAMEWORK:NAME: a framework's, as trend reads
    it): a step without one would show a gap in the series and pass a trend gate unnamed."""
    lacking = []
    for step in steps:
        if ":" in metric:
            found = step.frameworks.get(pair, {}).get(metric)
        else:
            found = step.pairs.get(pair, {}).get(metric) if pair in step.pairs else None
        if pair not in step.pairs or found is None:
            lacking.append(step)
    if lacking:
        what = "no pair " + repr(pair) if pair not in lacking[0].pairs else f"no value of {metric} for {pair}"
        if metric.startswith("dist.") and pair in lacking[0].pairs and metric not in lacking[0].pairs[pair]:
            # summary.json has no `distribution` entry for the pair: the step was not measured, not zero
            what += " (ran without --distribution)"
        where = ", ".join(f"step {step.step} ({step.path})" for step in lacking[:3])
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise ResultsError(f"trend: {where}{more}: {what}; give the pair and metric every step has (--pair, --metric), "
                           "or leave those steps out")


def _step(path: Path, summary: Summary, number: int, step_from: str) -> Step:
    _check_audit(path, summary)
    first = summary.verdicts.get("train/sampler") or next(iter(summary.verdicts.values()), None)
    step = Step(step=number, path=path, step_from=step_from, checkpoint=summary.checkpoint,
                pairs=_with_distribution({name: to_builtins(metrics) for name, metrics in summary.pairs.items()},
                                         present(summary.distribution) or {}),
                frameworks=_framework_metrics(summary.section("framework_metrics")),
                turns=summary.turns, branch_kinds=summary.branch_kinds,
                strata=present(summary.strata) or {}, layers=present(summary.localization.layers),
                engines={source: configuration(engine) for source, engine in summary.engines.items()},
                headline=first.text if first is not None else "",
                has_report=(path / "index.html").is_file(), mismatch_version=summary.mismatch_version)
    step.ci = _confidence_intervals(path)
    return step




def _with_distribution(pairs: dict[str, dict[str, Any]], found: dict[str, NextTokenGap]) -> dict[str, dict[str, Any]]:
    """A step's pair metrics with its --distribution means, where it measured them, as `dist.NAME`
    (the gate's names), so `Step.value(pair, "dist.kl")` reads them like any metric."""
    for pair, gap in found.items():
        if pair in pairs:
            pairs[pair].update({"dist.kl": present(gap.kl), "dist.tv_mean": present(gap.tv_mean),
                                "dist.argmax_agree_frac": present(gap.argmax_agree_frac)})
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

    import pyarrow as pa

    file = path / ROLLOUTS_FILE
    if not file.is_file():
        return None
    try:
        names = pq.read_schema(file).names
        columns = ["pair", "n_tokens", *(m for m in (*MEAN_METRICS, *extra) if m in names)]
        table = pq.read_table(file, columns=columns).to_pandas()
    except (pa.ArrowException, OSError, ValueError, KeyError) as error:  # garbage, cut short, a column missing
        raise ResultsError(f"{file}: not a readable rollouts table ({' '.join(str(error).split())[:160]})") from None
    numbers = [column for column in table.columns if column != "pair"]
    try:
        table[numbers] = table[numbers].astype("float64")
    except (TypeError, ValueError):
        raise ResultsError(f"{file}: a column of {', '.join(numbers)} is not numeric: not the table a run writes") from None
    steps = table["step"].dropna() if "step" in table else table["n_tokens"].iloc[:0]
    if (table["n_tokens"] < 0).any() or ((steps < 0) | (steps % 1 != 0) | (steps >= 2**53)).any():
        raise ResultsError(f"{file}: a negative token count or a step that is not a non-negative integer: not the "
                           "table a run writes")
    return table


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
    ess = _ess(rows)
    if ess is not None:
        out["ess"] = ess
    return out


def _ess(rows: Any) -> tuple[float, tuple[float, float] | None] | None:
    """ESS = (Σ r)² / (N Σ r²) over the pair's tokens (analysis/metrics.py), from each rollout's
    ratio_mean a_i = Σ_i r / n_i and chi2_token c_i = Σ_i r² / n_i − 1: ESS = ā² / b̄ with
    ā = Σ n_i a_i / N, b̄ = Σ n_i (c_i + 1) / N, and its 95% CI by the delta method on log ESS with
    rollouts as clusters, each rollout's term u_i = n_i (2 (a_i − ā) / ā − (b_i − b̄) / b̄) / N.
    None without those columns; no CI with fewer than 2 rollouts or a ratio too large for float64
    (the audit's ESS then comes from its far-group sums, which rollouts.parquet does not hold)."""
    if not {"ratio_mean", "chi2_token"} <= set(rows.columns):
        return None
    n = rows["n_tokens"].to_numpy(np.float64)
    a, b = rows["ratio_mean"].to_numpy(np.float64), rows["chi2_token"].to_numpy(np.float64) + 1.0
    keep = np.isfinite(a) & np.isfinite(b) & (n > 0)
    if not keep.any():
        return None
    n, a, b = n[keep], a[keep], b[keep]
    total = n.sum()
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        a_bar, b_bar = np.sum(n * a) / total, np.sum(n * b) / total
        ess = float(a_bar ** 2 / b_bar)
        u = n * (2 * (a - a_bar) / a_bar - (b - b_bar) / b_bar) / total
        k = len(n)
        se = ess * math.sqrt(k / (k - 1) * float(np.sum(u ** 2))) if k >= 2 else math.nan
    if not math.isfinite(ess):
        return None
    return ess, ((ess - Z95 * se, ess + Z95 * se) if math.isfinite(se) else None)


def split_by_step(path: Path, summary: Summary) -> list[Step]:
    """One audit of a step-indexed dump (its rollouts.parquet has each rollout's `step`, from
    meta.step) as one Step per training step: the mean metrics and their CIs per step, from the
    rollouts' own values. What needs the token table per step (quantiles, turns, strata) is not
    there: an audit per step gives it."""
    table = _per_rollout(path, ("step",))
    if table is None or "step" not in table.columns:
        return []
    table = table.dropna(subset=["step"])
    engines = {source: configuration(engine) for source, engine in summary.engines.items()}
    steps = []
    for number, rows in table.groupby("step", sort=True):
        pairs, ci = {}, {}
        for pair, pair_rows in rows.groupby("pair", observed=True, sort=False):
            found = _means(pair_rows)
            pairs[str(pair)] = {"n_tokens": int(pair_rows["n_tokens"].sum()), "n_rollouts": len(pair_rows),
                                **{metric: estimate for metric, (estimate, _) in found.items()}}
            ci[str(pair)] = {metric: interval for metric, (_, interval) in found.items() if interval is not None}
        steps.append(Step(step=int(number), path=path, step_from="meta.step", checkpoint=summary.checkpoint,
                          pairs=pairs, ci=ci, engines=engines))  # the one report is the whole run's
    return steps
