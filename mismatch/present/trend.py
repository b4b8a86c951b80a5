"""A training run's trend in words: the headline (where the metric changed, the test behind it, the
first cause) and the lines `mismatch trend` prints. The trend page (reports/trend.py) leads with
the same headline.

`Trend` is mismatch.trend.analyze_steps' answer (what `mismatch trend --json` prints) read as
records: the steps, one metric's series with its 95% CIs, the change points, the jumps and the
configuration changes recorded without a measured move, and the growth split by strata.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mismatch.present.numbers import num, pct
from mismatch.present.views import View, view
from mismatch.results.summary_model import to_builtins


class SeriesRow(View):
    """One step's value of a metric, with its 95% CI over rollouts (None: not computable)."""

    step: int
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class TrendStep(View):
    """A step's results dir, its checkpoint, its own headline and its report page (if it has one)."""

    step: int
    dir: str = ""
    checkpoint: str | None = None
    headline: str = ""
    report: str | None = None


class Level(View):
    """A segment of the fitted line: its level at the change and its slope per step."""

    level: float | None = None
    slope_per_step: float | None = None


class Change(View):
    """A change point: the step, level or slope, the test's p-value, whether the step's CI leaves the
    level before (`separated`), the two lines, and what changed there (`causes`, best first)."""

    step: int
    kind: str
    p_value: float | None = None
    separated: bool = False
    before: Level = msgspec.field(default_factory=Level)
    after: Level = msgspec.field(default_factory=Level)
    causes: list[str] = msgspec.field(default_factory=list)


class Move(View):
    """A jump between two consecutive steps (`from_step` → `step`), or a configuration change
    recorded at `step` with the same test: the values on each side, the p-value, the causes."""

    step: int
    from_step: int | None = None
    before: float | None = None
    after: float | None = None
    p_value: float | None = None
    causes: list[str] = msgspec.field(default_factory=list)


class Hot(View):
    """Where a dimension's gap grew most: the buckets, their growth factor against the rest's, and
    their share of the tokens."""

    where: str = "–"
    factor: float | None = None
    rest_factor: float | None = None
    token_share: float | None = None


class StrataSplit(View):
    """One dimension's shift-share split of the growth (mismatch.trend.attribution): k3 before and
    after, the growth and the part of it the mix of tokens explains; or why it is unavailable."""

    unavailable: str | None = None
    gap_before: float | None = None
    gap_after: float | None = None
    growth: float | None = None
    mix: float | None = None
    hot: Hot | None = None


class Growth(View):
    """The whole run's growth of k3, from the first steps to the last, split by each dimension."""

    before: list[int]
    after: list[int]
    strata: dict[str, StrataSplit] = msgspec.field(default_factory=dict)
    explained_by: list[str] = msgspec.field(default_factory=list)  # the dimensions that explain it, best first


class Trend(View):
    pair: str
    metric: str
    num_steps: int
    step_from: str = ""
    steps: list[TrendStep] = msgspec.field(default_factory=list)
    series: dict[str, list[SeriesRow]] = msgspec.field(default_factory=dict)
    change_points: list[int] = msgspec.field(default_factory=list)
    changes: list[Change] = msgspec.field(default_factory=list)
    jumps: list[Move] = msgspec.field(default_factory=list)
    configuration_changes: list[Move] = msgspec.field(default_factory=list)
    growth: Growth | None = None
    method: dict[str, str] = msgspec.field(default_factory=dict)


def read_trend(found: dict[str, Any]) -> Trend:
    """analyze_steps' answer as a `Trend` (its numpy numbers as Python's, and its strata's
    `explained_by` list lifted out of the map of dimensions it shares)."""
    found = to_builtins(found)
    growth = found.get("growth")
    if isinstance(growth, dict) and isinstance(growth.get("strata"), dict):
        strata = dict(growth["strata"])
        found = {**found, "growth": {**growth, "strata": strata, "explained_by": strata.pop("explained_by", [])}}
    return view(found, Trend, "analyze_steps' answer", source="trend")


def headline(trend: Trend) -> str:
    """The first line: where the metric changed, the test behind it and the first cause found, or
    that it did not (and what was recorded changing without a measured move)."""
    metric, pair = trend.metric, trend.pair
    if trend.changes:
        change = trend.changes[0]
        return (f"{metric} of {pair} changed at step {change.step} ({change.kind}: "
                f"{num(change.before.level)} → {num(change.after.level)}, slope "
                f"{num(change.before.slope_per_step)} → {num(change.after.slope_per_step)} per step, "
                f"p = {num(change.p_value, 2)}): {change.causes[0]}")
    if trend.jumps:
        jump = trend.jumps[0]
        return (f"{metric} of {pair} jumped at step {jump.step} ({num(jump.before)} → {num(jump.after)}, "
                f"p = {num(jump.p_value, 2)}): {jump.causes[0]}")
    line = f"no change in {metric} of {pair} over {trend.num_steps} steps (no change point passes the test)"
    if trend.configuration_changes:
        first = trend.configuration_changes[0]
        line += (f"; recorded at step {first.step}, without a significant move "
                 f"({num(first.before)} → {num(first.after)}, p = {num(first.p_value, 2)}): {first.causes[0]}")
    return line


def recorded_only(trend: Trend) -> list[Move]:
    """The configuration changes recorded at a step that is neither a change point nor a jump (there,
    the configuration is among that move's causes already)."""
    named = {move.step for move in [*trend.changes, *trend.jumps]}
    return [recorded for recorded in trend.configuration_changes if recorded.step not in named]


def mix_share(split: StrataSplit) -> str:
    """The share of a dimension's growth that the mix of tokens explains ("–" without growth)."""
    return pct(split.mix / split.growth) if split.growth and split.mix is not None else "–"


def terminal_lines(trend: Trend) -> list[str]:
    """What `mismatch trend` prints: the headline, the series, each change once, the strata."""
    metric = trend.metric
    lines = [headline(trend),
             f"{trend.num_steps} steps (from {trend.step_from}); {metric} of {trend.pair} per step, "
             "95% CI over rollouts:"]
    for row in trend.series[metric]:
        ci = f"  [{num(row.ci_low)}, {num(row.ci_high)}]" if row.ci_low is not None else ""
        lines.append(f"  step {row.step:>6}  {num(row.value)}{ci}")
    for change in trend.changes:
        lines.append(f"change at step {change.step} ({change.kind}, p = {num(change.p_value, 2)}):")
        lines += [f"  - {cause}" for cause in change.causes]
    for jump in trend.jumps:
        lines.append(f"jump at step {jump.step} (from step {jump.from_step}: {num(jump.before)} → "
                     f"{num(jump.after)}, p = {num(jump.p_value, 2)}): " + "; ".join(jump.causes))
    for recorded in recorded_only(trend):
        lines.append(f"recorded at step {recorded.step}, no significant move (p = {num(recorded.p_value, 2)}): "
                     + "; ".join(recorded.causes))
    growth = trend.growth
    if growth is not None:
        lines.append(f"growth of k3 from steps {growth.before[0]}–{growth.before[-1]} to "
                     f"{growth.after[0]}–{growth.after[-1]}, by strata:")
        for dimension, split in growth.strata.items():
            if split.unavailable is not None:
                lines.append(f"  {dimension}: {split.unavailable}")
                continue
            hot = split.hot
            where = (f"; most in {hot.where} ({pct(hot.token_share)} of the tokens): their gap grew "
                     f"{num(hot.factor, 3)}×, the rest's {num(hot.rest_factor, 3)}×" if hot is not None else "")
            lines.append(f"  {dimension}: {num(split.gap_before)} → {num(split.gap_after)}, {mix_share(split)} "
                         f"from the mix{where}")
    return lines
