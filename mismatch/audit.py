"""The audit: stored rollouts replayed through a trainer and an engine, gaps measured, results written.

rollouts → replay_sources(train, infer) → blocks → tokens.parquet (staged) → analysis in chunks →
results dir. Everything that can be wrong with the input is checked before the first forward pass.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from mismatch import __version__
from mismatch.advise.corrections import CorrectionSimulator
from mismatch.advise.diagnose import diagnose
from mismatch.advise.recommend import recommend, recommendations_dicts
from mismatch.advise.snippets import render_config
from mismatch.advise.verdicts import verdicts
from mismatch.analysis.alignment import (
    AlignmentCheck,
    check_alignment,
)
from mismatch.analysis.chunked import Analysis, Chunks, run_passes, table_chunks
from mismatch.analysis.counts import Counts
from mismatch.analysis.grouped_metrics import OVERALL, GroupedPairMetrics, breakdown_records
from mismatch.analysis.per_rollout import PerRollout, per_rollout_metrics
from mismatch.analysis.clip import ClipRange, clip_summary
from mismatch.frameworks.metrics import FrameworkMetrics, settings_used
from mismatch.frameworks import FRAMEWORKS, default_target
from mismatch.analysis.metrics import PAIR_METRICS
from mismatch.analysis.prefixes import PrefixConsistency, PrefixKeys, prefix_keys
from mismatch.analysis.routing import routing_summary, token_routing
from mismatch.checkpoint import load_tokenizer
from mismatch.engines import TORCH_KINDS, check_spec, parse_spec
from mismatch.engines.processing import Sampling
from mismatch.errors import MismatchError
from mismatch.identity import run_inputs
from mismatch.localize import check_localizable
from mismatch.localize import localize_models as run_model_localizers
from mismatch.localize.turns import TurnLocalizer
from mismatch.replay import (
    DEFAULT_BLOCK,
    Block,
    ProgressFactory,
    Replayed,
    Shard,
    replay_processed,
    replay_sources,
)
from mismatch.results import (
    ROLLOUTS_FILE,
    SUMMARY_SCHEMA,
    TokenStore,
    WorkDir,
    check_out_dir,
    read_tokens,
    results_lock,
    staged_tokens,
    write_summary,
)
from mismatch.rollouts.drift import find_drift, recorded
from mismatch.analysis.trees import TreeSums
from mismatch.workers import analysis_workers, reading_workers

if TYPE_CHECKING:
    from mismatch.reports.digest import Digestion

AUDIT_PAIRS = (("train", "sampler"), ("train", "infer"), ("infer", "sampler"))
PROCESSED_PAIR = ("train_processed", "sampler")  # when the sampler stored processed log-probs


def audit_pairs(columns: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """The audit's pairs for a token table with these columns."""
    return AUDIT_PAIRS + ((PROCESSED_PAIR,) if "logp_train_processed" in set(columns) else ())


@dataclass(kw_only=True, slots=True, frozen=True)
class AuditResult:
    summary: dict[str, Any]
    out: Path | None
    table: pd.DataFrame | None = None  # kept only without a results dir

    @property
    def tokens(self) -> pd.DataFrame:
        """The token table: as computed without a results dir, else read back from
        OUT/tokens.parquet (an audit with one never holds its table whole)."""
        return self.table if self.table is not None else read_tokens(self.out)


def audit(checkpoint: str | Path, rollouts: str | Path, *, train: str = "hf",
          infer: str = "hf-decode", out: str | Path | None = None, force: bool = False,
          localize_models: bool = False, shard: Shard | None = None, block_size: int = DEFAULT_BLOCK,
          progress: ProgressFactory | None = None, clip: ClipRange = ClipRange(),
          probe: bool = False) -> AuditResult:
    """Replay `rollouts` through `train` and `infer` engines and measure every pair's gap.

    The turn localizer always runs (it reads the table); `localize_models=True` also reruns the
    two configs with hooks for the layer and kernel localizers (train vs infer as reference).
    With `out`, finished blocks are kept in a work dir so the same call resumes after a kill.
    `clip` is the PPO clip range the gap is also measured against (summary.json `clip`).
    `probe=True` also runs the kernel probes at the checkpoint's shapes (summary.json `probes`),
    so a batch-shape variance they show reaches the recommendations (batch_invariant).
    """
    out_dir = Path(out) if out is not None else None
    analysis_workers(0)  # a bad MISMATCH_WORKERS is refused before any replay
    with results_lock(out_dir):  # one run at a time into OUT, from its first check to its publish
        return _audit(checkpoint, rollouts, train=train, infer=infer, out_dir=out_dir, force=force,
                      localize_models=localize_models, shard=shard, block_size=block_size,
                      progress=progress, clip=clip, probe=probe)


def _audit(checkpoint: str | Path, rollouts: str | Path, *, train: str, infer: str, out_dir: Path | None,
           force: bool, localize_models: bool, shard: Shard | None, block_size: int,
           progress: ProgressFactory | None, clip: ClipRange, probe: bool) -> AuditResult:
    sources = {"train": train, "infer": infer}
    if localize_models:
        check_localizable(train, infer)  # before any replay: requested work is done or refused
        if shard is not None:
            # Layer and kernel localization reads the whole run's streams; a shard has a slice
            # and `merge` has no model to rerun it with.
            raise MismatchError("--localize with --shard: localization needs the whole run; audit "
                                "--localize without --shard (or run `mismatch layers` on the checkpoint)")
    replayed, work, inputs = replay_for_results(checkpoint, rollouts, sources, out=out_dir, force=force,
                                                shard=shard, block_size=block_size, progress=progress,
                                                command="audit")
    with staged_tokens(out_dir, force=force) as store:
        found = store_blocks(replayed, store, checkpoint, ("sampler", *sources),
                             workers=reading_workers(Path(rollouts).stat().st_size))
        engines = replayed.engines
        # Read on its own only when it decides on a like-for-like pass (a torch trainer); else in
        # the analysis's own passes.
        alignment = (check_alignment(store.chunks, sampler_meta=engines["sampler"]["meta"])
                     if parse_spec(train).kind in TORCH_KINDS else None)
        if (alignment is not None and "logp_train_processed" not in store.columns
                and alignment["logprob_semantics"] == "processed"):
            # Processed log-probs the rollouts do not declare are found only in the data: then, and
            # only then, the like-for-like pass runs after the analysis began (a declared one is
            # planned with the trainer's replay, resumable with it).
            sampling = Sampling.from_meta(engines["sampler"]["meta"])
            store.add_column("logp_train_processed", replay_processed(replayed.plan, train, checkpoint, sampling))
        pairs = audit_pairs(store.columns)
        routing = replayed_routing(replayed, pairs)
        requests = replayed.plan.requests if localize_models else None
        del replayed  # the rollouts and their requests: from here on only the tokens are read
        per_rollout = PerRollout(pairs)
        digestion = report_digestion(store) if out_dir is not None else None
        summary = analyze_audit(store.chunks, engines=engines, checkpoint=str(checkpoint),
                                rollouts_file=str(rollouts), drift=found.drift, alignment=alignment, clip=clip,
                                routing=routing, prefixes=found.prefixes,
                                also=[per_rollout, digestion] if digestion is not None else [],
                                workers=analysis_workers(store.num_rows))
        summary["shard"] = shard_info(shard, block_size)
        summary["inputs"] = inputs
        weights = engine_weights(engines, checkpoint)
        if weights:
            summary["weights"] = weights
        if requests is not None:
            # A planned stage of the work dir: done once, kept until the results are published.
            localized = work.load_stage("localize") if work is not None else None
            if localized is None:
                done = progress("localize: layers and kernels, both models with hooks", 1) if progress else None
                localized = run_model_localizers(checkpoint, requests, a=train, b=infer)
                if work is not None:
                    work.save_stage("localize", localized)
                if done is not None:
                    done(1)
            summary["localization"].update(localized)
        advise(summary)  # again: the inputs, the weights and the localizers are evidence too
        if probe:
            add_probes(summary, checkpoint, progress)
        if out_dir is None:
            return AuditResult(summary=summary, out=None, table=store.table)
        write_summary_files(store, summary, per_rollout.result(), digestion)
    if work is not None:
        work.remove()
    return AuditResult(summary=summary, out=out_dir)


@dataclass(kw_only=True, slots=True, frozen=True)
class _Stored:
    """What the pass that stores the blocks also finds: render drift, and the prefix keys that
    prefix consistency (run beside the analysis's first pass) groups."""

    drift: dict[str, Any] | None
    prefixes: PrefixConsistency  # run beside the analysis


def store_blocks(replayed: Replayed, store: TokenStore, checkpoint: str | Path, sources: Sequence[str],
                 workers: int = 1) -> _Stored:
    """One pass over the replayed blocks: each block's rows into the token store, its rollouts'
    render drift (those with messages), and each row's prefix key (for prefix consistency, run
    beside the analysis's first pass). `workers`: forked readers of a stored-only replay's
    file (Replayed.map_blocks)."""
    drifts: list[dict[str, Any]] = []
    tokenized = False
    keys = PrefixKeys(store.side_file("prefix_keys"))
    for number, (table, block_keys, drift, needed_tokenizer) in enumerate(
            replayed.map_blocks(partial(_stored_parts, str(checkpoint)), workers)):
        store.write(table)
        keys.add(block_keys)
        drifts.append(drift)
        tokenized = tokenized or needed_tokenizer
    store.close()
    keys.close()
    # Same prefix, same engine config: the same log-prob, whatever request it came in.
    prefixes = PrefixConsistency(store.file if store.file is not None else store.table,
                                 keys.file if keys.file is not None else keys.values, sources)
    return _Stored(drift=merge_drift(drifts) if tokenized else None, prefixes=prefixes)


def _stored_parts(checkpoint: str, block: Block) -> tuple[pd.DataFrame, Any, dict[str, Any], bool]:
    """What the store keeps of a block: its rows, their prefix keys, its rollouts' render drift,
    and whether that needed the tokenizer. (Without messages a block's drift is its count of
    rollouts without them: no tokenizer.)"""
    tokenizer = None
    if any(rollout.messages or recorded(rollout) for rollout in block.rollouts):
        tokenizer = _tokenizer(checkpoint)
    return block.plan.table, prefix_keys(block.plan.requests), find_drift(block.rollouts, tokenizer), \
        tokenizer is not None


@lru_cache(maxsize=1)
def _tokenizer(checkpoint: str) -> Any:
    """The checkpoint's tokenizer, loaded once per process (each forked reader loads its own)."""
    return load_tokenizer(checkpoint)


def merge_drift(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """find_drift of every block as one: counts summed, per-kind counts merged, spans in block order
    (each rollout, and so each drifted one, lies in one block)."""
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                merged[key] = merged.get(key, []) + value
            elif isinstance(value, dict):
                kinds = Counter(merged.get(key, {}))
                kinds.update(value)
                merged[key] = dict(sorted(kinds.items()))
            else:
                merged[key] = merged.get(key, 0) + value
    return merged


def analyze_audit(chunks: Chunks, *, engines: dict[str, Any], checkpoint: str,
                  rollouts_file: str, drift: dict[str, Any] | None = None,
                  alignment: dict[str, Any] | None = None, clip: ClipRange = ClipRange(),
                  routing: dict[str, Any] | None = None,
                  prefixes: dict[str, Any] | PrefixConsistency | None = None,
                  also: Sequence[Analysis] = (), workers: int = 1) -> dict[str, Any]:
    """Everything an audit's summary.json says that follows from the token table, read as chunks
    of whole rollouts, every analysis in the same passes (and the render-drift, MoE routing and
    prefix findings, which need the rollouts, the engines' routers or the replay's requests, and
    are passed in: prefix consistency as found, or as the query that finds it, run beside the
    first pass). `alignment` is the check_alignment result when the caller already has it; `also`
    are more analyses to run in the same passes (the per-rollout table); `workers`: how many
    processes share them (chunked.run_passes)."""
    first = next(iter(chunks()), None)
    pairs = audit_pairs(first.columns if first is not None else ())
    summary = SummaryAnalyses(pairs, clip)
    checked = AlignmentCheck(sampler_meta=engines["sampler"].get("meta")) if alignment is None else None
    trees, frameworks = TreeSums(pairs), FrameworkMetrics(pairs)
    # With processed stored log-probs the correction is simulated like for like: on the raw pair it
    # would correct the processing, which raw_logprobs fixes.
    corrections = CorrectionSimulator(pair=PROCESSED_PAIR if PROCESSED_PAIR in pairs else ("train", "sampler"))
    turns = TurnLocalizer("train", "sampler")
    run_passes(chunks, [*summary.analyses, trees, frameworks, turns, corrections,
                        *([checked] if checked is not None else []), *also], workers=workers,
               side_jobs=[prefixes] if isinstance(prefixes, PrefixConsistency) else [])
    out = summary.result(engines=engines, checkpoint=checkpoint, rollouts_file=rollouts_file, command="audit")
    out["alignment"] = alignment if checked is None else checked.result()
    out["trees"] = trees.result()
    out["framework_metrics"] = frameworks.result()
    out["framework_settings"] = settings_used()
    out["localization"]["turns"] = turns.result()
    if drift is not None:
        out["drift"] = drift
    if routing:
        out["routing"] = routing
    if prefixes is not None:
        out["prefix_consistency"] = prefixes.result() if isinstance(prefixes, PrefixConsistency) else prefixes
    out["corrections"] = [result.to_dict() for result in corrections.result()]
    advise(out)
    return out


def advise(summary: dict[str, Any], **findings: Any) -> None:
    """summary.json's diagnosis, recommendations (the rule on the summary, plus `findings` such as
    probes) and each framework's config snippet for them; each pair's verdict names its cause."""
    diagnosis = diagnose(summary, probes=findings.get("probes"))
    summary["diagnosis"] = diagnosis.to_dict()
    summary["verdicts"] = verdicts(summary["pairs"], diagnosis)
    summary["recommendations"] = recommendations_dicts(recommend(summary, **findings))
    # Each framework's snippet chooses among the corrections its release can express (the one
    # installed here, else the newest mismatch has read).
    targets = [default_target(framework) for framework in FRAMEWORKS]
    summary["config_snippets"] = {target.framework: render_config(
        recommendations_dicts(recommend(summary, target, **findings)), target, causes=summary["diagnosis"]["causes"])
        for target in targets}


def add_probes(summary: dict[str, Any], checkpoint: str | Path, progress: ProgressFactory | None) -> None:
    """The kernel probes into summary.json `probes`, and the rule run again with their evidence."""
    from mismatch import probes

    done = progress("probe: each op under batch, chunking, split-KV, dtype and rounding variations", None) \
        if progress else None
    results = [result.to_dict() for result in probes.run_probes(checkpoint, device="auto")]
    if done is not None:
        done(0)
    summary["probes"] = {"environment": probes.environment("auto"), "results": results}
    advise(summary, probes=results)


def engine_weights(engines: dict[str, Any], checkpoint: str | Path) -> dict[str, Any]:
    """summary.json `weights`: for each engine that ran another checkpoint than the trainer's, the
    weights diff of the two (mismatch.weights, read tensor by tensor), so a weight-sync fault is
    named by its tensors."""
    from mismatch.weights import diff_checkpoints

    trainer = Path((engines.get("train") or {}).get("checkpoint") or checkpoint)
    out = {}
    for source, engine in engines.items():
        other = engine.get("checkpoint")
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


def replay_for_results(checkpoint: str | Path, rollouts: str | Path, sources: dict[str, str], *,
                       out: Path | None, force: bool, shard: Shard | None, block_size: int,
                       progress: ProgressFactory | None,
                       command: str) -> tuple[Replayed, WorkDir | None, dict[str, Any] | None]:
    """Refuse a taken results dir first, then replay with a resumable work dir beside it; also
    returns the inputs' identity (summary.json `inputs`), which the work dir must match."""
    work = None
    if out is not None:
        check_out_dir(out, force=force)
    # Every spec checked before anything else: a bad one leaves no work dir and costs no replay.
    specs = {source: check_spec(text) for source, text in sources.items()}
    inputs = None
    # A missing checkpoint or rollouts file gets its own one-line error from replay_sources.
    if Path(checkpoint).is_dir() and Path(rollouts).is_file():
        inputs = run_inputs(command=command, checkpoint=checkpoint, rollouts=rollouts, engines=specs,
                            block_size=block_size, version=__version__)
    if out is not None and inputs is not None:
        work = WorkDir.open(out, {**inputs, "shard": shard_info(shard, block_size)}, force=force)
    replayed = replay_sources(checkpoint, rollouts, sources, progress=progress, shard=shard,
                            block_size=block_size, work=work,
                            processed_source="train" if command == "audit" else None,
                            routing_from="infer" if command == "audit" else "reference")
    return replayed, work, inputs


def publish(out: Path, table: pd.DataFrame, summary: dict[str, Any],
            pairs: tuple[tuple[str, str], ...], *, force: bool, work: WorkDir | None) -> None:
    """Write the results dir of a token table in memory in one rename, then drop the work dir it
    no longer needs (diff and merge; an audit stores its blocks as it reads them)."""
    with staged_tokens(out, force=force) as store:
        for chunk in table_chunks(table)():
            store.write(chunk)
        store.close(empty=table)
        write_summary_files(store, summary, per_rollout_metrics(table_chunks(table), pairs))
    if work is not None:
        work.remove()


def write_summary_files(store: TokenStore, summary: dict[str, Any], per_rollout: pd.DataFrame,
                        digested: Digestion | None = None) -> None:
    """summary.json, rollouts.parquet and the report, beside the stored tokens.parquet (in the
    staged dir: they appear in the same rename). `digested`: report_digestion run in the analysis."""
    from mismatch.reports.build import build_report

    stage = store.directory
    assert stage is not None
    per_rollout.to_parquet(stage / ROLLOUTS_FILE, index=False)
    write_summary(stage, summary)
    store.remove_side_files()
    build_report(stage, digested=digested)


def report_digestion(store: TokenStore) -> Digestion:
    """The report's reading of the tokens, as an analysis to run in the audit's passes: its pairs
    as the summary lists them, train/sampler (the first) as the focus, and the table's row count
    as every pair's upper bound, so the tail behind the histograms' range is gathered in pass 0.
    The report reads the tokens again only if the summary's focus turns out another pair."""
    from mismatch.reports.digest import Digestion
    from mismatch.reports.worst import WorstOptions

    pairs = [f"{a}/{b}" for a, b in audit_pairs(store.columns)]
    return Digestion(store.columns, pairs=pairs, focus=pairs[0] if pairs else None, options=WorstOptions(),
                     with_turns=False, with_worst_tokens=True, expected=dict.fromkeys(pairs, store.num_rows))


def shard_info(shard: Shard | None, block_size: int) -> dict[str, Any]:
    """summary.json's `shard`: which slice of the blocks a run replayed (0 of 1: all of them)."""
    return {"index": shard.index if shard else 0, "count": shard.count if shard else 1,
            "block_size": block_size}


class SummaryAnalyses:
    """The analyses behind summary.json's pairs, breakdowns, counts and clip shares."""

    def __init__(self, pairs: tuple[tuple[str, str], ...], clip: ClipRange | None) -> None:
        self.pairs, self.clip = pairs, clip
        self.trainable = GroupedPairMetrics(pairs, ("turn", "branch_kind"), trainable_only=True,
                                            clip=(clip.low, clip.high) if clip is not None else None)
        self.every_row = GroupedPairMetrics(pairs, ("role",), trainable_only=False, overall=False)
        self.counts = Counts()
        self.analyses: list[Analysis] = [self.trainable, self.every_row, self.counts]

    def result(self, *, engines: dict[str, Any], checkpoint: str, rollouts_file: str, command: str) -> dict[str, Any]:
        """summary.json (contract `mismatch.summary/v1`); with `clip`, also summary.json `clip`."""
        found, by_role = self.trainable.result(), self.every_row.result()
        pair_metrics = {name: _metrics_row(frame) for name, frame in found[OVERALL].items()}
        summary = {
            "schema": SUMMARY_SCHEMA,
            "command": command,
            "mismatch_version": __version__,
            "created_unix": time.time(),
            "checkpoint": checkpoint,
            "rollouts_file": rollouts_file,
            "counts": self.counts.counts,
            "engines": engines,
            "pairs": pair_metrics,
            "verdicts": verdicts(pair_metrics),
            "turns": breakdown_records(found["turn"], "turn"),
            "roles": breakdown_records(by_role["role"], "role"),
            "branch_kinds": breakdown_records(found["branch_kind"], "branch_kind"),
            # Filled by the callers that have the inputs: localizers, corrections, recommendations.
            "localization": {},
            "corrections": [],
            "recommendations": [],
        }
        if self.clip is not None:
            summary["clip"] = clip_summary(self.clip, found)
        return summary


def build_summary(chunks: Chunks, *, engines: dict[str, Any], checkpoint: str,
                  rollouts_file: str, pairs: tuple[tuple[str, str], ...], command: str,
                  clip: ClipRange | None = None) -> dict[str, Any]:
    """summary.json (contract `mismatch.summary/v1`) from a filled token table's chunks of whole
    rollouts (analysis/chunked.py); with `clip`, also summary.json `clip`."""
    summary = SummaryAnalyses(pairs, clip)
    run_passes(chunks, summary.analyses)
    return summary.result(engines=engines, checkpoint=checkpoint, rollouts_file=rollouts_file, command=command)


def _metrics_row(frame: pd.DataFrame) -> dict[str, float | int]:
    row = frame.iloc[0]
    return {name: int(row[name]) if name in ("n_tokens", "n_rollouts") else float(row[name]) for name in PAIR_METRICS}
