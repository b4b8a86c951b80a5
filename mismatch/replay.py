"""From rollouts to replay requests and the token table they fill.

Each branch becomes one request (its context, then its own tokens); the token table has one row
per own token, in request order, so an engine's concatenated results drop straight into a column.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from mismatch.checkpoint import checkpoint_info, resolve_attn
from mismatch.engines import (
    Engine,
    EngineSpec,
    ProgressFn,
    ReplayRequest,
    check_spec,
    load_engine,
)
from mismatch.streams import StreamRouting
from mismatch.errors import (
    CheckpointError,
    EngineError,
    MismatchError,
    RolloutError,
    SpecError,
)
from mismatch.results import WorkDir
from mismatch.rollouts import (
    Rollout,
    Segment,
    context_tokens,
    full_routed_experts,
    iter_rollouts,
    routing_shape,
)
from mismatch.rollouts.forked import forked_blocks
from mismatch.rollouts.trees import add_tree_weights

TABLE_KEYS = ("rollout_index", "rollout", "branch", "branch_kind", "turn", "segment", "pos", "role",
              "token_id", "trainable")
# Rollouts per unit of work. Engines see one block at a time, so batch composition (and with it
# every bit of a batch-variant kernel's output) is the same whether a run is whole, sharded or resumed.
DEFAULT_BLOCK = 64


@dataclass(kw_only=True, slots=True, frozen=True)
class ReplayPlan:
    requests: list[ReplayRequest]
    request_block: np.ndarray  # int [num_requests]: the block of each request's rollout
    table: pd.DataFrame  # TABLE_KEYS + logp_sampler (replay_sources adds the weights and engine columns)
    stored: dict[str, np.ndarray]  # "sampler" and every extra_logprobs NAME, aligned with table rows

    @property
    def num_scored(self) -> int:
        return len(self.table)

    def blocks(self) -> list[tuple[int, list[ReplayRequest]]]:
        """(block id, its requests) in table order: rows of a block are contiguous."""
        grouped: dict[int, list[ReplayRequest]] = {}
        for request, block in zip(self.requests, self.request_block.tolist()):
            grouped.setdefault(block, []).append(request)
        return list(grouped.items())


@dataclass(kw_only=True, slots=True, frozen=True)
class Shard:
    """Shard `index` of `count` (0-based) takes blocks index, index+count, index+2·count, …"""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, slash, count = text.partition("/")
        if not slash or not index.strip().isdigit() or not count.strip().isdigit():
            raise MismatchError(f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
        shard = cls(index=int(index), count=int(count))
        if not 0 <= shard.index < shard.count:
            raise MismatchError(f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
        return shard

    def takes(self, block: int) -> bool:
        return block % self.count == self.index


def segment_turns(roles: Sequence[str]) -> list[int]:
    """Turn index of each segment: a model segment closes the turn of the prompts before it."""
    turns, turn = [], 0
    for role in roles:
        turns.append(turn)
        if role in ("assistant", "summary"):
            turn += 1
    return turns


def _stored_column(per_segment: list[np.ndarray | None], lengths: np.ndarray) -> np.ndarray:
    """One stored log-prob column over the segments' rows: NaN where a segment stores none (filled
    in place, not a NaN array made per segment)."""
    column = np.full(int(lengths.sum()), np.nan)
    for start, values in zip(np.cumsum(lengths) - lengths, per_segment):
        if values is not None:
            column[start:start + len(values)] = values
    return column


def plan_replay(rollouts: Sequence[Rollout], *, indices: Sequence[int] | None = None,
                block_size: int = DEFAULT_BLOCK) -> ReplayPlan:
    """Requests and table rows for `rollouts`; `indices` are their positions in the file.

    Python loops run per branch and per segment only; every per-token column is made by numpy
    from those short vectors (a dump has ~100 tokens a segment and 10^7-10^8 tokens in all).
    """
    indices = list(range(len(rollouts))) if indices is None else list(indices)
    requests: list[ReplayRequest] = []
    request_block: list[int] = []
    branch_rollout: list[int] = []    # per branch: position of its rollout in `rollouts`
    branch_ids: list[str] = []
    branch_kinds: list[str] = []
    branch_context: list[int] = []    # per branch: tokens of context before its own stream
    segment_branch: list[int] = []    # per segment: its branch
    segments: list[Segment] = []
    segment_turn: list[int] = []
    segment_index: list[int] = []     # per segment: its index in its branch
    for k, (file_index, rollout) in enumerate(zip(indices, rollouts, strict=True)):
        for branch in rollout.branches:
            context = context_tokens(rollout, branch.id)
            own = [seg.tokens for seg in branch.segments]
            # Context tokens were a prompt when this branch was sampled, whatever produced them.
            generated = np.zeros(len(context) + sum(map(len, own)), dtype=bool)
            start = len(context)
            for seg in branch.segments:
                generated[start:start + len(seg.tokens)] = seg.generated
                start += len(seg.tokens)
            requests.append(ReplayRequest(tokens=np.concatenate([context, *own]).astype(np.int64),
                                          generated=generated, score_from=len(context)))
            request_block.append(file_index // block_size)
            segment_branch.extend([len(branch_ids)] * len(own))
            segment_turn.extend(segment_turns([seg.role for seg in branch.segments]))
            segment_index.extend(range(len(own)))
            segments.extend(branch.segments)
            branch_rollout.append(k)
            branch_ids.append(branch.id)
            branch_kinds.append(branch.kind)
            branch_context.append(len(context))
    lengths = np.fromiter((len(seg.tokens) for seg in segments), dtype=np.int64, count=len(segments))
    seg_branch = np.asarray(segment_branch, dtype=np.int64)
    row_branch = np.repeat(seg_branch, lengths)
    row_rollout = np.asarray(branch_rollout, dtype=np.int64)[row_branch]
    branch_start = np.zeros(len(branch_ids) + 1, dtype=np.int64)  # first row of each branch
    np.add.at(branch_start, seg_branch + 1, lengths)
    branch_start = np.cumsum(branch_start)
    # pos: the row's offset in its request (context first), so own tokens count from the context.
    offset = np.asarray(branch_context, dtype=np.int64) - branch_start[:-1]
    pos = np.arange(int(lengths.sum()), dtype=np.int64) + offset[row_branch]
    table = pd.DataFrame({
        "rollout_index": np.asarray(indices, dtype=np.int64)[row_rollout],
        "rollout": _categorical([rollouts[k].id for k in range(len(rollouts))], row_rollout),
        "branch": _categorical(branch_ids, row_branch),
        "branch_kind": _categorical(branch_kinds, row_branch),
        "turn": np.repeat(np.asarray(segment_turn, dtype=np.int32), lengths),
        "segment": np.repeat(np.asarray(segment_index, dtype=np.int32), lengths),
        "pos": pos.astype(np.int32),
        "role": _categorical([seg.role for seg in segments], np.repeat(np.arange(len(segments)), lengths)),
        "token_id": _concat([seg.tokens for seg in segments], np.int64),
        "trainable": np.repeat(np.fromiter((seg.trainable for seg in segments), dtype=bool,
                                           count=len(segments)), lengths),
        "logp_sampler": _stored_column([seg.logprobs for seg in segments], lengths),
    })
    extra_names = sorted({name for seg in segments for name in seg.extra_logprobs})
    stored = {"sampler": table["logp_sampler"].to_numpy()}
    stored.update({name: _stored_column([seg.extra_logprobs.get(name) for seg in segments], lengths)
                   for name in extra_names})
    return ReplayPlan(requests=requests, request_block=np.asarray(request_block, dtype=np.int64),
                      table=table, stored=stored)


def _categorical(values: list[str], rows: np.ndarray) -> pd.Categorical:
    """values[rows] as a pandas categorical with sorted categories (what astype("category") gives),
    built from the short `values` list, not from a per-row array of Python strings."""
    categories, codes = np.unique(np.asarray(values, dtype=object), return_inverse=True)
    return pd.Categorical.from_codes(codes.reshape(-1)[rows], categories=pd.Index(categories.tolist()))


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype=dtype)


def replay_column(requests: Sequence[ReplayRequest], engine: Engine, *,
                  progress: ProgressFn | None = None, name: str = "engine") -> np.ndarray:
    """One engine's log-probs for these requests' rows (float64), checked at the boundary.

    Every engine kind answers the same contract: one log-prob per requested token, each a number
    <= 0 (-inf allowed: probability 0, as processed log-probs under top-k give), NaN only where
    the request has no context to score from (position 0). Anything else is refused with the
    request and position (`check_column` names the rollout), never dropped or kept silently.
    """
    results = engine.replay(requests, progress=progress)
    if len(results) != len(requests):
        raise EngineError(f"{name}: returned {len(results)} results for {len(requests)} requests")
    for index, (request, logp) in enumerate(zip(requests, results, strict=True)):
        if np.shape(logp) != (request.num_scored,):
            raise EngineError(f"{name}: request {index}: returned {np.shape(logp)} log-probs for "
                              f"{request.num_scored} requested tokens")
    return np.concatenate(results).astype(np.float64) if results else np.empty(0)


def bad_logprob_rows(values: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rows whose log-prob breaks the engine contract (replay_column): NaN with context before it,
    +inf, or a positive log-prob."""
    with np.errstate(invalid="ignore"):
        bad = (np.isnan(values) & (pos > 0)) | (values > 0)
    return np.flatnonzero(bad)


def check_column(values: np.ndarray, table: pd.DataFrame, name: str, offset: int = 0) -> None:
    """EngineError naming the rollout, branch, position and token of the first value an engine
    should never have returned (`values` fill the table's rows from `offset` on, in order)."""
    bad = bad_logprob_rows(values, table["pos"].to_numpy()[offset:offset + len(values)])
    if not len(bad):
        return
    first = int(bad[0])
    row = table.iloc[offset + first]
    raise EngineError(f"{name}: log-prob {float(values[first])!r} for token {int(row['token_id'])} at rollout "
                      f"{row['rollout']!r} branch {row['branch']!r} position {int(row['pos'])} "
                      f"({len(bad)} such value{'s' if len(bad) > 1 else ''}; an engine must return one "
                      "log-prob <= 0 per requested token)")


# (label, total tokens) -> a callback per batch of tokens done; total None: a phase without a count
# (an engine starting), whose callback is called once when it ends.
ProgressFactory = Callable[[str, int | None], ProgressFn | None]


@dataclass(kw_only=True, slots=True, frozen=True)
class Block:
    """One block of rollouts as the analysis reads it: its requests and its token table rows
    (TABLE_KEYS, logp_sampler, weight_tree/gyre, a logp_<source> column per source)."""

    index: int
    rollouts: list[Rollout]
    plan: ReplayPlan


T = TypeVar("T")
# (fn, workers) -> fn of each block in order, read and mapped by forked readers (Replayed.map_blocks)
ForkedMap = Callable[[Callable[[Block], Any], int], Iterator[Any]]


class Replayed:
    """A replay's results, block by block: `blocks()` is one pass over the selected blocks, each
    planned from the rollouts file again and filled from the engines' saved columns, so a pass holds
    one block in memory, not the run. `table`, `plan` and `rollouts` put every block together, for
    the callers that need them all at once (diff, the library, the layer localizer)."""

    def __init__(self, *, engines: dict[str, Any], routing: dict[str, list[StreamRouting]],
                 blocks: Callable[[], Iterator[Block]], forked: ForkedMap | None = None) -> None:
        self.engines = engines   # source -> describe() (the sampler's declared settings too)
        self.routing = routing   # source -> each request's MoE routing, where recorded
        self.blocks = blocks
        self._forked = forked
        self._whole: tuple[list[Rollout], ReplayPlan] | None = None

    def map_blocks(self, fn: Callable[[Block], T], workers: int = 1) -> Iterator[T]:
        """fn of each block, in order. With `workers` > 1, a replay of stored log-probs from a JSONL
        file reads, checks, plans and maps its blocks in that many forked readers (fn's results
        travel back pickled); the same results, the same first error."""
        if workers > 1 and self._forked is not None:
            yield from self._forked(fn, workers)
            return
        for block in self.blocks():
            yield fn(block)

    def _gathered(self) -> tuple[list[Rollout], ReplayPlan]:
        if self._whole is None:
            blocks = list(self.blocks())
            rollouts = [rollout for block in blocks for rollout in block.rollouts]
            plans = [block.plan for block in blocks]
            table = concat_tables([plan.table for plan in plans])
            names = {name for plan in plans for name in plan.stored}
            stored = {name: np.concatenate([plan.stored.get(name, np.full(plan.num_scored, np.nan))
                                            for plan in plans]) if plans else np.empty(0) for name in names}
            plan = ReplayPlan(requests=[request for plan in plans for request in plan.requests],
                              request_block=np.concatenate([plan.request_block for plan in plans])
                              if plans else np.empty(0, dtype=np.int64), table=table, stored=stored)
            self._whole = (rollouts, plan)
        return self._whole

    @property
    def rollouts(self) -> list[Rollout]:
        return self._gathered()[0]

    @property
    def plan(self) -> ReplayPlan:
        return self._gathered()[1]

    @property
    def table(self) -> pd.DataFrame:
        return self._gathered()[1].table


def concat_tables(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Block tables as one, categoricals kept (their categories united, sorted)."""
    if not tables:
        return pd.DataFrame()
    categorical = [name for name in tables[0].columns if isinstance(tables[0][name].dtype, pd.CategoricalDtype)]
    if len(tables) == 1:
        return tables[0]
    united = {name: sorted({value for table in tables for value in table[name].cat.categories}) for name in categorical}
    return pd.concat([table.astype({name: pd.CategoricalDtype(united[name]) for name in categorical})
                      for table in tables], ignore_index=True)


def file_blocks(rollouts: str | Path, info: Any, *, shard: Shard | None, block_size: int,
                seen: Callable[[Rollout], None] | None = None) -> Iterator[tuple[int, list[int], list[Rollout]]]:
    """(block, file indices, rollouts) of the blocks a shard takes, read and validated from the file
    as it streams: one block in memory at a time. `seen` is called with every rollout of the file,
    taken or not."""
    current, indices, selected = -1, [], []
    for index, rollout in enumerate(iter_rollouts(rollouts, vocab_size=info.vocab_size, num_experts=info.num_experts)):
        if seen is not None:
            seen(rollout)
        block = index // block_size
        if block != current and selected:
            yield current, indices, selected
            indices, selected = [], []
        current = block
        if shard is None or shard.takes(block):
            indices.append(index)
            selected.append(rollout)
    if selected:
        yield current, indices, selected


@dataclass(kw_only=True, slots=True)
class _Scan:
    """What a whole-file check needs, gathered in one pass before any engine loads."""

    names: set[str]                 # "sampler" and every extra_logprobs name in the file
    metas: list[dict[str, Any]]     # meta.sampler of the selected rollouts, where declared
    longest: tuple[int, str, str]   # (stream length, rollout, branch) of the longest stream
    stream_lengths: list[int]       # every selected stream's length (context included)
    routing: tuple[int, str, tuple[int, ...]] | None  # (line, rollout, [layers, top-k]) of the first routed_experts
    num_scored: int                 # own tokens of the selected streams: the token table's rows


def _scan(rollouts: str | Path, info: Any, *, shard: Shard | None, block_size: int) -> _Scan:
    names, metas, lengths, longest, routing, scored = {"sampler"}, [], [], (0, "", ""), None, 0
    for index, rollout in enumerate(iter_rollouts(rollouts, vocab_size=info.vocab_size,
                                                  num_experts=info.num_experts)):
        names.update(name for branch in rollout.branches for segment in branch.segments
                     for name in segment.extra_logprobs)
        shape = routing_shape(rollout) if routing is None else None
        if shape is not None:  # the file's first (the loader holds every rollout of a file to one shape)
            routing = (rollout.line, rollout.id, tuple(shape))
        if shard is not None and not shard.takes(index // block_size):
            continue
        if isinstance(rollout.meta.get("sampler"), dict):
            metas.append(rollout.meta["sampler"])
        for branch in rollout.branches:
            length = len(context_tokens(rollout, branch.id)) + branch.num_tokens
            lengths.append(length)
            scored += branch.num_tokens
            if length > longest[0]:
                longest = (length, rollout.id, branch.id)
    return _Scan(names=names, metas=metas, longest=longest, stream_lengths=lengths, routing=routing,
                 num_scored=scored)


def _sampler_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The sampler settings the rollouts declare (the first rollout's; differing ones are counted)."""
    if not metas:
        return {}
    first = metas[0]
    return {**first, "num_rollouts_differing": sum(meta != first for meta in metas)}


def replay_sources(checkpoint: str | Path, rollouts: str | Path, sources: dict[str, str], *,
                 progress: ProgressFactory | None = None, shard: Shard | None = None,
                 block_size: int = DEFAULT_BLOCK, work: WorkDir | None = None,
                 processed_source: str | None = None, routing_from: str | None = None) -> Replayed:
    """Check everything, replay each engine source block by block, and return the blocks to read.

    All input checks (checkpoint, specs, rollouts, stored names, context) come before the first
    forward. With engines to run, a first pass over the file validates it and gathers what the
    checks need; each engine then streams the file block by block. An audit of stored log-probs
    only (`stored:`) loads no engine and reads the file once, in `blocks()`, which raises at the
    end of that pass for a stored name no segment of the file carries.
    With `work`, each (source, block) result is saved as it finishes and reused on a rerun
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
    file = str(rollouts)
    engines: dict[str, Any] = {"sampler": {"kind": "stored", "spec": "sampler", "meta": {}}}
    saved: dict[tuple[str, int], np.ndarray] = {}  # (column, block) -> log-probs, without a work dir
    routing: dict[str, list[StreamRouting]] = {}
    stored_only = all(spec.kind == "stored" for spec in specs.values())
    if stored_only:
        iter_rollouts(rollouts)  # opens nothing yet, but checks the file exists and is readable: now
        for source, spec in specs.items():
            engines[source] = {"kind": "stored", "spec": spec.text, "name": spec.options["name"]}
    else:
        scan = _scan(rollouts, info, shard=shard, block_size=block_size)
        engines["sampler"]["meta"] = _sampler_meta(scan.metas)
        _check_before_replay(specs, scan, info, file=file)
        stored = stored_routing(rollouts, info, scan, shard=shard, block_size=block_size, file=file)
        if stored is not None:
            routing["sampler"] = stored
            routing_from = "sampler"
            _check_stored_routing(specs, rollouts, info, shard, block_size, stored)
        meta = engines["sampler"]["meta"]
        for source, spec in _replay_order(specs, routing_from):
            sampling = _declared_processing(meta) if source == processed_source and spec.kind in TORCH_KINDS else None
            forced = routing.get(routing_from) if spec.options.get("routing") == "replay" else None
            if spec.options.get("routing") == "replay" and forced is None:
                raise SpecError(f"--{source} {spec.text}: routing=replay follows the experts --{routing_from} "
                                f"routed, and --{routing_from} recorded none (a torch engine on an MoE model "
                                "records them)")
            if spec.kind == "stored":
                engines[source] = {"kind": "stored", "spec": spec.text, "name": spec.options["name"]}
                continue
            blocks = _planned_blocks(rollouts, info, shard, block_size)
            totals = (sum(scan.stream_lengths), scan.num_scored)
            engines[source], routed = _replay_source(source, spec, blocks, totals, str(checkpoint), progress, work,
                                                     saved, sampling, forced)
            if forced is not None and "routing" in engines[source]:
                engines[source]["routing"] = {**engines[source]["routing"], "from": routing_from}
            if routed is not None:
                routing[source] = routed
            if sampling is not None:
                engines[source] = {**engines[source], "processed": {"temperature": sampling.temperature,
                                                                "top_k": sampling.top_k, "top_p": sampling.top_p}}

    def filled(block: int, indices: list[int], selected: list[Rollout]) -> Block:
        """The block planned, with its tree weights and every source's column."""
        plan = plan_replay(selected, indices=indices, block_size=block_size)
        # Tree weights are per rollout, so shards compute exactly the weights one run would.
        table = add_tree_weights(plan.table, selected, inplace=True, planned=True)
        for source, spec in specs.items():
            if spec.kind == "stored":
                # A name no segment of this block carries is NaN on its rows.
                table[f"logp_{source}"] = plan.stored.get(spec.options["name"], np.full(plan.num_scored, np.nan))
                continue
            for column in (source, f"{source}_processed"):
                values = saved.get((column, block)) if work is None else work.load(column, block)
                if values is not None or (column == source and not selected):
                    table[f"logp_{column}"] = values if values is not None else np.empty(0)
        return Block(index=block, rollouts=selected, plan=plan)

    def finish(names: set[str], metas: list[dict[str, Any]]) -> None:
        """After the one pass of a stored-only replay: its names checked, the sampler's settings."""
        _check_stored_names(specs, names, file)
        engines["sampler"]["meta"] = _sampler_meta(metas)

    def blocks() -> Iterator[Block]:
        names: set[str] = {"sampler"}
        metas: list[dict[str, Any]] = []
        def seen(rollout: Rollout) -> None:  # names over the whole file, not the shard's blocks
            names.update(_extra_names([rollout]))

        for block, indices, selected in _or_empty(file_blocks(rollouts, info, shard=shard, block_size=block_size,
                                                              seen=seen)):
            metas.extend(_sampler_metas(selected))
            yield filled(block, indices, selected)
        if stored_only:
            finish(names, metas)

    def forked(fn: Callable[[Block], T], workers: int) -> Iterator[T]:
        def mapped(block: int, indices: list[int], selected: list[Rollout]) -> tuple[set[str], bool, list, Any]:
            taken = shard is None or shard.takes(block)  # every block is read; a shard maps its own
            return (_extra_names(selected), taken, _sampler_metas(selected) if taken else [],
                    fn(filled(block, indices, selected)) if taken else None)

        names, metas, any_taken = {"sampler"}, [], False
        for found, taken, block_metas, result in forked_blocks(rollouts, vocab_size=info.vocab_size,
                                                               num_experts=info.num_experts, block_size=block_size,
                                                               workers=workers, work=mapped):
            names |= found
            if taken:
                metas.extend(block_metas)
                any_taken = True
                yield result
        if not any_taken:  # a shard that takes no block: one empty block, every column of it
            yield fn(filled(-1, [], []))
        finish(names, metas)

    # Forked readers decode JSON Lines only, and replay no engine (an engine stays in this process).
    readable = stored_only and Path(rollouts).suffix.lower() != ".parquet"
    return Replayed(engines=engines, routing=routing, blocks=blocks, forked=forked if readable else None)


def _extra_names(rollouts: list[Rollout]) -> set[str]:
    return {name for rollout in rollouts for branch in rollout.branches for segment in branch.segments
            for name in segment.extra_logprobs}


def _sampler_metas(rollouts: list[Rollout]) -> list[dict[str, Any]]:
    return [r.meta["sampler"] for r in rollouts if isinstance(r.meta.get("sampler"), dict)]


def _or_empty(blocks: Iterator[tuple[int, list[int], list[Rollout]]]) -> Iterator[tuple[int, list[int], list[Rollout]]]:
    """The blocks, or one empty block when the shard takes none: its table has every column."""
    empty = True
    for found in blocks:
        empty = False
        yield found
    if empty:
        yield -1, [], []


def _planned_blocks(rollouts: str | Path, info: Any, shard: Shard | None,
                    block_size: int) -> Iterator[tuple[int, ReplayPlan]]:
    for block, indices, selected in file_blocks(rollouts, info, shard=shard, block_size=block_size):
        yield block, plan_replay(selected, indices=indices, block_size=block_size)


def _check_stored_names(specs: dict[str, EngineSpec], names: set[str], file: str) -> None:
    """A `stored:NAME` spec needs NAME in some segment of the file (names over the whole file, not
    the shard: a shard, or an empty one, must accept what one run would)."""
    for source, spec in specs.items():
        if spec.kind == "stored" and spec.options["name"] not in names:
            found = ["sampler", *sorted(names - {"sampler"})]
            raise SpecError(f"--{source} {spec.text}: no segment of the rollouts carries "
                            f"extra_logprobs[{spec.options['name']!r}] (found: {', '.join(found)})")


def _check_before_replay(specs: dict[str, EngineSpec], scan: _Scan, info: Any, *, file: str) -> None:
    """What the specs ask of these rollouts and this model, checked before any replay."""
    _check_stored_names(specs, scan.names, file)
    _check_context(scan, info, specs, file=file)
    for source, spec in specs.items():
        own_model = "checkpoint" not in spec.options  # another checkpoint is checked when it loads
        if spec.kind in TORCH_KINDS and own_model:
            try:  # an attention path that would drop a model feature (soft-capping)
                resolve_attn(str(spec.options.get("attn", "auto")), info)
            except CheckpointError as exc:
                raise SpecError(f"--{source} {spec.text}: {exc}") from None
        if spec.options.get("routing") == "replay" and info.num_experts is None and own_model:
            raise SpecError(f"--{source} {spec.text}: option routing=replay: this model has no MoE router to "
                            f"replay ({info.path}/config.json names no experts)")


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
    if routing_from is None or routing_from not in specs or routing_from in replaying:
        raise SpecError(f"--{replaying[0]} {specs[replaying[0]].text}: routing=replay needs another engine "
                        "of this command to follow (audit: --infer; diff: --reference)")
    if specs[routing_from].kind not in TORCH_KINDS:
        raise SpecError(f"--{replaying[0]} {specs[replaying[0]].text}: routing=replay follows "
                        f"--{routing_from}, which must be a torch engine (hf, hf-decode) to record experts; "
                        f"it is {specs[routing_from].text!r}")
    return [(routing_from, specs[routing_from]), *((r, s) for r, s in ordered if r != routing_from)]


TORCH_KINDS = ("hf", "hf-decode")  # engines whose last step can be processed (alignment.py)


def stored_routing(rollouts: str | Path, info: Any, scan: _Scan, *, shard: Shard | None, block_size: int,
                   file: str) -> list[StreamRouting] | None:
    """The sampler's routing per selected stream (its fed positions, as an engine's is kept), from
    the rollouts' routed_experts; None when the file stores none. The routing must be this model's
    ([MoE layers][top-k] as config.json builds them), checked here before any replay."""
    if scan.routing is None:
        return None
    line, rollout_id, shape = scan.routing
    if info.moe_layers is None:
        raise RolloutError(f"routed_experts stored, but {info.path}/config.json names no experts (a dense model "
                           "routes nothing)", file=file, line=line, rollout=rollout_id)
    if tuple(shape) != (info.moe_layers, info.experts_per_token):
        raise RolloutError(f"routed_experts has {shape[0]} layers x top-{shape[1]} per token, but the model "
                           f"routes {info.moe_layers} layers x top-{info.experts_per_token} ({info.path}/config.json)",
                           file=file, line=line, rollout=rollout_id)
    return list(stored_routing_streams(rollouts, info, shard=shard, block_size=block_size, shape=shape))


def stored_routing_streams(rollouts: str | Path, info: Any, *, shard: Shard | None, block_size: int,
                           shape: tuple[int, ...]) -> Iterator[StreamRouting]:
    """Each selected stream's stored routing (rows of -1 where none was stored), in plan order."""
    for _, _, selected in file_blocks(rollouts, info, shard=shard, block_size=block_size):
        for rollout in selected:
            for branch in rollout.branches:
                experts = full_routed_experts(rollout, branch.id, shape)[:-1]
                yield StreamRouting(experts=experts, margin=np.full(experts.shape[:2], np.nan, dtype=np.float32))


def _check_stored_routing(specs: dict[str, EngineSpec], rollouts: str | Path, info: Any, shard: Shard | None,
                          block_size: int, stored: list[StreamRouting]) -> None:
    """A routing=replay engine that follows the stored routing needs a row at every position it feeds."""
    replaying = [source for source, spec in specs.items() if spec.options.get("routing") == "replay"]
    if not replaying:
        return
    streams = [(rollout.id, branch.id) for _, _, selected in file_blocks(rollouts, info, shard=shard,
                                                                          block_size=block_size)
               for rollout in selected for branch in rollout.branches]  # plan order
    for (rollout_id, branch_id), routed in zip(streams, stored, strict=True):
        missing = np.flatnonzero(routed.experts[:, 0, 0] < 0)
        if len(missing):
            source = replaying[0]
            raise SpecError(f"--{source} {specs[source].text}: routing=replay follows the stored routed_experts, "
                            f"which have no row for rollout {rollout_id!r} branch {branch_id!r} position "
                            f"{int(missing[0])}, a position the trainer feeds ({len(missing)} such in that stream)")


def _declared_processing(meta: dict[str, Any]) -> Any:
    """The Sampling the rollouts declare their log-probs were processed under, or None (raw,
    undeclared, or a processing that changes nothing)."""
    from mismatch.analysis.alignment import Sampling

    if meta.get("logprobs") != "processed":
        return None
    sampling = Sampling.from_meta(meta)
    return None if sampling.is_identity else sampling


# What an engine reports about itself once loaded that its spec does not fix (the dtype "auto"
# resolved to, the model and version an HTTP server serves): a resume must find it unchanged.
ENGINE_FACTS = ("kind", "dtype", "api", "model", "server", "logprob_semantics")


def engine_facts(described: dict[str, Any]) -> dict[str, Any]:
    return {key: described[key] for key in ENGINE_FACTS if key in described}


MODEL_KINDS = ("hf", "hf-decode", "vllm")  # engines that run the checkpoint's model themselves


def _check_context(scan: _Scan, info: Any, specs: dict[str, EngineSpec], *, file: str) -> None:
    """Refuse, before any replay, a stream longer than the model's declared context: its positions
    past that have no trained embedding, and the replay would score noise without a word."""
    if info.max_positions is None or not scan.stream_lengths:
        return
    if not any(spec.kind in MODEL_KINDS and "checkpoint" not in spec.options for spec in specs.values()):
        return
    length, rollout_id, branch_id = scan.longest
    if length <= info.max_positions:
        return
    too_long = sum(n > info.max_positions for n in scan.stream_lengths)  # streams that reach past the context
    raise RolloutError(f"{length} tokens to replay (context included), past the model's "
                       f"context of {info.max_positions} (config.json); {too_long} "
                       f"stream{'s' if too_long != 1 else ''} in all", file=file, rollout=rollout_id,
                       field=f"branch {branch_id!r}")


def _replay_source(source: str, spec: EngineSpec, blocks: Iterator[tuple[int, ReplayPlan]], totals: tuple[int, int],
                   checkpoint: str, progress: ProgressFactory | None, work: WorkDir | None,
                   saved: dict[tuple[str, int], np.ndarray], processed: Any = None,
                   forced: list[StreamRouting] | None = None) -> tuple[dict[str, Any], list | None]:
    """One engine source's log-prob column (and with `processed`, a Sampling, its processed
    column too), replayed block by block into the work dir (or `saved`, without one); returns the
    engine's description and each request's MoE routing when it records it (else None).
    `totals`: (tokens fed, tokens scored) of the run, for the progress bar; `forced`: the routing
    a routing=replay engine must follow, one per request in plan order."""
    from mismatch.analysis.alignment import processed_logprobs_on

    columns = [(source, f"--{source} {spec.text}", None)]
    if processed is not None:
        columns.append((f"{source}_processed", f"--{source} {spec.text} (processed like the sampler's)", processed))
    callback: ProgressFn | None = None
    engine: Engine | None = None
    routed: list[StreamRouting] = []
    num_requests = 0
    first_request = 0  # the block's first request in the plan
    try:
        for block, plan in blocks:
            requests, num_rows = plan.requests, plan.num_scored
            num_requests += len(requests)
            done = [work.load(name, block) if work is not None else None for name, _, _ in columns]
            # Not this block's rows (the manifest matched, the file did not): replayed again.
            done = [None if d is not None and len(d) != num_rows else d for d in done]
            block_routing = work.load_routing(source, block) if work is not None else None
            if any(d is None for d in done) and engine is None:  # not at all if every block is done
                starting = progress(f"starting {source}: {spec.text}", None) if progress is not None else None
                engine = load_engine(spec, checkpoint)
                if starting is not None:
                    starting(0)
                if work is not None:
                    work.check_engine(source, engine_facts(engine.describe()))
            if block_routing is None and engine is not None and engine_records_routing(engine):
                done = [None for _ in done]  # the routing of this block is wanted too: replay it
            # The bar starts once the engine loaded: a checkpoint that fails prints only its error.
            if callback is None and progress is not None:
                fed, scored = totals
                # What the engine will feed: a branch's context is fed again with each branch.
                callback = progress(f"replay {source}: {spec.text} (feeds {_count(fed * len(columns))} tokens)",
                                    scored * len(columns))
            if forced is not None and engine is not None:
                engine.forced = [forced[i].experts for i in range(first_request, first_request + len(requests))]
            for k, (name, label, sampling) in enumerate(columns):
                if done[k] is None:
                    with processed_logprobs_on(engine, sampling) if sampling is not None else nullcontext():
                        done[k] = replay_column(requests, engine, progress=callback, name=label)
                    if k == 0 and engine_records_routing(engine):
                        block_routing = list(engine.routed)
                    check_column(done[k], plan.table, label)
                    if work is not None:
                        # The routing before the log-probs: a block whose log-probs were saved
                        # always has its routing too.
                        if k == 0 and block_routing is not None and engine_records_routing(engine):
                            work.save_routing(source, block, block_routing)
                        work.save(name, block, done[k])
                elif callback is not None:
                    callback(num_rows)
                if work is None:
                    saved[(name, block)] = done[k]
            if block_routing is not None:
                routed += block_routing
            first_request += len(requests)
        if engine is not None:
            described = engine.describe()
            if work is not None:
                work.save_described(source, described)
        else:  # every block was done: the engine as the run that replayed them described it
            described = (work.load_described(source) if work is not None else None) or {
                "spec": spec.text, "resumed": True}
    finally:
        if engine is not None:
            engine.close()
    described = {**described, "resumed_blocks": work.num_loaded(source) if work else 0}
    return described, (routed if len(routed) == num_requests and routed else None)


def engine_records_routing(engine: Any) -> bool:
    return getattr(engine, "recorder", None) is not None


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


