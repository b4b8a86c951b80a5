"""A training run's trend in words: the headline (where the metric changed, the test behind it, the
first cause) and the lines `mismatch trend` prints. The trend page (reports/trend.py) leads with
the same headline."""

from __future__ import annotations

from typing import Any

from mismatch.present.numbers import num, pct


def headline(found: dict[str, Any]) -> str:
    """The first line: where the metric changed, the test behind it and the first cause found, or
    that it did not (and what was recorded changing without a measured move)."""
    metric, pair = found["metric"], found["pair"]
    if found["changes"]:
        change = found["changes"][0]
        return (f"{metric} of {pair} changed at step {change['step']} ({change['kind']}: "
                f"{num(change['before']['level'])} → {num(change['after']['level'])}, slope "
                f"{num(change['before']['slope_per_step'])} → {num(change['after']['slope_per_step'])} per step, "
                f"p = {num(change['p_value'], 2)}): {change['causes'][0]}")
    if found["jumps"]:
        jump = found["jumps"][0]
        return (f"{metric} of {pair} jumped at step {jump['step']} ({num(jump['before'])} → {num(jump['after'])}, "
                f"p = {num(jump['p_value'], 2)}): {jump['causes'][0]}")
    line = f"no change in {metric} of {pair} over {found['num_steps']} steps (no change point passes the test)"
    recorded = found.get("configuration_changes") or []
    if recorded:
        first = recorded[0]
        line += (f"; recorded at step {first['step']}, without a significant move "
                 f"({num(first['before'])} → {num(first['after'])}, p = {num(first['p_value'], 2)}): "
                 f"{first['causes'][0]}")
    return line


def terminal_lines(found: dict[str, Any]) -> list[str]:
    """What `mismatch trend` prints: the headline, the series, each change once, the strata."""
    metric = found["metric"]
    lines = [headline(found),
             f"{found['num_steps']} steps (from {found['step_from']}); {metric} of {found['pair']} per step, "
             "95% CI over rollouts:"]
    for row in found["series"][metric]:
        ci = f"  [{num(row['ci_low'])}, {num(row['ci_high'])}]" if row["ci_low"] is not None else ""
        lines.append(f"  step {row['step']:>6}  {num(row['value'])}{ci}")
    for change in found["changes"]:
        lines.append(f"change at step {change['step']} ({change['kind']}, p = {num(change['p_value'], 2)}):")
        lines += [f"  - {cause}" for cause in change["causes"]]
    for jump in found["jumps"]:
        lines.append(f"jump at step {jump['step']} (from step {jump['from_step']}: {num(jump['before'])} → "
                     f"{num(jump['after'])}, p = {num(jump['p_value'], 2)}): " + "; ".join(jump["causes"]))
    named = {row["step"] for row in [*found["changes"], *found["jumps"]]}
    for recorded in found.get("configuration_changes") or []:
        if recorded["step"] not in named:
            lines.append(f"recorded at step {recorded['step']}, no significant move (p = {num(recorded['p_value'], 2)}): "
                         + "; ".join(recorded["causes"]))
    growth = found.get("growth")
    if growth:
        lines.append(f"growth of k3 from steps {growth['before'][0]}–{growth['before'][-1]} to "
                     f"{growth['after'][0]}–{growth['after'][-1]}, by strata:")
        for dimension, split in growth["strata"].items():
            if dimension == "explained_by":
                continue
            if "unavailable" in split:
                lines.append(f"  {dimension}: {split['unavailable']}")
                continue
            hot = split.get("hot")
            mix = pct(split["mix"] / split["growth"]) if split["growth"] else "–"
            where = (f"; most in {hot['where']} ({pct(hot['token_share'])} of the tokens): their gap grew "
                     f"{num(hot['factor'], 3)}×, the rest's {num(hot['rest_factor'], 3)}×" if hot else "")
            lines.append(f"  {dimension}: {num(split['gap_before'])} → {num(split['gap_after'])}, {mix} from the mix{where}")
    return lines
