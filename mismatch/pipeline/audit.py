"""The audit: stored rollouts replayed through a trainer and an engine, every pair's gap measured,
its cause diagnosed and corrected, the results dir published.

prepare → replay → store (tokens.parquet, drift, prefix keys) → the processed column when only the
data shows processing → analyze in chunks → localize (layers, kernels) → weights diff, probes →
summary.json → advise → publish. Every input is checked before the first forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.advise.advice import advise
from mismatch.advise.corrections import CorrectionSimulator
from mismatch.analysis.alignment import AlignmentCheck, check_alignment
from mismatch.analysis.chunked import Analysis, Chunks, run_passes
from mismatch.analysis.clip import ClipRange
from mismatch.analysis.distribution import DistributionSummary
from mismatch.analysis.per_rollout import PerRollout
from mismatch.analysis.prefixes import PrefixConsistency
from mismatch.analysis.routing import routing_summary, token_routing
from mismatch.analysis.strata import Strata
from mismatch.analysis.trees import TreeSums
from mismatch.analysis.truncation import KeptMassRatios
from mismatch.engines import engine_capabilities
from mismatch.errors import MismatchError
from mismatch.frameworks.metrics import FrameworkMetrics, declared_settings
from mismatch.localize import check_localizable
from mismatch.localize import localize_models as run_model_localizers
from mismatch.localize.turns import TurnLocalizer
from mismatch.pipeline import stages
from mismatch.pipeline.configured import resolve_options
from mismatch.pipeline.options import AuditOptions
from mismatch.pipeline.summary import Measured, Provenance, SummaryAnalyses, summary_json, with_parts
from mismatch.results.section_records import Drift
from mismatch.results.summary_model import Correction, DeclaredCheckpoint, EngineEntry, Summary, present, to_builtins
from mismatch.replay import DEFAULT_BLOCK, ProgressFactory, Replayed, Shard, followed_routing, replay_processed
from mismatch.replay.truncation import sampler_truncation, truncation_explained
from mismatch.results import TokenStore, results_lock, staged_tokens
from mismatch.results.chunks import ChunkSource
from mismatch.rollouts.declared_checkpoint import compare_declared, declared_line
from mismatch.streams import Sampling
from mismatch.workers import analysis_workers, reading_workers

AUDIT_PAIRS = (("train", "sampler"), ("train", "infer"), ("infer", "sampler"))
PROCESSED_PAIR = ("train_processed", "sampler")  # when the sampler stored processed log-probs


def audit_pairs(columns: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """The audit's pairs for a token table with these columns."""
    return AUDIT_PAIRS + ((PROCESSED_PAIR,) if "logp_train_processed" in set(columns) else ())


class AuditResult(stages.CommandResult):
    """An audit's summary.json, results dir, and token table when it wrote no results dir."""

    __slots__ = ()


def audit(checkpoint: str | Path, rollouts: str | Path, *, train: str = "hf", infer: str | None = None,
          out: str | Path | None = None, force: bool = False, localize_models: bool = False,
          shard: Shard | None = None, block_size: int = DEFAULT_BLOCK, progress: ProgressFactory | None = None,
          clip: ClipRange = ClipRange(), probe: bool = False, distribution: str | int | None = None,
          framework_settings: dict[str, dict[str, Any]] | None = None, force_model: bool = False,
          skip_invalid: bool = False) -> AuditResult:
    """Replay `rollouts` through `train` and `infer` engines and measure every pair's gap.

    The turn localizer always runs (it reads the table); `localize_models=True` also reruns the
    two configs with hooks for the layer and kernel localizers (train vs infer as reference).
    With `out`, finished blocks are kept in a work dir so the same call resumes after a kill.
    `clip` is the PPO clip range the gap is also measured against (summary.json `clip`).
    `probe=True` also runs the kernel probes at the checkpoint's shapes (summary.json `probes`).
    `distribution` (a top-K size, or "full"): also compare train's and infer's whole next-token
    distributions at every scored position (summary.json `distribution`; docs/distribution.md).
    `framework_settings` (framework -> settings, as `--for` gives them): the IS settings its
    framework metrics are computed with; `force_model`: audit although a --train config names
    another model; `skip_invalid`: audit the valid rollouts, list the others (summary.json skipped).
    The library's front door to `run_audit(checkpoint, rollouts, AuditOptions(...))`.
    """
    return run_audit(checkpoint, rollouts, AuditOptions(
        train=train, infer=infer, out=Path(out) if out is not None else None, force=force,
        localize_models=localize_models, shard=shard, block_size=block_size, progress=progress, clip=clip,
        probe=probe, distribution=None if distribution is None else str(distribution),
        framework_settings=framework_settings or {}, force_model=force_model, skip_invalid=skip_invalid))


def run_audit(checkpoint: str | Path, rollouts: str | Path, options: AuditOptions) -> AuditResult:
    """The audit of `options`, one run at a time into its results dir."""
    analysis_workers(0)  # a bad MISMATCH_WORKERS is refused before any replay
    options = resolve_options(checkpoint, options)  # nothing to do when the edge resolved them
    with results_lock(options.out):  # from its first check to its publish
        return _audit(checkpoint, rollouts, options)


def _audit(checkpoint: str | Path, rollouts: str | Path, options: AuditOptions) -> AuditResult:
    _check_requested_work(options)
    prepared = stages.prepare(checkpoint, rollouts, options, command="audit")
    replayed = stages.replay(checkpoint, rollouts, options, prepared, processed_source="train", routing_from="infer")
    with staged_tokens(options.out, force=options.force) as store:
        stored = stages.store_audit_rows(replayed, store, checkpoint, ("sampler", *options.sources),
                                            workers=reading_workers(Path(rollouts).stat().st_size))
        alignment = _alignment_before_the_passes(replayed, store, checkpoint, options)
        declared = compare_declared(replayed.declared_checkpoints, checkpoint,
                                    (prepared.inputs or {}).get("checkpoint"))
        pairs = audit_pairs(store.columns)  # with the processed pair once its column is there
        beside = ReplayFindings(engines=replayed.engines, drift=stored.drift, alignment=alignment,
                                     routing=replayed_routing(replayed, pairs), prefixes=stored.prefixes)
        requests = replayed.plan.requests if options.localize_models else None
        distribution = (DistributionSummary(options.distribution_pairs, replayed.distribution)
                        if options.distribution is not None else None)
        del replayed  # the rollouts and their requests: from here on only the tokens are read
        per_rollout = PerRollout(pairs)
        digestion = stages.report_digestion(store, pairs) if options.out is not None else None
        measured, findings = analyze_audit(store.chunks, beside, clip=options.clip,
                                           settings=options.framework_settings,
                                           extra=[per_rollout, digestion] if digestion is not None else [],
                                           workers=analysis_workers(store.num_rows), distribution=distribution)
        localized = _localized_models(checkpoint, requests, prepared, options) if requests is not None else {}
        summary = audit_summary(Provenance(command="audit", checkpoint=str(checkpoint), rollouts_file=str(rollouts),
                                           engines=beside.engines, shard=stages.shard_info(options),
                                           inputs=prepared.inputs),
                                measured, findings, localized=localized,
                                weights=engine_weights(beside.engines, checkpoint),
                                probes=_probes(checkpoint, options) if options.probe else None,
                                framework=options.framework, skipped=prepared.skipped,
                                declared_checkpoint=declared)
        if options.out is None:
            return AuditResult(record=summary, out=None, table=store.table)
        summary = stages.write_results_files(store, summary, stages.with_steps(per_rollout.result(), stored.steps),
                                             digestion)
    if prepared.work is not None:
        prepared.work.remove()
    return AuditResult(record=summary, out=options.out)


def _check_requested_work(options: AuditOptions) -> None:
    """Before any replay: the work asked for is done, or refused now."""
    if not options.localize_models:
        return
    check_localizable(options.train, options.infer)
    if options.shard is not None:
        # Layer and kernel localization reads the whole run's streams; a shard has a slice and
        # `merge` has no model to rerun it with.
        raise MismatchError("--localize with --shard: localization needs the whole run; audit "
                            "--localize without --shard (or run `mismatch layers` on the checkpoint)")


@dataclass(kw_only=True, slots=True, frozen=True)
class ReplayFindings:
    """What the analysis is given beside the token table: each engine as it described itself, and
    the findings that need the rollouts, the engines' routers or the replay's requests (render
    drift, MoE routing agreement, prefix consistency as found or as its query, run beside the
    first pass), and the alignment check when it was read before the passes."""

    engines: dict[str, Any]
    drift: Drift | None = None
    alignment: dict[str, Any] | None = None
    routing: dict[str, Any] | None = None
    prefixes: dict[str, Any] | PrefixConsistency | None = None


def _alignment_before_the_passes(replayed: Replayed, store: TokenStore, checkpoint: str | Path,
                                 options: AuditOptions) -> dict[str, Any] | None:
    """The alignment check, read on its own when it decides on a like-for-like pass (a trainer
    that can process its log-probs like the sampler's); else None, and it is read in the
    analysis's own passes. Processed log-probs the rollouts do not declare are found only in the
    data: then, and only then, the trainer replays again under the sampler's processing and the
    column joins tokens.parquet (a declared one is planned with the trainer's replay, resumable
    with it). A routing=replay trainer replays it following the experts its own pass followed (the
    engine's, stored or replayed by --infer), as R3 forces them in training: like for like, the
    two columns differ by the processing alone."""
    if not engine_capabilities(options.train).processing:
        return None
    forced = followed_routing(replayed.engines, replayed.routing, ("train",)).get("train")
    meta = replayed.engines["sampler"]["meta"]
    alignment = check_alignment(store.chunks, sampler_meta=meta)
    processing = Sampling.from_meta(meta)
    if alignment["logprob_semantics"] == "truncated":
        # A declared truncation is replayed as declared unless the data refute it; the estimate is made either way.
        found = sampler_truncation(replayed.plan, meta, options.train, checkpoint, forced=forced)
        alignment["truncation"].update(found)
        if not truncation_explained(found):
            # Raised, yet no kept set of this model's explains it (another model's rollouts, say):
            # not read as truncation, so no like-for-like pass measures against a set never sampled.
            alignment["truncation"]["truncated"] = False
            alignment["logprob_semantics"] = "raw"
            return alignment
        processing = Sampling(**found["replayed"])
        refuted = found["replayed_from"] != "declared" and "logp_train_processed" in store.columns
    else:
        refuted = False
    # The declared processing's column was planned with the trainer's pass; a declaration the data
    # refute gets it replaced by the estimate's (alignment.truncation.replayed_from says so).
    if refuted or ("logp_train_processed" not in store.columns
                   and alignment["logprob_semantics"] in ("processed", "truncated")):
        store.add_column("logp_train_processed",
                         replay_processed(replayed.plan, options.train, checkpoint, processing, forced=forced))
    return alignment


@dataclass(kw_only=True, slots=True, frozen=True)
class AuditFindings:
    """What an audit's passes find beyond the pair metrics: summary.json entries of those names."""

    alignment: dict[str, Any]
    trees: dict[str, Any]
    framework_metrics: dict[str, Any]
    framework_settings: dict[str, Any]
    turns: dict[str, Any]  # localization.turns
    corrections: list[Correction]
    drift: Drift | None
    routing: dict[str, Any] | None
    prefix_consistency: dict[str, Any] | None
    strata: dict[str, Any]
    distribution: dict[str, Any] | None = None  # --distribution: each engine pair's whole-distribution gap


def analyze_audit(chunks: Chunks, beside: ReplayFindings, *, clip: ClipRange | None, extra: Sequence[Analysis] = (),
                  workers: int = 1, settings: dict[str, dict[str, Any]] | None = None,
                  distribution: DistributionSummary | None = None) -> tuple[Measured, AuditFindings]:
    """Everything the token table shows, read as chunks of whole rollouts, every analysis in the
    same passes; `extra`: more analyses for those passes (the per-rollout table, the report's
    digestion); `workers`: how many processes share them (chunked.run_passes); `settings`: each framework's
    correction settings asked for (`--for`, a config), over those the rollouts declare, over the defaults."""
    if isinstance(chunks, ChunkSource) and chunks.columns is not None:
        columns = chunks.columns()  # from the file's footer: no chunk read for its names
    else:
        first = next(iter(chunks()), None)
        columns = list(first.columns) if first is not None else []
    pairs = audit_pairs(columns)
    summary = SummaryAnalyses(pairs, clip)
    meta = beside.engines["sampler"]["meta"]  # the stored side always describes its declaration (None: none)
    checked = AlignmentCheck(sampler_meta=meta) if beside.alignment is None else None
    # The IS settings: `--for`'s (or a --train config's), over what the run declared in its rollouts'
    # meta.sampler.framework_settings (a dump hook records its trainer's), over the releases' defaults.
    declared = declared_settings(meta)
    settings = {name: {**values, **(settings or {}).get(name, {})} for name, values in declared.items()}
    trees, frameworks, strata = TreeSums(pairs), FrameworkMetrics(pairs, settings), Strata(pairs)
    # With processed stored log-probs the correction is simulated like for like: on the raw pair it
    # would correct the processing, which raw_logprobs fixes.
    corrections = CorrectionSimulator(pair=PROCESSED_PAIR if PROCESSED_PAIR in pairs else ("train", "sampler"))
    turns = TurnLocalizer("train", "sampler")
    kept_mass = KeptMassRatios()
    prefixes = beside.prefixes
    run_passes(chunks, [*summary.analyses, trees, frameworks, strata, turns, corrections, kept_mass,
                        *([checked] if checked is not None else []),
                        *([distribution] if distribution is not None else []), *extra], workers=workers,
               side_jobs=[prefixes] if isinstance(prefixes, PrefixConsistency) else [])
    alignment = beside.alignment if checked is None else checked.result()
    alignment.setdefault("truncation", {})["ratios"] = kept_mass.result()
    return summary.result(), AuditFindings(
        alignment=alignment, trees=trees.result(),
        framework_metrics=frameworks.result(), framework_settings=settings, turns=turns.result(),
        corrections=[result.to_record() for result in corrections.result()], drift=beside.drift,
        routing=beside.routing or None,
        prefix_consistency=prefixes.result() if isinstance(prefixes, PrefixConsistency) else prefixes,
        strata=strata.result(), distribution=distribution.result() if distribution is not None else None)


def audit_summary(provenance: Provenance, measured: Measured, findings: AuditFindings, *,
                  localized: dict[str, Any] | None = None, weights: dict[str, Any] | None = None,
                  probes: dict[str, Any] | None = None, framework: str | None = None,
                  skipped: dict[str, Any] | None = None,
                  declared_checkpoint: DeclaredCheckpoint | None = None) -> Summary:
    """summary.json of an audit (or a merge of its shards), advised once on all of its evidence;
    `framework`: the one `--for` named; `skipped`: the rollouts --skip-invalid left out;
    `declared_checkpoint`: the rollouts' meta.checkpoint against the audited one
    (rollouts.declared_checkpoint), its `line` worded once the diagnosis is made."""
    summary = summary_json(provenance, measured, {
        "alignment": findings.alignment, "trees": findings.trees, "framework_metrics": findings.framework_metrics,
        "framework_settings": findings.framework_settings,
        "localization": {"turns": findings.turns, **(localized or {})}, "corrections": findings.corrections,
        "drift": findings.drift, "routing": findings.routing, "prefix_consistency": findings.prefix_consistency,
        "weights": weights or None, "probes": probes, "strata": findings.strata,
        **({"distribution": findings.distribution} if findings.distribution is not None else {}),
        **({"framework": framework} if framework is not None else {}), "skipped": skipped,
        **({"declared_checkpoint": to_builtins(declared_checkpoint)} if declared_checkpoint is not None else {})})
    advice = advise(summary, probes=present(summary.probes.results) if summary.probes else None)
    parts: dict[str, Any] = advice.parts()
    if declared_checkpoint is not None:  # its line says what the diagnosis made of the declaration
        identity = any(cause.kind == "identity" for cause in advice.diagnosis.causes)
        parts["declared_checkpoint"] = {**to_builtins(declared_checkpoint), "line": declared_line(
            declared_checkpoint, str(provenance.checkpoint), identity_cause=identity)}
    return with_parts(summary, parts)


def _localized_models(checkpoint: str | Path, requests: list[Any], prepared: stages.Prepared,
                      options: AuditOptions) -> dict[str, Any]:
    """The layer and kernel localizers: a planned stage of the work dir, done once and kept until
    the results are published."""
    work = prepared.work
    localized = work.load_stage("localize") if work is not None else None
    if localized is None:
        progress = options.progress
        done = progress("localize: layers and kernels, both models with hooks", 1) if progress else None
        localized = run_model_localizers(checkpoint, requests, a=options.train, b=options.infer)
        if work is not None:
            work.save_stage("localize", localized)
        if done is not None:
            done(1)
    return localized


def _probes(checkpoint: str | Path, options: AuditOptions) -> dict[str, Any]:
    """summary.json `probes`: each op under the variations that differ between engines, at the
    checkpoint's shapes, so a batch-shape variance they show reaches the diagnosis."""
    from mismatch import probes

    progress = options.progress
    done = progress("probe: each op under batch, chunking, split-KV, dtype and rounding variations", None) \
        if progress else None
    results = [result.to_dict() for result in probes.run_probes(checkpoint, device="auto")]
    if done is not None:
        done(0)
    return {"environment": probes.environment("auto"), "results": results}


def engine_weights(engines: dict[str, Any], checkpoint: str | Path) -> dict[str, Any]:
    """summary.json `weights`: for each engine that ran another checkpoint than the trainer's, the
    weights diff of the two (mismatch.weights, read tensor by tensor), so a weight-sync fault is
    named by its tensors."""
    from mismatch.weights import diff_checkpoints

    described = {source: EngineEntry.of(engine) for source, engine in engines.items()}
    train = described.get("train")
    trainer = Path(present(train.checkpoint) or checkpoint) if train is not None else Path(checkpoint)
    out = {}
    for source, engine in described.items():
        other = present(engine.checkpoint)
        if source == "train" or not other or Path(other).resolve() == trainer.resolve():
            continue
        try:
            out[source] = diff_checkpoints(trainer, other).brief()
        except (MismatchError, OSError) as error:  # evidence we could not gather: said, not fatal
            out[source] = {"a": str(trainer), "b": str(other), "identical": False, "differing": [],
                           "verdict": f"not compared: {error}"}
    return out


def replayed_routing(replayed: Replayed, pairs: tuple[tuple[str, str], ...]) -> dict[str, Any] | None:
    """summary.json["routing"] for the pairs whose two passes both recorded MoE routing."""
    if len(replayed.routing) < 2:
        return None
    per_row = {source: token_routing(replayed.plan.requests, routed) for source, routed in replayed.routing.items()}
    return routing_summary(replayed.table, pairs, per_row) or None
