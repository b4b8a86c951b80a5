"""The terminal's account of a results dir: the pairs table, findings, diagnosis, diff, layers,
weights. Each reads the summary (or a command's result) and prints; none computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch.cli.output import fmt, new_table, out_console, say

if TYPE_CHECKING:
    from mismatch.frameworks.protocol import Target


KEY_METRICS = ("n_tokens", "log_ratio_abs_mean", "log_ratio_abs_max", "kl_k3", "chi2_token",
               "ess", "ratio_q001", "ratio_q999", "bitwise_equal_frac")


def print_pairs(summary: dict[str, Any], target: Target | None = None, out: Path | None = None) -> None:
    """Metrics as rows, pairs as columns: fits 80 columns for the three pairs of an audit. With a
    target framework, its own metric names and values as well: summary.json framework_metrics (its
    default settings), or, when the target names settings, recomputed at them from OUT's tokens."""
    table = new_table(title="log(pi_A / pi_B) over trainable tokens", title_justify="left",
                      caption="every term: docs/glossary.md", caption_justify="left")
    table.add_column("metric")
    pairs = summary["pairs"]
    for pair in pairs:
        table.add_column(pair, justify="right")
    for name in KEY_METRICS:
        table.add_row(name, *(fmt(metrics.get(name)) for metrics in pairs.values()))
    out_console.print(table)
    if target is not None:
        _print_framework_metrics(summary, target, out)
    from mismatch.analysis.clip import clip_sentence

    if sentence := clip_sentence(summary):  # the question behind the table: is my ratio OK?
        out_console.print(sentence[:1].upper() + sentence[1:] + ".", markup=False, highlight=False,
                          soft_wrap=True)
    for pair, verdict in summary.get("verdicts", {}).items():
        out_console.print(f"{pair} ({verdict['meaning']}): {verdict['level']}: {verdict['text']}",
                          markup=False, highlight=False, soft_wrap=True)
    from mismatch.analysis.prefixes import prefix_sentence, split_prefixes

    for source, finding in split_prefixes(summary).items():
        out_console.print(prefix_sentence(source, finding, (summary.get("engines") or {}).get(source)),
                          markup=False, highlight=False, soft_wrap=True)


def print_findings(summary: dict[str, Any]) -> None:
    """What the audit found besides the pairs: alignment and semantics, render drift, the turn
    onset or position trend, and what the localizers found (each said when it ran)."""
    alignment = summary.get("alignment") or {}
    if alignment.get("stored"):
        temperature = alignment.get("estimated_temperature")
        say(f"alignment: shift {int(alignment.get('shift') or 0):+d}, stored log-probs "
             f"{alignment.get('logprob_semantics', 'unknown')}"
             + (f" (estimated temperature {temperature:.3g})" if isinstance(temperature, (int, float)) else ""))
    followed = (((summary.get("engines") or {}).get("train") or {}).get("routing") or {}).get("from")
    if followed not in (None, "sampler"):  # R3 in training forces the rollout engine's own experts
        say(f"routing: --train routing=replay followed --{followed}'s experts: the rollouts store no "
            "routed_experts, so not the rollout engine's own")
    drift = summary.get("drift") or {}
    if drift.get("num_rollouts_checked"):
        say(f"render drift: {drift.get('num_spans', 0)} span(s) in {drift.get('num_rollouts_drifted', 0)} of "
             f"{drift['num_rollouts_checked']} rollouts, {drift.get('trainable_tokens_touched', 0)} trainable "
             "token(s) touched")
    turns = (summary.get("localization") or {}).get("turns") or {}
    if turns.get("n_tokens"):
        onset, slope = turns.get("onset") or {}, turns.get("position_slope") or {}
        if turns.get("onset_turn") is not None:
            say(f"turns: the {turns.get('pair')} gap steps up at turn {turns['onset_turn']}"
                 + (f" in {onset['n_rollouts_departing']} of {onset['n_rollouts_compared']} rollouts" if onset else ""))
        elif isinstance(slope.get("slope_per_1k"), (int, float)):
            grows = "grows" if slope.get("grows_with_position") else "does not grow"
            say(f"turns: no turn where the {turns.get('pair')} gap steps up; it {grows} with position "
                 f"({slope['slope_per_1k']:.3g} per 1000 tokens)")
    localization = summary.get("localization") or {}
    if "layers" in localization or "kernels" in localization:
        from mismatch.localize import localized_what

        for line in localized_what(localization):
            say(f"localize: {line}")


def print_diagnosis(summary: dict[str, Any]) -> None:
    """The diagnosis' causes (title, evidence) and findings, then the answer the report leads with."""
    from mismatch.reports.banner import audit_banner

    diagnosis = summary.get("diagnosis") or {}
    for n, cause in enumerate(diagnosis.get("causes") or [], start=1):
        say(f"cause {n}{' (minor)' if cause.get('minor') else ''}: {cause['title']} [{cause['pair']}]")
        for line in [*(cause.get("evidence") or []), *(cause.get("rules_out") or [])]:
            say(f"  - {line}")
    for finding in diagnosis.get("findings") or []:
        say(f"note: {finding}")
    if "verdicts" in summary:
        say(f"answer: {audit_banner(summary).headline}")


def _print_framework_metrics(summary: dict[str, Any], target: Target, out: Path | None) -> None:
    from mismatch.advise.advice import logged_metrics

    framework = target.framework
    named = {pair: (block or {}).get(framework) or {} for pair, block in
             (summary.get("framework_metrics") or {}).items()}
    settings = (summary.get("framework_settings") or {}).get(framework)
    asked = {**(settings or {}), **target.settings}
    if target.settings and asked != settings and out is not None:  # an audit made without these settings
        logged = logged_metrics(out, target)
        if logged is not None:
            named, settings = {logged["pair"]: logged["metrics"]}, logged["settings"]
    if not any(named.values()):
        return
    words = ", ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "its defaults"
    table = new_table(title=f"as {target.label} logs it (computed its way, with {words})", title_justify="left")
    table.add_column("key")
    for pair in named:
        table.add_column(pair, justify="right")
    for key in dict.fromkeys(k for values in named.values() for k in values):
        table.add_row(key, *(fmt(values.get(key)) for values in named.values()))
    out_console.print(table)


def print_diff(comparison: dict[str, Any]) -> None:
    table = new_table(title="b/reference − a/reference (95% bootstrap CI over rollouts)", title_justify="left")
    for column in ("metric", "a", "b", "delta", "ci95"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, d in comparison["deltas"].items():
        table.add_row(name, fmt(d["a"]), fmt(d["b"]), fmt(d["delta"]),
                      f"[{fmt(d['ci95'][0])}, {fmt(d['ci95'][1])}]")
    out_console.print(table)
    speed = comparison["throughput_tokens_per_s"]
    out_console.print(f"closer to the reference: {comparison['closer_to_reference']} "
                      f"({comparison['closer_rule']}); replay tokens/s: a {fmt(speed['a'])}, "
                      f"b {fmt(speed['b'])}", markup=False, highlight=False, soft_wrap=True)
    on_distribution = comparison.get("distribution")
    if on_distribution:
        kl = on_distribution["kl"]
        say(f"closer on the whole next-token distribution: {on_distribution['closer'] or 'undecided'} "
            f"(mean KL a {fmt(kl['a'])}, b {fmt(kl['b'])}; {on_distribution['rule']})")


def print_layers(found: dict[str, Any]) -> None:
    found_layers = found["layers"]
    if "skipped" in found_layers:
        out_console.print(f"layers: skipped: {found_layers['skipped']}", markup=False)
    else:
        table = new_table(title="relative error of a vs b (reference) by layer and sub-block",
                      title_justify="left")
        for column in ("layer", "block", "rel_error", "local_rel_error", "logit_lens |Δlogp|"):
            table.add_column(column, justify="left" if column == "block" else "right")
        for row in found_layers["by_layer"]:
            table.add_row(str(row["layer"]), row["block"], fmt(row.get("rel_error")),
                          fmt(row.get("local_rel_error")), fmt(row.get("logit_lens_abs_diff")))
        out_console.print(table)
        out_console.print(f"jump: layer {found_layers['jump_layer']} {found_layers['jump_block']}",
                          markup=False)
        from mismatch.localize import localized_what

        for line in localized_what(found)[2:]:  # by layer type, index flips (after layers and kernels)
            out_console.print(line, markup=False, soft_wrap=True)
    kernels = found["kernels"]
    if "skipped" in kernels:
        out_console.print(f"kernels: skipped: {kernels['skipped']}", markup=False)
        return
    table = new_table(title="error introduced by each module type (module-local)", title_justify="left")
    for column in ("type", "rel_error", "max_abs"):
        table.add_column(column, justify="left" if column == "type" else "right")
    for row in kernels["by_type"]:
        table.add_row(row["type"], fmt(row.get("rel_error")), fmt(row.get("max_abs")))
    out_console.print(table)


def print_weights(payload: dict[str, Any]) -> None:
    differing = [t for t in payload["tensors"] if not t.get("equal")]
    for tensor in differing:
        out_console.print(
            f"{tensor['name']}: {tensor.get('dtype_a')} {tensor.get('shape_a')} vs {tensor.get('dtype_b')} "
            f"{tensor.get('shape_b')}: max abs {fmt(tensor.get('max_abs_diff'))}, max rel "
            f"{fmt(tensor.get('max_rel_diff'))}, bitwise equal {fmt(tensor.get('bitwise_equal_frac'))}",
            markup=False, highlight=False, soft_wrap=True)
    for side in ("only_a", "only_b"):
        for name in payload.get(side) or []:
            out_console.print(f"{name}: {side.replace('_', ' in ')}", markup=False)
    total = len(payload["tensors"])
    out_console.print(f"{total - len(differing)}/{total} shared tensors bitwise equal", markup=False)
    out_console.print(payload["summary"]["verdict"], markup=False, highlight=False, soft_wrap=True)


def print_from_config(from_config: dict[str, dict[str, Any]], console: Any = None, model: str | None = None) -> None:
    """The config's model against the checkpoint first (`model`), then each config's notices (what
    changes what the audit compares, e.g. verl's bypass mode), then each source a framework config
    set: the spec it derived, a line for every setting it could not reproduce as configured
    (approximated, or not at all) and every option the spec overrode. The reproduced settings are
    the spec itself."""
    console = console or out_console
    if model:
        console.print(model, markup=False, highlight=False, soft_wrap=True)
    for notice in dict.fromkeys(n for table in from_config.values() for n in table.get("notices") or []):
        console.print(f"note: {notice}", markup=False, highlight=False, soft_wrap=True)
    for source, table in from_config.items():
        console.print(f"--{source} {table['spec']}", markup=False, highlight=False, soft_wrap=True)
        console.print(f"  from the {table['framework']} config {table['file']}, read with: {table['loader']}",
                      markup=False, highlight=False, soft_wrap=True)
        for setting in table["settings"]:
            if setting["status"] == "reproduced":
                continue
            became = f" → {setting['option']}" if setting.get("option") else ""
            console.print(f"  {setting['status']}: {setting['key']}={_config_value(setting['value'])}{became}"
                          f" ({setting['note']})", markup=False, highlight=False, soft_wrap=True)
        for key, value in (table.get("overrides") or {}).items():
            console.print(f"  overridden in the spec: {key}={value}", markup=False, highlight=False, soft_wrap=True)


def _config_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


DISTRIBUTION_ROWS = (("KL(A‖B) mean", "kl_ab_mean"), ("KL(B‖A) mean", "kl_ba_mean"), ("KL(A‖B) max", "kl_ab_max"),
                     ("TV mean", "tv_mean"), ("top-K overlap", "topk_overlap_mean"),
                     ("argmax agree", "argmax_agree_frac"), ("rank differs", "rank_differs_frac"),
                     ("sampled |Δlogp| mean", "sampled_abs_log_ratio_mean"))


def print_distribution(summary: dict[str, Any]) -> None:
    """--distribution: each pair's whole next-token distribution gap, what is exact or bounded,
    the bitwise claim checked, and where and on which token it is largest."""
    found = summary.get("distribution") or {}
    if not found:
        return
    table = new_table(title="whole next-token distribution, A vs B, over trainable positions", title_justify="left")
    table.add_column("metric")
    for pair in found:
        table.add_column(pair, justify="right")
    for label, key in DISTRIBUTION_ROWS:
        table.add_row(label, *(fmt(entry.get(key)) for entry in found.values()))
    out_console.print(table)
    for pair, entry in found.items():
        view = "exact over the whole vocabulary" if entry["exact"] else f"bounded ({entry['bounded']})"
        say(f"{pair}: top-K = {entry.get('k')}, {view}")
        say(f"{pair}: {entry['bitwise']['claim']}")
        if entry["tokens"]:
            top = entry["tokens"][0]
            say(f"{pair}: token {top['token_id']} moved most ({top['tv_share']:.0%} of the moved mass, "
                f"largest change at {top['n_positions']} positions)")
        if entry["worst"]:
            worst = entry["worst"][0]
            say(f"{pair}: largest KL(A‖B) {fmt(worst['kl_ab'])} at rollout {worst['rollout']} branch "
                f"{worst['branch']} turn {worst['turn']} position {worst['pos']} (token {worst['moved_token']} moved)")
