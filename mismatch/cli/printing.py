"""The terminal's account of a results dir: the pairs table, findings, diagnosis, diff, layers,
weights. Each reads the summary (or a command's result) and prints; none computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec import UNSET

from mismatch.cli.output import new_table, out_console, say
from mismatch.present.headline import audit_banner, cause_line, causes, clip_sentence, findings, verdict_line
from mismatch.present.numbers import plain
from mismatch.results.section_records import FromConfig, KernelLocalization, LayerLocalization, Localization

if TYPE_CHECKING:
    from mismatch.frameworks.protocol import Target
    from mismatch.weights import WeightsReport
    from mismatch.results.summary_model import Summary


KEY_METRICS = ("n_tokens", "log_ratio_abs_mean", "log_ratio_abs_max", "kl_k3", "chi2_token",
               "ess", "ratio_q001", "ratio_q999", "bitwise_equal_frac")


def print_pairs(summary: Summary, target: Target | None = None, out: Path | None = None) -> None:
    """Metrics as rows, pairs as columns: fits 80 columns for the three pairs of an audit. With a
    target framework, its own metric names and values as well: summary.json framework_metrics (its
    default settings), or, when the target names settings, recomputed at them from OUT's tokens."""
    table = new_table(title="log(pi_A / pi_B) over trainable tokens", title_justify="left",
                      caption="every term: docs/glossary.md", caption_justify="left")
    table.add_column("metric")
    for pair in summary.pairs:
        table.add_column(pair, justify="right")
    for name in KEY_METRICS:
        table.add_row(name, *(plain(getattr(metrics, name)) for metrics in summary.pairs.values()))
    out_console.print(table)
    if target is not None:
        _print_framework_metrics(summary, target, out)
    if sentence := clip_sentence(summary):  # the question behind the table: is my ratio OK?
        out_console.print(sentence[:1].upper() + sentence[1:] + ".", markup=False, highlight=False,
                          soft_wrap=True)
    for pair, verdict in summary.verdicts.items():
        out_console.print(verdict_line(pair, verdict), markup=False, highlight=False, soft_wrap=True)
    from mismatch.present.headline import prefix_lines

    for line in prefix_lines(summary):
        out_console.print(line, markup=False, highlight=False, soft_wrap=True)


def print_findings(summary: Summary) -> None:
    """What the audit found besides the pairs: alignment and semantics, render drift, the turn
    onset or position trend, and what the localizers found (each said when it ran)."""
    from mismatch.results.summary_model import present

    alignment = summary.alignment
    if alignment and alignment.stored:
        temperature = present(alignment.estimated_temperature)
        say(f"alignment: shift {alignment.shift or 0:+d}, stored log-probs {alignment.logprob_semantics or 'unknown'}"
            + (f" (estimated temperature {temperature:.3g})" if temperature is not None else ""))
    routing = present(summary.engine("train").routing)
    followed = present(routing.followed) if routing is not None else None
    if followed not in (None, "sampler"):  # R3 in training forces the rollout engine's own experts
        say(f"routing: --train routing=replay followed --{followed}'s experts: the rollouts store no "
            "routed_experts, so not the rollout engine's own")
    drift = summary.drift
    if drift and drift.num_rollouts_checked:
        say(f"render drift: {present(drift.num_spans)} span(s) in {present(drift.num_rollouts_drifted)} of "
            f"{drift.num_rollouts_checked} rollouts, {drift.trainable_tokens_touched or 0} trainable token(s) touched")
    localization = summary.localization
    turns = localization.turns
    if turns and turns.n_tokens:
        onset, slope = present(turns.onset), present(turns.position_slope)
        if summary.onset_turn is not None:
            say(f"turns: the {turns.pair} gap steps up at turn {summary.onset_turn}"
                + (f" in {onset.n_rollouts_departing} of {onset.n_rollouts_compared} rollouts" if onset else ""))
        elif slope is not None and isinstance(slope.slope_per_1k, float):
            grows = "grows" if slope.grows_with_position else "does not grow"
            say(f"turns: no turn where the {turns.pair} gap steps up; it {grows} with position "
                f"({slope.slope_per_1k:.3g} per 1000 tokens)")
    if localization.layers or localization.kernels:
        from mismatch.localize import localized_what

        for line in localized_what(localization):
            say(f"localize: {line}")


def print_diagnosis(summary: Summary) -> None:
    """The diagnosis' causes (title, evidence) and findings, then the answer the report leads with."""
    for n, cause in enumerate(causes(summary), start=1):
        say(cause_line(cause, n))
        for line in [*cause.evidence, *cause.rules_out]:
            say(f"  - {line}")
    for finding in findings(summary):
        say(f"note: {finding}")
    say(f"answer: {audit_banner(summary).headline}")


def _print_framework_metrics(summary: Summary, target: Target, out: Path | None) -> None:
    from mismatch.advise.advice import logged_metrics
    from mismatch.results.summary_model import present

    framework = target.framework
    named = {pair: block.get(framework) or {} for pair, block in (present(summary.framework_metrics) or {}).items()}
    settings = (present(summary.framework_settings) or {}).get(framework)
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
        table.add_row(key, *(plain(values.get(key)) for values in named.values()))
    out_console.print(table)


def print_diff(summary: Summary) -> None:
    """diff's answer: each metric's b − a with its CI, the closer config by kl_k3 (and on the whole
    distribution, with --distribution), each config's replay speed."""
    from mismatch.results.section_records import Comparison
    from mismatch.results.summary_model import present

    comparison = present(summary.diff) or Comparison()
    table = new_table(title="b/reference − a/reference (95% bootstrap CI over rollouts)", title_justify="left")
    for column in ("metric", "a", "b", "delta", "ci95"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, d in (comparison.deltas or {}).items():
        low, high = d.ci95 or [None, None]
        table.add_row(name, plain(present(d.a)), plain(present(d.b)), plain(present(d.delta)),
                      f"[{plain(low)}, {plain(high)}]")
    out_console.print(table)
    speed = comparison.throughput_tokens_per_s or {"a": None, "b": None}  # a diff writes both
    out_console.print(f"closer to the reference: {present(comparison.closer_to_reference)} "
                      f"({present(comparison.closer_rule)}); replay tokens/s: a {plain(speed['a'])}, "
                      f"b {plain(speed['b'])}", markup=False, highlight=False, soft_wrap=True)
    on_distribution = present(comparison.distribution)
    if on_distribution is not None:
        kl = on_distribution.kl or {"a": None, "b": None}
        say(f"closer on the whole next-token distribution: {on_distribution.closer or 'undecided'} "
            f"(mean KL a {plain(kl['a'])}, b {plain(kl['b'])}; {present(on_distribution.rule)})")


def print_layers(found: Localization) -> None:
    """`mismatch layers`: the layer table and its jump, the split by layer type and index flips, then
    the error each module type introduces (each localizer's skip said with its reason)."""
    from mismatch.localize import localized_what
    from mismatch.results.summary_model import present

    layers, kernels = found.layers or LayerLocalization(), found.kernels or KernelLocalization()
    if layers.skipped is not UNSET:
        out_console.print(f"layers: skipped: {layers.skipped}", markup=False)
    else:
        table = new_table(title="relative error of a vs b (reference) by layer and sub-block",
                      title_justify="left")
        for column in ("layer", "block", "rel_error", "local_rel_error", "logit_lens |Δlogp|"):
            table.add_column(column, justify="left" if column == "block" else "right")
        for row in layers.by_layer or ():
            table.add_row(str(row.layer), row.block, plain(present(row.rel_error)),
                          plain(present(row.local_rel_error)), plain(present(row.logit_lens_abs_diff)))
        out_console.print(table)
        out_console.print(f"jump: layer {present(layers.jump_layer)} {present(layers.jump_block)}", markup=False)
        for line in localized_what(found)[2:]:  # by layer type, index flips (after layers and kernels)
            out_console.print(line, markup=False, soft_wrap=True)
    if kernels.skipped is not UNSET:
        out_console.print(f"kernels: skipped: {kernels.skipped}", markup=False)
        return
    table = new_table(title="error introduced by each module type (module-local)", title_justify="left")
    for column in ("type", "rel_error", "max_abs"):
        table.add_column(column, justify="left" if column == "type" else "right")
    for row in kernels.by_type or ():
        table.add_row(row.type, plain(present(row.rel_error)), plain(present(row.max_abs)))
    out_console.print(table)


def print_weights(report: WeightsReport) -> None:
    """`mismatch weights`: each differing tensor, the names on one side only, then the verdict."""
    differing = [t for t in report.tensors if not t.equal]
    for tensor in differing:
        out_console.print(
            f"{tensor.name}: {tensor.dtype_a} {list(tensor.shape_a)} vs {tensor.dtype_b} "
            f"{list(tensor.shape_b)}: max abs {plain(tensor.max_abs_diff)}, max rel "
            f"{plain(tensor.max_rel_diff)}, bitwise equal {plain(tensor.bitwise_equal_frac)}",
            markup=False, highlight=False, soft_wrap=True)
    for side, names in (("only_a", report.only_a), ("only_b", report.only_b)):
        for name in names:
            out_console.print(f"{name}: {side.replace('_', ' in ')}", markup=False)
    total = len(report.tensors)
    out_console.print(f"{total - len(differing)}/{total} shared tensors bitwise equal", markup=False)
    out_console.print(report.verdict, markup=False, highlight=False, soft_wrap=True)


def print_from_config(from_config: dict[str, FromConfig], console: Any = None, model: str | None = None) -> None:
    """The config's model against the checkpoint first (`model`), then each config's notices (what
    changes what the audit compares, e.g. verl's bypass mode), then each source a framework config
    set: the spec it derived, a line for every setting it could not reproduce as configured
    (approximated, or not at all) and every option the spec overrode. The reproduced settings are
    the spec itself."""
    console = console or out_console
    if model:
        console.print(model, markup=False, highlight=False, soft_wrap=True)
    for notice in dict.fromkeys(n for table in from_config.values() for n in table.notices or ()):
        console.print(f"note: {notice}", markup=False, highlight=False, soft_wrap=True)
    for source, table in from_config.items():
        console.print(f"--{source} {table.spec}", markup=False, highlight=False, soft_wrap=True)
        console.print(f"  from the {table.framework} config {table.file}, read with: {table.loader}",
                      markup=False, highlight=False, soft_wrap=True)
        for setting in table.settings or ():
            if setting.status == "reproduced":
                continue
            became = f" → {setting.option}" if setting.option else ""
            console.print(f"  {setting.status}: {setting.key}={_config_value(setting.value)}{became}"
                          f" ({setting.note})", markup=False, highlight=False, soft_wrap=True)
        for key, value in (table.overrides or {}).items():
            console.print(f"  overridden in the spec: {key}={value}", markup=False, highlight=False, soft_wrap=True)


def _config_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


DISTRIBUTION_ROWS = (("KL(A‖B) mean", "kl_ab_mean"), ("KL(B‖A) mean", "kl_ba_mean"), ("KL(A‖B) max", "kl_ab_max"),
                     ("TV mean", "tv_mean"), ("top-K overlap", "topk_overlap_mean"),
                     ("argmax agree", "argmax_agree_frac"), ("rank differs", "rank_differs_frac"),
                     ("sampled |Δlogp| mean", "sampled_abs_log_ratio_mean"))


def print_distribution(summary: Summary) -> None:
    """--distribution: each pair's whole next-token distribution gap, what is exact or bounded,
    the bitwise claim checked, and where and on which token it is largest."""
    from mismatch.results.summary_model import present

    found = present(summary.distribution) or {}
    if not found:
        return
    table = new_table(title="whole next-token distribution, A vs B, over trainable positions", title_justify="left")
    table.add_column("metric")
    for pair in found:
        table.add_column(pair, justify="right")
    for label, key in DISTRIBUTION_ROWS:  # the records' fields, by the table's names
        table.add_row(label, *(plain(present(getattr(gap, key))) for gap in found.values()))
    out_console.print(table)
    for pair, gap in found.items():
        scope = "exact over the whole vocabulary" if gap.exact else f"bounded ({present(gap.bounded)})"
        say(f"{pair}: top-K = {present(gap.k)}, {scope}")
        say(f"{pair}: {gap.bitwise.claim if gap.bitwise else ''}")
        if gap.tokens:
            top = gap.tokens[0]
            say(f"{pair}: token {top['token_id']} moved most ({top['tv_share']:.0%} of the moved mass, "
                f"largest change at {top['n_positions']} positions)")
        if gap.worst:
            worst = gap.worst[0]
            say(f"{pair}: largest KL(A‖B) {plain(worst['kl_ab'])} at rollout {worst['rollout']} branch "
                f"{worst['branch']} turn {worst['turn']} position {worst['pos']} (token {worst['moved_token']} moved)")
