"""The replay step: every engine source's pass over the file's blocks, one engine loaded at a time
and fed one block at a time, each finished (source, block) saved as it finishes.

`replay_sources` checks everything first, replays each engine source (`SourcePass`), and returns
the blocks to read back (`Replayed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mismatch.checkpoint import checkpoint_info
from mismatch.engines import TORCH_KINDS, Engine, EngineSpec, ProgressFn, check_spec, engine_capabilities, load_engine
from mismatch.engines.contract import recorded_entropy, recorded_routing
from mismatch.errors import EngineError, SpecError
from mismatch.replay.blocks import FileBlocks, FileScan, sampler_meta, scan_file
from mismatch.replay.checks import (
    ENTROPY_SUFFIX,
    check_before_replay,
    check_column,
    check_stored_routing,
    entropy_damage,
    replay_column,
    stored_routing,
)
from mismatch.replay.distribution import DistributionAsk, DistributionPass, check_distribution
from mismatch.replay.plan import DEFAULT_BLOCK, ReplayPlan, Shard
from mismatch.replay.processed import declared_processing
from mismatch.replay.replayed import Counts, FilledBlocks, Replayed, SavedColumns
from mismatch.results import WorkDir
from mismatch.results.summary_model import EngineEntry, present
from mismatch.rollouts import iter_rollouts
from mismatch.rollouts.pinned import Pinned
from mismatch.streams import Sampling, StreamRouting

# (label, total tokens) -> a callback per batch of tokens done; total None: a phase without a count
# (an engine starting), whose callback is called once when it ends; total 0: a note, one line.
ProgressFactory = Callable[[str, int | None], ProgressFn | None]

# What an engine reports about itself once loaded that its spec does not fix (the dtype "auto"
# resolved to, the model and version an HTTP server serves): a resume must find it unchanged.
ENGINE_FACTS = ("kind", "dtype", "api", "model", "server", "logprob_semantics")


def engine_facts(described: dict[str, Any]) -> dict[str, Any]:
    return {key: described[key] for key in ENGINE_FACTS if key in described}


def engine_counts(described: dict[str, Any]) -> Counts:
    """An engine's counters of the work it did (num_*, seconds: what a merge of shards sums too)."""
    return {key: value for key, value in described.items() if (key.startswith("num_") or key == "seconds")
            and isinstance(value, (int, float)) and not isinstance(value, bool)}


def with_counts(described: dict[str, Any], counts: Counts) -> dict[str, Any]:
    """An engine's description with its counters summed over every block of the run, and the
    ratios made of them: a resumed run's engine did only the blocks left, and reports what one
    run would have (the earlier blocks' counters were saved beside them). Counters start at 0
    when an engine loads (every built-in engine's do), so the blocks' sum is the whole."""
    merged = {**described, **counts}
    if {"padding_frac", "num_tokens_padded", "num_tokens_fed"} <= merged.keys():
        padded = merged["num_tokens_padded"]
        merged["padding_frac"] = padded / max(merged["num_tokens_fed"] + padded, 1)
    if "tokens_per_s" in merged:
        seconds, scored = merged.get("seconds"), merged.get("num_tokens_scored")
        merged["tokens_per_s"] = scored / seconds if seconds and scored is not None else None
    return merged


@dataclass(kw_only=True, slots=True, frozen=True)
class ReplayOptions:
    """How a replay runs, beside what it replays: its progress, the slice of blocks (`shard`) and
    their size, the work dir its columns are saved to, two roles a command gives its sources:
    `processed_source`, the torch engine that also replays like the sampler's processed log-probs,
    and `routing_from`, the source a `routing=replay` engine follows; and `pinned`, the rollouts
    file as the run found it (`Pinned.of_inputs(inputs["rollouts"])`; see `_pinned`)."""

    progress: ProgressFactory | None = None
    shard: Shard | None = None
    block_size: int = DEFAULT_BLOCK
    work: WorkDir | None = None
    processed_source: str | None = None
    routing_from: str | None = None
    pinned: Pinned | None = None  # the rollouts file's size and digest as the run's inputs took them
    skip_invalid: bool = False  # replay the file's valid rollouts only (--skip-invalid)

    distribution: DistributionAsk | None = None  # --distribution: the pairs' whole next-token distributions


def replay_sources(checkpoint: str | Path, rollouts: str | Path, sources: dict[str, str],
                   options: ReplayOptions = ReplayOptions()) -> Replayed:
    """Check everything, replay each engine source block by block, and return the blocks to read.

    All input checks (checkpoint, specs, rollouts, stored names, context) come before the first
    forward. With engines to run, a first pass over the file validates it and gathers what the
    checks need; each engine then streams the file block by block. An audit of stored log-probs
    only (`stored:`) loads no engine and reads the file once, in `blocks()`, which raises at the
    end of that pass for a stored name no segment of the file carries.
    With `options.work`, each (source, block) result is saved as it finishes and reused on a rerun
    (without one, kept in memory). `processed_source` (a torch engine's source): when the
    rollouts' meta.sampler declares processed log-probs under a non-trivial temperature, top-k or
    top-p, that engine also fills `logp_<source>_processed` under the same processing, like for
    like with the sampler's, in the same load and block by block.
    `routing_from`: the source whose MoE routing a `routing=replay` engine follows (R3); it replays
    first. Rollouts that store the sampler's routed_experts give the "sampler" routing, and a
    `routing=replay` engine follows that instead: the rollout engine's experts, as R3 replays them.
    """
    info = checkpoint_info(checkpoint)
    # Every spec checked in full (options, values, dtype) before the rollouts are read and before
    # the first replay: a typo in the second engine's spec must not cost the first one's replay.
    specs = {source: check_spec(text) for source, text in sources.items()}
    if options.distribution is not None:
        check_distribution(options.distribution, specs)
    blocks = FileBlocks(rollouts=rollouts, info=info, shard=options.shard, block_size=options.block_size,
                        pinned=_pinned(rollouts, options), skip_invalid=options.skip_invalid)
    engines: dict[str, Any] = {"sampler": {"kind": "stored", "spec": "sampler", "meta": {}}}
    columns = SavedColumns(options.work)
    routing: dict[str, list[StreamRouting]] = {}
    stored_only = all(spec.kind == "stored" for spec in specs.values())
    if stored_only:
        iter_rollouts(rollouts)  # opens nothing yet, but checks the file exists and is readable: now
        engines.update({source: _stored_engine(spec) for source, spec in specs.items()})
    else:
        routing, scan = _replay_engines(specs, blocks, engines, columns, checkpoint=str(checkpoint), options=options)
    distribution: dict[str, Any] = {}
    ask = options.distribution
    pairs = ask.pairs if ask is not None and not stored_only else ()
    for a, b in pairs:
        # After every replay: both engines of the pair at once (engines/distributions.py).
        distribution[f"{a}/{b}"] = DistributionPass(a, b, specs=specs, checkpoint=str(checkpoint), ask=ask,
                                                    vocab_size=info.vocab_size,
                                                    forced=followed_routing(engines, routing, (a, b))
                                                    ).run(blocks.planned(), columns)
    filled = FilledBlocks(file=blocks, specs=specs, columns=columns, engines=engines, stored_only=stored_only,
                          distribution=ask if pairs else None)
    if not stored_only:
        filled.checkpoints = scan.checkpoints
    return Replayed(engines=engines, routing=routing, filled=filled, distribution=distribution)


def _pinned(rollouts: str | Path, options: ReplayOptions) -> Pinned | None:
    """The rollouts file as the run found it, which every pass reads and checks unchanged at its
    end: the command's pin, else its work dir's (whose manifest holds the run's inputs), else the
    file now (a library caller)."""
    if options.pinned is not None:
        return options.pinned
    recorded = Pinned.of_inputs(options.work.manifest.get("rollouts")) if options.work is not None else None
    return recorded or Pinned.take(rollouts)


def _replay_engines(specs: dict[str, EngineSpec], blocks: FileBlocks, engines: dict[str, Any],
                    columns: SavedColumns, *, checkpoint: str,
                    options: ReplayOptions) -> tuple[dict[str, list[StreamRouting]], FileScan]:
    """The first scan and the checks it allows, then every source in replay order: each source's
    description into `engines`; returns each source's MoE routing, where recorded or stored, and the scan."""
    scan = scan_file(blocks)
    engines["sampler"]["meta"] = sampler_meta(scan.metas)
    check_before_replay(specs, scan, blocks.info, file=blocks.path)
    routing_from = options.routing_from
    routing: dict[str, list[StreamRouting]] = {}
    stored = stored_routing(blocks, scan)
    if stored is not None:
        routing["sampler"] = stored
        routing_from = "sampler"
        check_stored_routing(specs, blocks, stored)
    totals = (sum(scan.stream_lengths), scan.num_scored)
    for source, spec in _replay_order(specs, routing_from):
        if spec.kind == "stored":
            engines[source] = _stored_engine(spec)
            continue
        processing = (declared_processing(engines["sampler"]["meta"])
                      if source == options.processed_source and engine_capabilities(spec).processing else None)
        forced = _forced(source, spec, routing, routing_from)
        replayer = SourcePass(source, spec, checkpoint=checkpoint, progress=options.progress, columns=columns,
                              processing=processing, forced=forced)
        described, routed = replayer.replay_blocks(blocks.planned(), totals)
        engines[source] = _with_replay_facts(described, routing_from if forced is not None else None, processing)
        if routed is not None:
            routing[source] = routed
    return routing, scan


def _stored_engine(spec: EngineSpec) -> dict[str, Any]:
    return {"kind": "stored", "spec": spec.text, "name": spec.options["name"]}


def followed_routing(engines: dict[str, Any], routing: dict[str, list[StreamRouting]],
                     sources: Sequence[str]) -> dict[str, list[StreamRouting]]:
    """The experts each of `sources` followed in its replay (routing=replay: the source named by
    its description's routing.from), one per request in plan order; a later pass of the same
    engine (the like-for-like column, the truncation estimate, --distribution) forces the same."""
    followed = {}
    for source in sources:
        engine = engines.get(source)  # a source the run has no engine description of: none
        described = present(EngineEntry.of(engine).routing) if engine is not None else None
        routed_from = present(described.followed) if described is not None else None
        if routed_from is not None and routing.get(routed_from) is not None:
            followed[source] = routing[routed_from]
    return followed


def _forced(source: str, spec: EngineSpec, routing: dict[str, list[StreamRouting]],
            routing_from: str | None) -> list[StreamRouting] | None:
    """The routing a routing=replay source must follow (one per request, plan order), else None."""
    if spec.options.get("routing") != "replay":
        return None
    forced = routing.get(routing_from) if routing_from is not None else None
    if forced is None:
        raise SpecError(f"--{source} {spec.text}: routing=replay follows the experts --{routing_from} "
                        f"routed, and --{routing_from} recorded none (a torch engine on an MoE model "
                        "records them)")
    return forced


def _with_replay_facts(described: dict[str, Any], routed_from: str | None,
                       processing: Sampling | None) -> dict[str, Any]:
    """summary.json's description of a source: the routing it followed, the processing it applied."""
    if routed_from is not None and "routing" in described:
        described = {**described, "routing": {**described["routing"], "from": routed_from}}
    if processing is not None:
        described = {**described, "processed": {"temperature": processing.temperature,
                                                "top_k": processing.top_k, "top_p": processing.top_p}}
    return described


def _replay_order(specs: dict[str, EngineSpec], routing_from: str | None) -> list[tuple[str, EngineSpec]]:
    """The order the sources replay in. Engines whose load can fail for reasons no check sees first
    (vLLM, a server, a user's code; a torch engine's checkpoint was checked already), so such a
    failure costs no other engine's replay; one engine is loaded at a time, so models that do not
    fit together still run. The source a routing=replay engine follows goes first of all (its experts
    must exist before they can be forced)."""
    ordered = sorted(specs.items(), key=lambda item: item[1].kind in TORCH_KINDS)  # stable
    replaying = [source for source, spec in specs.items() if spec.options.get("routing") == "replay"]
    if not replaying or routing_from == "sampler":  # the stored routing needs no replay first
        return ordered
    # Here the rollouts store no routed_experts (R3 in training forces those): said in the refusal.
    if routing_from is None or routing_from not in specs or routing_from in replaying:
        raise SpecError(f"--{replaying[0]} {specs[replaying[0]].text}: routing=replay follows the rollouts' "
                        "routed_experts, and they store none; then it needs another engine of this command "
                        "to follow (audit: --infer; diff: --reference)")
    if not engine_capabilities(specs[routing_from]).records_routing:
        raise SpecError(f"--{replaying[0]} {specs[replaying[0]].text}: routing=replay follows the rollouts' "
                        f"routed_experts, and they store none; then it follows --{routing_from}, which must be "
                        "an engine that records the experts it routes (the torch engines hf, hf-decode do); "
                        f"it is {specs[routing_from].text!r}")
    return [(routing_from, specs[routing_from]), *((r, s) for r, s in ordered if r != routing_from)]


@dataclass(kw_only=True, slots=True, frozen=True)
class _Column:
    name: str                   # the work dir's name of the column: the source, or SOURCE_processed
    label: str                  # how errors and the progress bar name it
    processing: Sampling | None


class SourcePass:
    """One engine source's log-prob column (and with `processing`, its processed column too, in the
    same load), replayed block by block into the saved columns. The engine loads only when a block
    is left to replay; with `forced` (one routing per request, plan order) it follows those experts."""

    def __init__(self, source: str, spec: EngineSpec, *, checkpoint: str, progress: ProgressFactory | None,
                 columns: SavedColumns, processing: Sampling | None = None,
                 forced: list[StreamRouting] | None = None) -> None:
        self.source, self.spec, self.checkpoint, self.progress = source, spec, checkpoint, progress
        self.columns, self.forced = columns, forced
        self.targets = [_Column(name=source, label=f"--{source} {spec.text}", processing=None)]
        if processing is not None:
            self.targets.append(_Column(name=f"{source}_processed", processing=processing,
                                        label=f"--{source} {spec.text} (processed like the sampler's)"))
        self.engine: Engine | None = None
        self.callback: ProgressFn | None = None
        self.routed: list[StreamRouting] = []
        self.counts: Counts = {}   # the engine's counters summed over every column and block, resumed or not
        self._last: Counts = {}    # its counters when last read (after its load, then after each column)
        self.num_resumed = 0       # blocks of the source's own column taken from the work dir

    def replay_blocks(self, blocks: Iterator[tuple[int, ReplayPlan]],
            totals: tuple[int, int]) -> tuple[dict[str, Any], list[StreamRouting] | None]:
        """Every block replayed (or resumed); returns the engine's description and each request's
        MoE routing when it records it (else None). `totals`: (tokens fed, tokens scored) of the
        run, for the progress bar."""
        num_requests = num_blocks = 0
        try:
            for block, plan in blocks:
                self._block(block, plan, num_requests, totals)
                num_requests += len(plan.requests)
                num_blocks += 1
            described = self._described()
        finally:
            if self.engine is not None:
                self.engine.close()
        described = {**with_counts(described, self.counts), "resumed_blocks": self.num_resumed}
        if self.num_resumed and self.progress is not None:  # a rerun says what it did not redo
            self.progress(f"--{self.source} {self.spec.text}: resumed {self.num_resumed} of {num_blocks} blocks "
                          "from the interrupted run", 0)
        return described, (self.routed if len(self.routed) == num_requests and self.routed else None)

    def _block(self, block: int, plan: ReplayPlan, first_request: int, totals: tuple[int, int]) -> None:
        """One block's columns: resumed from the work dir where saved, else replayed and checked.
        `first_request`: the block's first request in the plan."""
        work = self.columns.work
        done = [self.columns.resumed(column.name, block, plan.table) for column in self.targets]
        block_routing = work.load_routing(self.source, block) if work is not None else None
        if any(values is None for values in done) and self.engine is None:  # not at all if every block is done
            self._load()
        if block_routing is None and self._records_routing():
            done = [None for _ in done]  # the routing of this block is wanted too: replay it
        # The bar starts once the engine loaded: a checkpoint that fails prints only its error.
        if self.callback is None and self.progress is not None:
            fed, scored = totals
            # What the engine will feed: a branch's context is fed again with each branch.
            self.callback = self.progress(f"replay {self.source}: {self.spec.text} (feeds "
                                          f"{_count(fed * len(self.targets))} tokens)", scored * len(self.targets))
        forced = self._forced_experts(first_request, len(plan.requests))
        for k, (column, saved) in enumerate(zip(self.targets, done)):
            if saved is not None:
                self._add(saved[1])
                self.num_resumed += k == 0
                if self.callback is not None:
                    self.callback(plan.num_scored)
                continue
            values = replay_column(plan.requests, self.engine, progress=self.callback, name=column.label,
                                   forced_experts=forced, processing=column.processing)
            counts = self._counted()
            if k == 0 and self._records_routing():
                block_routing = recorded_routing(self.engine)
            check_column(values, plan.table, column.label)
            if k == 0:  # before the log-probs too: a block whose log-probs were saved has its entropies
                self._keep_entropy(block, plan, counts)
            # The routing before the log-probs: a block whose log-probs were saved always has its routing too.
            if work is not None and k == 0 and block_routing is not None and self._records_routing():
                work.save_routing(self.source, block, block_routing)
            self.columns.keep(column.name, block, values, counts)
        if block_routing is not None:
            self.routed += block_routing

    def _load(self) -> None:
        starting = (self.progress(f"starting {self.source}: {self.spec.text}", None)
                    if self.progress is not None else None)
        self.engine = load_engine(self.spec, self.checkpoint)
        if starting is not None:
            starting(0)
        described = self.engine.describe()
        self._last = engine_counts(described)
        if self.columns.work is not None:
            self.columns.work.check_engine(self.source, engine_facts(described))

    def _counted(self) -> Counts:
        """The engine's counters of the column it just replayed (their growth since last read),
        added to the run's and saved beside the column."""
        assert self.engine is not None
        now = engine_counts(self.engine.describe())
        counts = {key: value - self._last.get(key, 0) for key, value in now.items()}
        self._last = now
        self._add(counts)
        return counts

    def _add(self, counts: Counts) -> None:
        for key, value in counts.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.counts[key] = self.counts.get(key, 0) + value

    def _keep_entropy(self, block: int, plan: ReplayPlan, counts: Counts) -> None:
        """The entropies the engine recorded in the replay of the source's own column, checked at the
        boundary as its log-probs are, kept as the column SOURCE_entropy (when it records them)."""
        assert self.engine is not None
        entropy = recorded_entropy(self.engine)
        if entropy is None:
            return
        values = np.concatenate(entropy).astype(np.float64) if entropy else np.empty(0)
        damage = entropy_damage(values, plan.table)
        if damage is not None:
            raise EngineError(f"--{self.source} {self.spec.text}: recorded {damage}")
        self.columns.keep(self.source + ENTROPY_SUFFIX, block, values, counts)

    def _records_routing(self) -> bool:
        return self.engine is not None and recorded_routing(self.engine) is not None

    def _forced_experts(self, first_request: int, num_requests: int) -> list[np.ndarray] | None:
        if self.forced is None or self.engine is None:
            return None
        return [self.forced[i].experts for i in range(first_request, first_request + num_requests)]

    def _described(self) -> dict[str, Any]:
        work = self.columns.work
        if self.engine is not None:
            described = self.engine.describe()
            if work is not None:
                work.save_described(self.source, described)
            return described
        # Every block was done: the engine as the run that replayed them described it.
        return (work.load_described(self.source) if work is not None else None) or {
            "spec": self.spec.text, "resumed": True}


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)
