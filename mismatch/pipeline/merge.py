"""`mismatch merge`: the results dirs of N shards (`--shard I/N`) combined into one, exactly.

Shards replay disjoint blocks of rollouts with identical batching, so their token tables' blocks in
file order are the table one run would have made: they are streamed into the merged tokens.parquet
a block at a time, and every metric is recomputed from it in chunks, as the command (audit or
diff) did. Nothing of a shard is taken on trust: its inputs and the options that change numbers
must be the others', its files the ones its summary.json records (by digest), its rows only in its
own blocks, in file order, and its log-probs within the engine contract. Prefix consistency is
grouped over every shard's rows by the prefix keys each shard publishes, as one run groups them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from msgspec.structs import replace

from mismatch.analysis.clip import ClipRange
from mismatch.analysis.distribution import DistributionSummary
from mismatch.analysis.per_rollout import PerRollout
from mismatch.analysis.prefixes import PrefixConsistency, PrefixKeys
from mismatch.analysis.routing import merged_routing
from mismatch.errors import ResultsError
from mismatch.pipeline import stages
from mismatch.pipeline.audit import ReplayFindings, analyze_audit, audit_pairs, audit_summary
from mismatch.pipeline.diff import DIFF_PAIRS, analyze_diff
from mismatch.pipeline.options import AUDIT_DISTRIBUTION_PAIRS, DIFF_DISTRIBUTION_PAIRS
from mismatch.pipeline.summary import Provenance
from mismatch.results.section_records import Drift, NumberOptions, RunInputs
from mismatch.results.summary_model import UNSET, Summary, present
from mismatch.replay import bad_logprob_rows
from mismatch.rollouts.declared_checkpoint import merged_declared
from mismatch.replay.distribution import parse_distribution, table_columns
from mismatch.results import (
    PREFIX_KEYS_FILE,
    ROLLOUTS_FILE,
    TOKENS_FILE,
    TokenStore,
    check_out_dir,
    check_published_files,
    read_summary,
    results_lock,
    staged_tokens,
    tokens_chunks,
)
from mismatch.workers import analysis_workers


def merge(dirs: Sequence[str | Path], out: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Check the shards belong together and cover every block once; write the merged results dir."""
    out_dir = Path(out)
    analysis_workers(0)  # a bad MISMATCH_WORKERS is refused before any work
    with results_lock(out_dir):
        # plain data, as audit's `.summary` gives it: the library's callers read summary.json's JSON
        return _merge([Path(d) for d in dirs], out_dir, force=force).to_dict()


def _merge(paths: list[Path], out_dir: Path, *, force: bool) -> Summary:
    check_out_dir(out_dir, force=force)
    summaries = [read_summary(path) for path in paths]
    first, inputs = _check_compatible(paths, summaries)
    shards = [_Shard(path, summary) for path, summary in zip(paths, summaries)]
    _check_same_columns(shards)
    provenance = Provenance(
        command=first.command, checkpoint=first.checkpoint, rollouts_file=first.rollouts_file,
        engines={source: _merged_engine([s.engines[source] for s in summaries]) for source in first.engines},
        shard={"index": 0, "count": 1, "block_size": shards[0].block_size,
               "merged_from": [str(path) for path in paths]},
        inputs=first.inputs)
    options = inputs.options
    with staged_tokens(out_dir, force=force) as store:
        keys = PrefixKeys(store.side_file(stages.PREFIX_KEYS_SIDE)) if all(s.has_keys for s in shards) else None
        order = _store_merged(shards, store, keys)
        workers = analysis_workers(store.num_rows)
        distribution = _merged_distribution(first.command, options, summaries, store.columns)
        if first.command != "audit":
            per_rollout = PerRollout(DIFF_PAIRS)
            digestion = stages.report_digestion(store, DIFF_PAIRS, command="diff")
            summary = analyze_diff(store.chunks, provenance, seed=present(options.seed) or 0,
                                   extra=[per_rollout, digestion], workers=workers, distribution=distribution)
            return stages.write_results_files(store, summary, per_rollout.result(), digestion)
        pairs = audit_pairs(store.columns)
        per_rollout, digestion = PerRollout(pairs), stages.report_digestion(store, pairs)
        beside = _merged_evidence(provenance, summaries, order, _merged_prefixes(store, keys, first, inputs))
        measured, findings = analyze_audit(store.chunks, beside, clip=_clip_range(first),
                                           settings=present(first.framework_settings) or None,
                                           extra=[per_rollout, digestion], workers=workers,
                                           distribution=distribution)
        declared = merged_declared([(present(s.declared_checkpoint) or None, present(s.counts.rollouts) or 0)
                                    for s in summaries])
        summary = audit_summary(provenance, measured, findings, framework=present(first.framework),
                                declared_checkpoint=declared)
        return stages.write_results_files(store, summary,
                                          stages.with_steps(per_rollout.result(), _merged_steps(shards)), digestion)


def _merged_distribution(command: str, options: NumberOptions, summaries: list[Summary],
                         columns: Sequence[str]) -> DistributionSummary | None:
    """--distribution's summary rebuilt from the merged table's `dist_A_B_*` columns, as one run's
    analysis builds it; each pair's account (K, each side's view) is the shards' (one run's
    options), its seconds summed over them."""
    if present(options.distribution) is None:
        return None
    k, full = parse_distribution(str(options.distribution))
    pairs = AUDIT_DISTRIBUTION_PAIRS if command == "audit" else DIFF_DISTRIBUTION_PAIRS
    accounts: dict[str, dict[str, Any]] = {}
    for a, b in pairs:
        if not set(table_columns(a, b)) <= set(columns):
            raise ResultsError(f"the shards ran --distribution {options.distribution} but their token tables "
                               f"have no {a}/{b} distribution columns; rerun the shards")
        found = [gaps[f"{a}/{b}"] for s in summaries if f"{a}/{b}" in (gaps := present(s.distribution) or {})]
        accounts[f"{a}/{b}"] = {"k": k, "full": full, "views": present(found[0].views) if found else None,
                                "seconds": sum(present(f.seconds) or 0.0 for f in found)}
    return DistributionSummary(pairs, accounts)


def _store_merged(shards: list[_Shard], store: TokenStore, keys: PrefixKeys | None) -> dict[str, int]:
    """The shards' blocks into the merged token store (and their rows' prefix keys beside it) in
    file order; returns each rollout's index in the file (for the drift spans)."""
    order: dict[str, int] = {}
    # A block is in one shard: the merge never compares two tables.
    for _, block, block_keys in heapq.merge(*(shard.blocks() for shard in shards), key=lambda item: item[0]):
        store.write(block)
        if keys is not None:
            keys.add(block_keys)
        firsts = block.drop_duplicates("rollout")
        order.update(zip(firsts["rollout"].astype(str), firsts["rollout_index"].tolist()))
    store.close(empty=shards[0].empty_table())
    if keys is not None:
        keys.close()
    return order


def _merged_steps(shards: list[_Shard]) -> dict[str, int]:
    """Each rollout's training step as its shard's rollouts.parquet records it (checked by digest)."""
    import pyarrow.parquet as pq

    steps: dict[str, int] = {}
    for shard in shards:
        file = shard.path / ROLLOUTS_FILE
        if "step" in pq.read_schema(file).names:
            rows = pq.read_table(file, columns=["rollout", "step"]).to_pandas().dropna().drop_duplicates("rollout")
            steps.update(zip(rows["rollout"].astype(str), rows["step"].astype(int)))
    return steps


def _check_same_columns(shards: list[_Shard]) -> None:
    """One token table's columns in every shard (a like-for-like column one shard's data called for
    and another's did not cannot be one run's)."""
    first = shards[0].empty_table().columns.tolist()
    for shard in shards[1:]:
        columns = shard.empty_table().columns.tolist()
        if columns != first:
            raise ResultsError(f"{shard.file}: its columns ({', '.join(map(str, columns))}) are not "
                               f"{shards[0].file}'s ({', '.join(map(str, first))}); shards must be one run's")


def _merged_prefixes(store: TokenStore, keys: PrefixKeys | None, first: Summary, inputs: _Inputs) -> Any:
    """Prefix consistency's query over every shard's rows (grouped beside the analysis's first pass,
    as an audit's is); a note where a shard published no prefix keys (a diff has none to merge)."""
    if first.prefix_consistency is UNSET:
        return None
    if keys is None or store.file is None:
        return {"not_merged": "a shard published no prefix keys (prefix_keys.parquet); rerun it"}
    sources = ["sampler", *inputs.engines]
    if keys.file is None or not keys.file.is_file():  # no row at all: nothing is shared
        return PrefixConsistency(store.table, np.empty(0, np.uint64), sources)
    return PrefixConsistency(store.file, keys.file, sources)


def _merged_evidence(provenance: Provenance, summaries: list[Summary], order: dict[str, int],
                     prefixes: Any) -> ReplayFindings:
    """What the shards found beside their tables, as one run's: drift and routing merged, prefix
    consistency as grouped over all of them."""
    return ReplayFindings(engines=provenance.engines, drift=_merged_drift(summaries, order),
                               routing=merged_routing([s.section("routing") for s in summaries]), prefixes=prefixes)


def _clip_range(summary: Summary) -> ClipRange:
    """The shards' clip range (one run's, as every shard had it)."""
    clip = present(summary.clip)
    return ClipRange(low=clip.eps_low, high=clip.eps_high) if clip is not None else ClipRange()


class _Shard:
    """One shard's results dir, its files checked against its summary.json first; its rows read
    back block by block and checked as they come: only its own blocks (block % count == index),
    in file order, every log-prob within the engine contract (a stored column may lack values)."""

    def __init__(self, path: Path, summary: Summary) -> None:
        self.path, self.file = path, path / TOKENS_FILE
        shard = present(summary.shard)
        assert shard is not None  # _check_compatible refused a summary without one
        self.index, self.count, self.block_size = shard.index, shard.count, shard.block_size
        files = present(shard.files)
        check_published_files(path, files)
        files = files or {}
        recorded, counted = files[TOKENS_FILE].rows, present(summary.counts.tokens)
        if recorded != counted:
            raise ResultsError(f"{self.file}: {recorded} rows recorded, but {path}/summary.json counts "
                               f"{counted} tokens; rerun the shard")
        self.stored = {f"logp_{source}" for source in summary.engines if summary.engine(source).kind == "stored"}
        self.keys_file = path / PREFIX_KEYS_FILE if PREFIX_KEYS_FILE in files else None
        if self.keys_file is not None and files[PREFIX_KEYS_FILE].rows != counted:
            raise ResultsError(f"{self.keys_file}: not one prefix key per token row of {self.file}; rerun the shard")
        self.has_keys = self.keys_file is not None or not counted

    def empty_table(self) -> pd.DataFrame:
        """The shard's token table without its rows (the columns of an empty merge)."""
        import pyarrow.parquet as pq

        return self._reading(lambda: pq.read_schema(self.file).empty_table().to_pandas())

    def _reading(self, read: Any) -> Any:
        """`read()`, a Parquet file that cannot be read being one line naming the shard's file."""
        import pyarrow as pa

        try:
            return read()
        except (pa.ArrowException, OSError) as error:
            raise ResultsError(f"{self.file}: not a readable token table ({' '.join(str(error).split())[:200]}); "
                               "rerun the shard") from None

    def blocks(self) -> Iterator[tuple[int, pd.DataFrame, np.ndarray | None]]:
        """(block, its rows, their prefix keys) in file order, a chunk of the file at a time."""
        source = tokens_chunks([self.file])
        keys = _KeyRows(self.keys_file) if self.keys_file is not None else None
        last = -1
        for number in range(self._reading(source.count)):
            chunk = self._reading(lambda: source.read(number))
            if not len(chunk):  # an empty shard's file
                continue
            block = self._owned_blocks(chunk, last)
            self._check_logprobs(chunk)
            chunk_keys = self._reading(lambda: keys.take(len(chunk))) if keys is not None else None
            last = int(block[-1])
            edges = np.flatnonzero(np.r_[True, block[1:] != block[:-1], True])
            for lo, hi in itertools.pairwise(edges.tolist()):
                yield (int(block[lo]), chunk.iloc[lo:hi].reset_index(drop=True),
                       chunk_keys[lo:hi] if chunk_keys is not None else None)

    def _owned_blocks(self, chunk: pd.DataFrame, last: int) -> np.ndarray:
        """Each row's block, refused unless every one is this shard's and they only go forward (a
        copied or reordered file, even with a summary made to match it)."""
        if "rollout_index" not in chunk.columns:
            raise ResultsError(f"{self.file}: no rollout_index column: not a token table; rerun the shard")
        block = chunk["rollout_index"].to_numpy() // self.block_size
        foreign = np.flatnonzero(block % self.count != self.index)
        if len(foreign):
            other = int(block[foreign[0]])
            raise ResultsError(f"{self.file}: holds rows of block {other}, which is shard {other % self.count}'s "
                               f"of {self.count} (shard {self.index} holds blocks "
                               f"{', '.join(str(self.index + k * self.count) for k in range(3))}, ...); rerun the shard")
        if block[0] < last or np.any(np.diff(block) < 0):
            raise ResultsError(f"{self.file}: its blocks are not in file order; rerun the shard")
        return block

    def _check_logprobs(self, chunk: pd.DataFrame) -> None:
        """The engine-output boundary again (replay.checks): a shard's file may have been written
        by something else than its run."""
        pos = chunk["pos"].to_numpy()
        for name in (str(c) for c in chunk.columns if str(c).startswith("logp_")):
            values = chunk[name].to_numpy(np.float64)
            # A stored column lacks values where the rollouts stored none: only its signs are the contract's.
            bad = bad_logprob_rows(values, np.zeros_like(pos) if name in self.stored else pos)
            if len(bad):
                row = chunk.iloc[int(bad[0])]
                raise ResultsError(f"{self.file}: {name}: log-prob {float(values[bad[0]])!r} for token "
                                   f"{int(row['token_id'])} at rollout {str(row['rollout'])!r} branch "
                                   f"{str(row['branch'])!r} position {int(row['pos'])} ({len(bad)} such "
                                   f"value{'s' if len(bad) > 1 else ''}; a log-prob is <= 0); rerun the shard")


class _KeyRows:
    """A shard's prefix keys (prefix_keys.parquet, row for row with its tokens.parquet), taken in
    order a chunk's worth at a time: never the file whole."""

    def __init__(self, file: Path) -> None:
        import pyarrow.parquet as pq

        self.file = file
        self._batches = pq.ParquetFile(file).iter_batches(columns=["key"])
        self._pending = np.empty(0, np.uint64)

    def take(self, rows: int) -> np.ndarray:
        parts, have = [self._pending], len(self._pending)
        while have < rows:
            batch = next(self._batches, None)
            if batch is None:
                raise ResultsError(f"{self.file}: fewer prefix keys than token rows; rerun the shard")
            values = batch.column(0).to_numpy(zero_copy_only=False).astype(np.uint64, copy=False)
            parts.append(values)
            have += len(values)
        values = np.concatenate(parts)
        self._pending = values[rows:]
        return values[:rows]


def _merged_engine(described: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine as one run would describe it: the first shard's facts, its counters summed over
    the shards (every shard loaded the same config), and each shard's own description kept."""
    merged = dict(described[0])
    for key, value in described[0].items():
        if (key.startswith("num_") or key in ("seconds", "resumed_blocks")) and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            merged[key] = sum(d.get(key) or 0 for d in described)
    if "padding_frac" in merged and "num_tokens_padded" in merged:
        slots = merged["num_tokens_fed"] + merged["num_tokens_padded"]
        merged["padding_frac"] = merged["num_tokens_padded"] / max(slots, 1)
    if "tokens_per_s" in merged:
        seconds, scored = merged.get("seconds"), merged.get("num_tokens_scored")
        merged["tokens_per_s"] = scored / seconds if seconds and scored is not None else None
    merged["shards"] = described
    return merged


def _merged_drift(summaries: list[Summary], order: dict[str, int]) -> Drift | None:
    """The shards' drift findings as one run's: counters summed, spans back in file order. A shard
    without any `messages` has no drift block; its rollouts count as without messages."""
    if all(s.drift is UNSET for s in summaries):
        return None
    blocks = [s.drift if s.drift else Drift(num_rollouts_without_messages=present(s.counts.rollouts) or 0)
              for s in summaries]
    merged = stages.merge_drift(blocks)
    return replace(merged, spans=sorted(present(merged.spans) or [],  # stable: a rollout's own order kept
                                        key=lambda span: order.get(str(span.rollout), -1)))


# The options that change numbers (stages.NUMBER_OPTIONS, summary.json inputs.options), as a user
# names them.
_OPTION_NAMES = {"clip_eps_low": "clip eps_low (--clip-eps)", "clip_eps_high": "clip eps_high (--clip-eps)",
                 "seed": "bootstrap seed", "probe": "--probe"}

_DIFFERS = {"command": "its command differs", "rollouts": "its rollouts file's content differs",
            "checkpoint": "its checkpoint files differ", "engines": "its engine options differ",
            "block_size": "its block size differs", "mismatch_version": "its mismatch version differs"}


@dataclass(kw_only=True, slots=True, frozen=True)
class _Inputs:
    """What a merge reads of the shards' common `inputs` identity."""

    identity: RunInputs  # summary.json `inputs` (identity.run_inputs), the same in every shard

    @property
    def options(self) -> NumberOptions:
        return self.identity.options or NumberOptions()

    @property
    def engines(self) -> dict[str, Any]:
        return self.identity.engines or {}


def _check_compatible(paths: list[Path], summaries: list[Summary]) -> tuple[Summary, _Inputs]:
    """Shards of one run: the same inputs by content (rollouts digest, checkpoint files, each
    engine's parsed options) and each shard index exactly once. The first shard's summary and the
    inputs they share."""
    first, shards = summaries[0], [present(summary.shard) for summary in summaries]
    for path, summary, shard in zip(paths, summaries, shards):
        if shard is None:
            raise ResultsError(f"{path}: not a sharded run (no shard info in summary.json)")
        if not present(summary.inputs):
            raise ResultsError(f"{path}: summary.json has no `inputs` identity (written by an older "
                               "mismatch); rerun the shard to merge it")
    inputs = [_Inputs(identity=summary.inputs) for summary in summaries]
    for path, found in zip(paths, inputs):
        for key in ("command", "rollouts", "checkpoint", "engines", "block_size", "mismatch_version"):
            if getattr(found.identity, key) != getattr(inputs[0].identity, key):  # RunInputs' fields, by name
                raise ResultsError(f"{path}: {_DIFFERS[key]} from {paths[0]}'s; shards must come "
                                   "from one run's inputs")
        _check_same_options(path, found.options, paths[0], inputs[0].options)
    count = shards[0].count
    indices = sorted(shard.index for shard in shards)
    if any(shard.count != count for shard in shards) or indices != list(range(count)):
        raise ResultsError(f"shards {indices} of {count}: need each of 0..{count - 1} exactly once")
    return first, inputs[0]


def _check_same_options(path: Path, options: NumberOptions, first_path: Path, first: NumberOptions) -> None:
    """The options that change a number, the same in every shard: a merge recomputes the numbers
    once, under one set of them."""
    for name in sorted(NumberOptions.__struct_fields__):
        mine, theirs = present(getattr(options, name)), present(getattr(first, name))
        if mine != theirs:
            raise ResultsError(f"{path}: its {_OPTION_NAMES.get(name, name)} differs ({mine}, not "
                               f"{theirs} as in {first_path}); shards must be run with the same options")
