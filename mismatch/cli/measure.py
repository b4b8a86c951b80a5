"""The commands that measure and judge the gap: audit, diff, merge, recommend, gate.

Each parses, calls the library (mismatch.pipeline: audit, diff, merge; mismatch.advise), prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from mismatch.cli.dependency_output import dependency_log
from mismatch.cli.options import (
    DEFAULT_BLOCK,
    BlockOption,
    FrameworkOption,
    JsonFlag,
    ShardOption,
    read_probes,
    shard_for,
    target_for,
)
from mismatch.cli.output import emit_json, err_console, out_console, say
from mismatch.cli.printing import (
    print_diagnosis,
    print_diff,
    print_distribution,
    print_findings,
    print_from_config,
    print_pairs,
)
from mismatch.cli.progress import replay_progress
from mismatch.errors import MismatchError


DistributionOption = Annotated[Optional[str], typer.Option(
    "--distribution", metavar="K|full",
    help="Also compare the engines' whole next-token distributions at every position: top-K size "
         "(vLLM: prompt_logprobs=K, bounded) or full (torch engines only, exact). docs/distribution.md")]


def audit(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT",
                                               help="Checkpoint directory (HF format, safetensors).")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollouts file (.jsonl or .parquet).")],
    out: Annotated[Path, typer.Option("--out", help="Results directory to write.")],
    train: Annotated[str, typer.Option(
        "--train", help="Trainer engine spec, or a trainer's config: verl:FILE, trl:, openrlhf:, slime:, prime-rl:.")] = "hf",
    infer: Annotated[Optional[str], typer.Option(
        "--infer", help="Inference engine spec [default: hf-decode, or the rollout engine of a --train config].")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing results dir.")] = False,
    localize: Annotated[bool, typer.Option(
        "--localize", help="Also localize train vs infer by layer and kernel (torch engines).")] = False,
    probe: Annotated[bool, typer.Option(
        "--probe", help="Also run the kernel probes; batch-shape variance adds the batch-invariant fix.")] = False,
    distribution: DistributionOption = None,
    shard: ShardOption = None,
    block_size: BlockOption = DEFAULT_BLOCK,
    clip_eps: Annotated[str, typer.Option(
        "--clip-eps", help="PPO clip range to measure the gap against: EPS or EPS_LOW,EPS_HIGH.")] = "0.2",
    framework: FrameworkOption = None,
    force_model: Annotated[bool, typer.Option(
        "--force-model", help="Audit even when the --train config names another model than CHECKPOINT.")] = False,
    skip_invalid: Annotated[bool, typer.Option(
        "--skip-invalid", help="Audit the valid rollouts; count and list the others (summary.json skipped).")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Replay stored rollouts through a trainer and an engine; write tokens.parquet + summary.json.

    Rerunning the same command after an interruption resumes from the finished blocks."""
    from mismatch.results.staging import digest_ahead

    digest_ahead(rollouts)  # the inputs' identity hashes the file: begun while the imports below run
    from mismatch.analysis.clip import ClipRange
    from mismatch.pipeline.audit import run_audit
    from mismatch.pipeline.configured import config_tables, model_line, resolve_options
    from mismatch.pipeline.options import AuditOptions

    clip = ClipRange.parse(clip_eps)  # before any replay: a typo costs nothing
    target = target_for(framework)
    # --for's settings are an input of the audit: its framework metrics are computed with them
    asked = AuditOptions(train=train, infer=infer, out=out, force=force, localize_models=localize,
                         shard=shard_for(shard), block_size=block_size, clip=clip, probe=probe,
                         framework_settings={target.framework: target.settings} if target else {},
                         force_model=force_model, skip_invalid=skip_invalid,
                         framework=target.framework if target else None,
                         distribution=distribution)
    options = resolve_options(checkpoint, asked)  # the one options pass: run_audit resolves nothing again
    print_from_config(config_tables(options), err_console if as_json else None,
                      model=model_line(options))  # before the replay: it may be long
    with dependency_log(out), replay_progress(not as_json) as progress:
        result = run_audit(checkpoint, rollouts, dataclasses.replace(options, progress=progress))
    if as_json:
        emit_json(result.record.to_dict())
        return
    from mismatch.results.summary_model import present

    declared = present(result.record.declared_checkpoint)
    if declared is not None and declared.line:  # meta.checkpoint disagrees with CHECKPOINT: first after the replay
        out_console.print(f"checkpoint: {declared.line}", markup=False, highlight=False, soft_wrap=True)
    skipped = present(result.record.skipped)
    if skipped is not None and skipped.count:
        first = skipped.rollouts[0].error if skipped.rollouts else ""
        out_console.print(f"skipped {skipped.count} invalid rollout(s) of {skipped.count + skipped.valid} "
                          f"(summary.json skipped), the first: {first}", markup=False, highlight=False, soft_wrap=True)
    print_pairs(result.record, target, out)
    print_distribution(result.record)
    print_findings(result.record)
    print_diagnosis(result.record)
    out_console.print(f"wrote {out}/")


def diff(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT",
                                               help="Checkpoint directory (HF format, safetensors).")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollouts file (.jsonl or .parquet).")],
    a: Annotated[str, typer.Option("--a", help="First engine config (spec, TOML, or a trainer config FRAMEWORK:FILE).")],
    b: Annotated[str, typer.Option("--b", help="Second engine config (spec, TOML, or FRAMEWORK:FILE).")],
    out: Annotated[Path, typer.Option("--out", help="Results directory to write.")],
    reference: Annotated[str, typer.Option("--reference", help="Reference engine (the trainer).")] = "hf",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing results dir.")] = False,
    distribution: DistributionOption = None,
    shard: ShardOption = None,
    block_size: BlockOption = DEFAULT_BLOCK,
    as_json: JsonFlag = False,
) -> None:
    """Replay two engine configs against a reference: which is closer, by how much, where, how fast."""
    from mismatch.results.staging import digest_ahead

    digest_ahead(rollouts)  # as audit's: the identity's digest begun while the imports run
    from mismatch.pipeline.configured import config_tables, resolve_options
    from mismatch.pipeline.diff import run_diff
    from mismatch.pipeline.options import DiffOptions

    options = resolve_options(checkpoint, DiffOptions(a=a, b=b, reference=reference, out=out, force=force,
                                                      shard=shard_for(shard), block_size=block_size,
                                                      distribution=distribution))
    print_from_config(config_tables(options), err_console if as_json else None)
    with dependency_log(out), replay_progress(not as_json) as progress:
        result = run_diff(checkpoint, rollouts, dataclasses.replace(options, progress=progress))
    if as_json:
        emit_json(result.record.to_dict())
        return
    print_pairs(result.record)
    print_distribution(result.record)
    print_diff(result.record)
    out_console.print(f"wrote {out}/")


def merge(
    dirs: Annotated[list[Path], typer.Argument(metavar="DIR...", help="Results dirs of shards 0..N-1.")],
    out: Annotated[Path, typer.Option("--out", help="Merged results directory to write.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing results dir.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Combine the results of `--shard I/N` runs into the results of one run."""
    from mismatch.pipeline.merge import merge as run_merge
    from mismatch.results import read_summary

    summary = run_merge(dirs, out, force=force)
    if as_json:
        emit_json(summary)
        return
    print_pairs(read_summary(out))  # as published
    out_console.print(f"wrote {out}/")


def recommend(
    results: Annotated[Path, typer.Argument(metavar="RESULTS", help="Results directory of an audit.")],
    framework: FrameworkOption = None,
    probes: Annotated[Optional[Path], typer.Option(
        "--probes", help="`mismatch probe --out` JSON: batch-shape variance adds the batch-invariant fix.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The correction (and fixes at the source) the measured gap calls for, with a config snippet."""
    from mismatch.advise.advice import for_target
    from mismatch.advise.gate import load_summary
    from mismatch.results import read_summary
    from mismatch.results.summary_model import present

    target = target_for(framework)
    probe_results = read_probes(probes) if probes is not None else None
    record = read_summary(results)
    # What gate refuses as impossible gets no advice either (its checks read the file as written, not
    # as decoded); nor a dir whose tables are another run's.
    load_summary(results)
    if record.command != "audit":  # a diff compares two configs: it recommends nothing
        raise MismatchError(f"{results}: a `mismatch {record.command}` results dir; recommend reads an "
                            "audit's (mismatch audit … --out DIR)")
    advice = for_target(record, target, results=results, probes=probe_results)
    if as_json:
        emit_json(advice.to_dict())
        return
    if advice.snippet is not None:  # the snippet alone (its comments carry each recommendation): pipeable
        sys.stdout.write(advice.snippet)
        return
    from mismatch.present.headline import cause_line

    for cause in advice.diagnosis.causes:  # the cause first, then what to do about it
        say(cause_line(cause))
    for item in advice.recommendations:
        cost = f" Cost: {item.cost}." if item.cost else ""
        out_console.print(f"{item.kind} {json.dumps(present(item.params))}: {item.why}.{cost}",
                          markup=False, highlight=False)


def gate(
    results: Annotated[list[Path], typer.Argument(
        metavar="RESULTS", help="Results directory to gate (with --trend: one per step of a run).")],
    maxima: Annotated[Optional[list[str]], typer.Option(
        "--max", help="Upper bound METRIC=VALUE (or PAIR.METRIC=VALUE; default pair train/sampler).")] = None,
    minima: Annotated[Optional[list[str]], typer.Option("--min", help="Lower bound, e.g. ess=0.95.")] = None,
    thresholds: Annotated[Optional[Path], typer.Option(help="Thresholds TOML ([max], [min], max_drift_pct).")] = None,
    baseline: Annotated[Optional[Path], typer.Option(help="Baseline results dir to compare against.")] = None,
    max_drift: Annotated[Optional[float], typer.Option(help="Allowed % worsening vs the baseline.")] = None,
    junit: Annotated[Optional[Path], typer.Option(help="Write a JUnit XML report here.")] = None,
    trend: Annotated[bool, typer.Option(
        "--trend", help="Gate a run's steps (RESULTS...: one audit per step) on how fast the gap grows.")] = False,
    max_slope: Annotated[Optional[list[str]], typer.Option(
        "--max-slope", help="With --trend: upper bound on METRIC's slope per step since the last change point.")] = None,
    max_step_change: Annotated[Optional[list[str]], typer.Option(
        "--max-step-change", help="With --trend: upper bound on METRIC's rise between consecutive steps.")] = None,
    order: Annotated[str, typer.Option(
        "--order", help="With --trend: names (steps from step_N dir names, every dir needs one) or given (the "
                        "order of RESULTS).")] = "names",
    as_json: JsonFlag = False,
) -> None:
    """Fail (exit 1) when drift metrics exceed thresholds or worsen past a baseline, or (--trend)
    when the gap grows faster than allowed over a run's steps."""
    from mismatch.advise import gate as gating

    if junit:  # before any check: a gate that passed must not end in a traceback at the write
        gating.check_junit_path(junit)
    if trend:
        from mismatch.advise.trend_gate import run_trend_gate

        if maxima or minima or thresholds or baseline or max_drift is not None:
            raise MismatchError("gate --trend takes --max-slope and --max-step-change; gate one results dir "
                                "for --max, --min, --thresholds and --baseline")
        _gate_exit(run_trend_gate(results, max_slope=max_slope or [], max_step_change=max_step_change or [],
                                  order=order), junit, as_json)
    if len(results) != 1:
        raise MismatchError(f"gate: one results dir, got {len(results)} (with --trend: one per step)")
    if max_slope or max_step_change:
        raise MismatchError("--max-slope and --max-step-change gate a run's steps: add --trend")
    limits = gating.load_thresholds(thresholds) if thresholds else gating.Thresholds()
    drift_pct = max_drift if max_drift is not None else (limits.max_drift_pct if baseline else None)
    result = gating.run_gate(
        gating.load_summary(results[0]),
        maxima=gating.combined_limits(limits.maxima, gating.parse_limits(maxima or []), bound="max",
                                      file=thresholds),
        minima=gating.combined_limits(limits.minima, gating.parse_limits(minima or [], flag="--min"),
                                      bound="min", file=thresholds),
        baseline=gating.load_summary(baseline) if baseline else None, max_drift_pct=drift_pct)
    _gate_exit(result, junit, as_json)


def _gate_exit(result: Any, junit: Optional[Path], as_json: bool) -> None:
    """The gate's JUnit file, its table or JSON, and its exit code (0 pass, 1 fail)."""
    from mismatch.advise import gate as gating

    if junit:
        gating.write_junit(result, junit)
    if as_json:
        emit_json(result.to_dict())
    else:
        if os.environ.get("GITHUB_ACTIONS") == "true":
            print(*gating.github_annotations(result), sep="\n")
        out_console.print(gating.format_table(result), markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(result.exit_code)
