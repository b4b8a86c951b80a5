"""The stages audit, diff and merge share: load and check, replay, store, the results files.

Each is a function of typed inputs to a typed output; the commands (audit.py, diff.py, merge.py)
compose them in the flow's order, and nothing here knows which command runs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pandas as pd

from mismatch.version import __version__
from mismatch.analysis.clip import ClipRange
from mismatch.analysis.prefixes import PrefixConsistency, PrefixKeys, prefix_keys
from mismatch.checkpoint import load_tokenizer
from mismatch.engines import check_spec
from mismatch.identity import run_inputs
from mismatch.pipeline.options import RunOptions
from mismatch.replay import Block, Replayed, ReplayOptions, replay_sources
from mismatch.replay.distribution import DistributionAsk, check_distribution, parse_distribution
from mismatch.results import (
    PREFIX_KEYS_FILE,
    ROLLOUTS_FILE,
    TokenStore,
    WorkDir,
    arrow_block,
    check_out_dir,
    published_files,
    read_tokens,
    write_summary,
)
from mismatch.results.section_records import Drift
from mismatch.results.staging import digest_ahead
from mismatch.results.summary_model import UNSET, PublishedFile, Summary, UnsetType, present, to_builtins
from mismatch.rollouts.drift import find_drift, recorded

if TYPE_CHECKING:
    import pyarrow as pa

    from mismatch.reports import DigestAnalysis


@dataclass(kw_only=True, slots=True, frozen=True)
class CommandResult:
    """What a command returns: its summary.json (`record`, the typed `Summary`), its results dir,
    and its token table only when it wrote no results dir (a command with one never holds the
    table whole)."""

    record: Summary
    out: Path | None
    table: pd.DataFrame | None = None

    @property
    def summary(self) -> dict[str, Any]:
        """The summary as plain data (`Summary.to_dict()`, NaN kept), what summary.json holds: the
        library's callers (`mismatch.audit(...).summary`) read it; the package reads `record`. A new
        copy each time."""
        return self.record.to_dict()

    @property
    def tokens(self) -> pd.DataFrame:
        """The token table: as computed without a results dir, else read back from OUT/tokens.parquet."""
        return self.table if self.table is not None else read_tokens(self.out)


@dataclass(kw_only=True, slots=True, frozen=True)
class Prepared:
    """What load-and-check hands on: the inputs' identity (summary.json `inputs`) and the
    resumable work dir beside OUT, opened only once every input passed its checks."""

    inputs: dict[str, Any] | None
    work: WorkDir | None
    skipped: dict[str, Any] | None = None  # --skip-invalid: the rollouts left out (summary.json `skipped`)


def prepare(checkpoint: str | Path, rollouts: str | Path, options: RunOptions, *, command: str) -> Prepared:
    """Refuse a taken results dir first, then every engine spec, then open the work dir (whose
    manifest is the inputs' identity: a resume of other inputs is refused)."""
    if options.out is not None:
        check_out_dir(options.out, force=options.force)
    # Every spec checked before anything else: a bad one leaves no work dir and costs no replay.
    specs = {source: check_spec(text) for source, text in options.sources.items()}
    ask = distribution_ask(options)
    if ask is not None:
        check_distribution(ask, specs)
    inputs = None
    # A missing checkpoint or rollouts file gets its own one-line error from the replay.
    if Path(checkpoint).is_dir() and Path(rollouts).is_file():
        inputs = run_inputs(command=command, checkpoint=checkpoint, rollouts=rollouts, engines=specs,
                            block_size=options.block_size, version=__version__, options=number_options(options))
    work = None
    if options.out is not None and inputs is not None:
        # Not the options: a resume with another clip range analyses the same replayed blocks anew.
        replayed_from = {key: value for key, value in inputs.items() if key != "options"}
        work = WorkDir.open(options.out, {**replayed_from, "shard": shard_info(options)}, force=options.force)
    skipped = invalid_rollouts(checkpoint, rollouts) if options.skip_invalid else None
    return Prepared(inputs=inputs, work=work, skipped=skipped)


MAX_SKIPPED_LISTED = 100  # summary.json `skipped.rollouts`: the first ones; `count` has them all


def invalid_rollouts(checkpoint: str | Path, rollouts: str | Path) -> dict[str, Any]:
    """--skip-invalid: the file's rollouts in error, validated as the replay reads it (against the
    checkpoint's vocabulary and experts): {count, rollouts: [{line, rollout, error}], listed}. The
    replay then reads the valid ones only (iter_rollouts(skip_invalid=True)), the same ones."""
    from mismatch.checkpoint import checkpoint_info
    from mismatch.rollouts import validate_file

    info = checkpoint_info(checkpoint)
    found = validate_file(rollouts, vocab_size=info.vocab_size, num_experts=info.num_experts,
                          max_errors=MAX_SKIPPED_LISTED * 4)
    listed: dict[int | None, dict[str, Any]] = {}
    for error in found.errors:  # the first error of each rollout
        if error.line not in listed and len(listed) < MAX_SKIPPED_LISTED:
            listed[error.line] = {"line": error.line, "rollout": error.rollout, "error": str(error)}
    return {"count": found.num_invalid, "valid": found.num_rollouts, "rollouts": list(listed.values())}


# The options of a command that change its numbers (or its advice) but not what it replays:
# summary.json `inputs.options`, which the shards of one merge must share.
NUMBER_OPTIONS = ("clip", "seed", "probe", "distribution")


def distribution_ask(options: RunOptions) -> DistributionAsk | None:
    """--distribution as the replay takes it (its pairs the command's), or None when not asked."""
    if options.distribution is None:
        return None
    k, full = parse_distribution(options.distribution)
    return DistributionAsk(k=k, full=full, pairs=options.distribution_pairs)


def number_options(options: RunOptions) -> dict[str, Any]:
    """`options`' NUMBER_OPTIONS that it has, as JSON (a clip range as its two bounds)."""
    found: dict[str, Any] = {}
    for name in NUMBER_OPTIONS:
        value = getattr(options, name, None)
        if isinstance(value, ClipRange):
            found.update(clip_eps_low=value.low, clip_eps_high=value.high)
        elif value is not None:
            found[name] = value
    if getattr(options, "skip_invalid", False):  # which rollouts are measured: shards of one merge must agree
        found["skip_invalid"] = True
    return found


def replay(checkpoint: str | Path, rollouts: str | Path, options: RunOptions, prepared: Prepared, *,
           processed_source: str | None, routing_from: str) -> Replayed:
    """Every engine source replayed block by block into the work dir (replay/): the blocks to read.
    The two roles are the command's: which source also replays like the sampler's processed
    log-probs, and which one a `routing=replay` engine follows."""
    replayed = replay_sources(checkpoint, rollouts, options.sources, ReplayOptions(
        progress=options.progress, shard=options.shard, block_size=options.block_size, work=prepared.work,
        processed_source=processed_source, routing_from=routing_from, skip_invalid=options.skip_invalid,
        distribution=distribution_ask(options)))
    for source, table in options.from_config.items():  # what a framework config set, beside what ran
        replayed.engines[source] = {**replayed.engines[source], "from_config": table}
    return replayed


def shard_info(options: RunOptions) -> dict[str, Any]:
    """summary.json's `shard`: which slice of the blocks a run replayed (0 of 1: all of them)."""
    shard = options.shard
    return {"index": shard.index if shard else 0, "count": shard.count if shard else 1,
            "block_size": options.block_size}


PREFIX_KEYS_SIDE = "prefix_keys"  # the side file of each row's prefix key (TokenStore.side_file)


@dataclass(kw_only=True, slots=True, frozen=True)
class StoreFindings:
    """What the pass that stores an audit's blocks also finds: render drift (None when no rollout
    has messages), prefix consistency's query, run beside the analysis's first pass, and each
    rollout's training step where its `meta.step` gives one (a step-indexed dump audited once:
    rollouts.parquet's `step`, which `mismatch trend` splits the run by)."""

    drift: Drift | None
    prefixes: PrefixConsistency
    steps: dict[str, int]


def store_rows(replayed: Replayed, store: TokenStore, workers: int = 1) -> None:
    """Each block's rows into the token store, one block in memory at a time. `workers`: forked
    readers of a stored-only replay's file (Replayed.map_blocks), as the audit's store has."""
    for table in replayed.map_blocks(partial(_block_rows, store.directory is not None), workers):
        store.write(table)
    _closed(store)


def _closed(store: TokenStore) -> None:
    """The store closed, and tokens.parquet's digest (summary.json `shard.files`) begun on a thread:
    it hashes while the analysis's passes run on both cores, not after them on one (0.13 s for
    benchmarks/audit_stored.py's 160 MB). A file changed since (a column added) is hashed again."""
    store.close()
    if store.file is not None:
        digest_ahead(store.file)


def _block_rows(on_disk: bool, block: Block) -> pd.DataFrame | pa.Table:
    """A block's rows as the store takes them: for tokens.parquet, the Arrow table it writes, made
    where the block is mapped (a forked reader), so that the process that writes only writes; in
    memory, the DataFrame."""
    return arrow_block(block.plan.table) if on_disk else block.plan.table


def store_audit_rows(replayed: Replayed, store: TokenStore, checkpoint: str | Path, sources: Sequence[str],
                        workers: int = 1) -> StoreFindings:
    """One pass over the replayed blocks: each block's rows into the token store, its rollouts'
    render drift (those with messages), and each row's prefix key. `workers`: forked readers of a
    stored-only replay's file (Replayed.map_blocks)."""
    drifts: list[dict[str, Any]] = []
    tokenized = False
    keys = PrefixKeys(store.side_file(PREFIX_KEYS_SIDE))
    steps: dict[str, int] = {}
    for table, block_keys, drift, needed_tokenizer, block_steps in replayed.map_blocks(
            partial(_stored_parts, str(checkpoint), store.directory is not None), workers):
        store.write(table)
        keys.add(block_keys)
        drifts.append(drift)
        tokenized = tokenized or needed_tokenizer
        steps.update(block_steps)
    _closed(store)
    keys.close()
    # Same prefix, same engine config: the same log-prob, whatever request it came in.
    prefixes = PrefixConsistency(store.file if store.file is not None else store.table,
                                 keys.file if keys.file is not None else keys.values, sources)
    return StoreFindings(drift=merge_drift([msgspec.convert(to_builtins(d), Drift, strict=False) for d in drifts])
                         if tokenized else None, prefixes=prefixes, steps=steps)


def _stored_parts(checkpoint: str, on_disk: bool,
                  block: Block) -> tuple[pd.DataFrame | pa.Table, Any, dict[str, Any], bool, dict[str, int]]:
    """What the store keeps of a block: its rows (_block_rows), their prefix keys, its rollouts'
    render drift, whether that needed the tokenizer, and each rollout's `meta.step` (an integer
    one). (Without messages a block's drift is its count of rollouts without them: no tokenizer.)"""
    tokenizer = None
    if any(rollout.messages or recorded(rollout) for rollout in block.rollouts):
        tokenizer = _tokenizer(checkpoint)
    return _block_rows(on_disk, block), prefix_keys(block.plan.requests), find_drift(block.rollouts, tokenizer), \
        tokenizer is not None, rollout_steps(block.rollouts)


def rollout_steps(rollouts: Sequence[Any]) -> dict[str, int]:
    """Each rollout's training step, where its meta.step is an integer (hooks and importers write it)."""
    found = {}
    for rollout in rollouts:
        step = rollout.meta.get("step") if isinstance(rollout.meta, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            found[rollout.id] = step
    return found


def with_steps(per_rollout: pd.DataFrame, steps: dict[str, int]) -> pd.DataFrame:
    """rollouts.parquet with each rollout's `step` (nullable: a rollout without one), when any has one."""
    if not steps:
        return per_rollout
    return per_rollout.assign(step=per_rollout["rollout"].astype(str).map(steps).astype("Int64"))


@lru_cache(maxsize=1)
def _tokenizer(checkpoint: str) -> Any:
    """The checkpoint's tokenizer, loaded once per process (each forked reader loads its own)."""
    return load_tokenizer(checkpoint)


def merge_drift(parts: Sequence[Drift]) -> Drift:
    """find_drift of every block as one: counts summed, per-kind counts merged, spans in block order
    (each rollout, and so each drifted one, lies in one block). A key no part has stays unset."""
    def total(values: list[int | UnsetType]) -> int | UnsetType:
        known = [value for value in values if value is not UNSET]
        return sum(known) if known else UNSET

    kinds: Counter[str] = Counter()
    for part in parts:
        kinds.update(present(part.spans_by_kind) or {})
    with_kinds = any(part.spans_by_kind is not UNSET for part in parts)
    with_spans = any(part.spans is not UNSET for part in parts)
    return Drift(num_rollouts_checked=total([p.num_rollouts_checked for p in parts]),
                 num_rollouts_without_messages=total([p.num_rollouts_without_messages for p in parts]),
                 num_rollouts_recorded=total([p.num_rollouts_recorded for p in parts]),
                 num_rollouts_drifted=total([p.num_rollouts_drifted for p in parts]),
                 num_spans=total([p.num_spans for p in parts]),
                 spans_by_kind=dict(sorted(kinds.items())) if with_kinds else UNSET,
                 trainable_tokens_touched=total([p.trainable_tokens_touched for p in parts]),
                 spans=[span for p in parts for span in present(p.spans) or ()] if with_spans else UNSET)


def report_digestion(store: TokenStore, pairs: Sequence[tuple[str, str]], *, command: str = "audit") -> DigestAnalysis:
    """The report's reading of the tokens, as an analysis to run in the command's own passes: its
    pairs as the summary lists them, the first as the focus, and the table's row count as every
    pair's upper bound, so the tail behind the histograms' range is gathered in pass 0. The report
    reads the tokens again only if the summary's focus turns out another pair. Both commands'
    summaries have per-turn metrics (so no per-turn reading); only an audit's page lists worst tokens."""
    from mismatch.reports import DigestAnalysis, WorstOptions

    names = [f"{a}/{b}" for a, b in pairs]
    return DigestAnalysis(store.columns, pairs=names, focus=names[0] if names else None, options=WorstOptions(),
                          with_turns=False, with_worst_tokens=command != "diff",
                          expected=dict.fromkeys(names, store.num_rows))


def write_results_files(store: TokenStore, summary: Summary, per_rollout: pd.DataFrame,
                        digested: DigestAnalysis | None = None) -> Summary:
    """summary.json, rollouts.parquet and the report, beside the stored tokens.parquet in the
    staged dir: they appear in the one rename that publishes it, when `staged_tokens` exits. The
    summary records each published table's rows and digest (`shard.files`, what a merge checks);
    a shard also publishes its rows' prefix keys, which its merge groups across shards.
    `digested`: report_digestion run in the command's passes. Returns the summary written."""
    from mismatch.reports import build_report

    stage = store.directory
    assert stage is not None
    per_rollout.to_parquet(stage / ROLLOUTS_FILE, index=False)
    shard = present(summary.shard)
    if shard is not None and shard.count > 1:  # what the merge of the shards reads
        store.keep_side_file(PREFIX_KEYS_SIDE, PREFIX_KEYS_FILE)
    store.remove_side_files()
    if shard is not None:  # in the summary returned too: it is the one written
        files = msgspec.convert(published_files(stage), dict[str, PublishedFile])
        summary = msgspec.structs.replace(summary, shard=msgspec.structs.replace(shard, files=files))
    write_summary(stage, summary)
    build_report(stage, digested=digested, verify=False)  # its own tables, hashed just above
    return summary
