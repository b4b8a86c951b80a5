"""What a replay checks, before any engine loads (stored names, context lengths, attention paths,
routing) and after each engine answers (the engine-output boundary: `check_column`).

Every check here raises its one-line error (SpecError, RolloutError, EngineError) with the
spec, file, rollout or position it is about, so the CLI's single boundary can print it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd

from mismatch.checkpoint import CheckpointInfo, checkpoint_info, resolve_attn
from mismatch.engines import MODEL_KINDS, TORCH_KINDS, EngineSpec, engine_capabilities
from mismatch.engines.contract import ProgressFn, replay_asking
from mismatch.errors import CheckpointError, EngineError, RolloutError, SpecError
from mismatch.replay.blocks import FileBlocks, FileScan
from mismatch.rollouts import full_routed_experts
from mismatch.streams import ReplayRequest, Sampling, StreamRouting


def replay_column(requests: Sequence[ReplayRequest], engine: Any, *, progress: ProgressFn | None = None,
                  name: str = "engine", forced_experts: Sequence[np.ndarray] | None = None,
                  processing: Sampling | None = None) -> np.ndarray:
    """One engine's log-probs for these requests' rows (float64), checked at the boundary.

    Every engine kind answers the same contract: one log-prob per requested token, each a number
    <= 0 (-inf allowed: probability 0, as processed log-probs under top-k give), NaN only where
    the request has no context to score from (position 0). Anything else is refused with the
    request and position (`check_column` names the rollout), never dropped or kept silently.
    `forced_experts` and `processing` are asked only of an engine that declares them.
    """
    results = replay_asking(engine, requests, progress=progress, forced_experts=forced_experts,
                            processing=processing)
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
    if len(bad):
        raise EngineError(f"{name}: {_first_bad(values, table, bad, offset)} ({_num_bad(bad)}; an engine must "
                          "return one log-prob <= 0 per requested token)")


# An entropy a little under 0 is fp32 rounding of a near-certain distribution; past this, a bug.
ENTROPY_ROUNDING = 1e-3
ENTROPY_SUFFIX = "_entropy"  # the saved column of a source's entropies: "train_entropy"


def bad_entropy_rows(values: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rows whose entropy no distribution has: NaN with context before it, ±inf, or below 0."""
    with np.errstate(invalid="ignore"):
        bad = (np.isnan(values) & (pos > 0)) | np.isinf(values) | (values < -ENTROPY_ROUNDING)
    return np.flatnonzero(bad)


def entropy_damage(values: np.ndarray, table: pd.DataFrame) -> str | None:
    """column_damage for a column of entropies (one per row, nats, ≥ 0)."""
    if len(values) != len(table):
        return f"{len(values)} entropies for the block's {len(table)} rows"
    bad = bad_entropy_rows(values, table["pos"].to_numpy())
    return f"entropy {float(values[bad[0]])!r} at row {int(bad[0])} ({_num_bad(bad)})" if len(bad) else None


def column_damage(values: np.ndarray, table: pd.DataFrame) -> str | None:
    """What makes a saved column unfit to fill these rows, as check_column and the plan see it (its
    length, a value no engine may return), or None: the check of every column a run publishes,
    wherever it came from (this run's replay, or a work dir an earlier run left)."""
    if len(values) != len(table):
        return f"{len(values)} log-probs for the block's {len(table)} rows"
    bad = bad_logprob_rows(values, table["pos"].to_numpy())
    return f"{_first_bad(values, table, bad)} ({_num_bad(bad)})" if len(bad) else None


def _first_bad(values: np.ndarray, table: pd.DataFrame, bad: np.ndarray, offset: int = 0) -> str:
    first = int(bad[0])
    row = table.iloc[offset + first]
    return (f"log-prob {float(values[first])!r} for token {int(row['token_id'])} at rollout {row['rollout']!r} "
            f"branch {row['branch']!r} position {int(row['pos'])}")


def _num_bad(bad: np.ndarray) -> str:
    return f"{len(bad)} such value{'s' if len(bad) > 1 else ''}"


def check_stored_names(specs: dict[str, EngineSpec], names: set[str]) -> None:
    """A `stored:NAME` spec needs NAME in some segment of the file (names over the whole file, not
    the shard: a shard, or an empty one, must accept what one run would)."""
    for source, spec in specs.items():
        if spec.kind == "stored" and spec.options["name"] not in names:
            found = ["sampler", *sorted(names - {"sampler"})]
            raise SpecError(f"--{source} {spec.text}: no segment of the rollouts carries "
                            f"extra_logprobs[{spec.options['name']!r}] (found: {', '.join(found)})")


def check_before_replay(specs: dict[str, EngineSpec], scan: FileScan, info: CheckpointInfo, *, file: str) -> None:
    """What the specs ask of these rollouts and each spec's model (its own `checkpoint=PATH`'s, read
    from its config.json now, or the audited one), checked before any replay."""
    check_stored_names(specs, scan.names)
    models = {source: spec_info(source, spec, info) for source, spec in specs.items() if spec.kind in MODEL_KINDS}
    check_context(scan, models, info, specs, file=file)
    for source, spec in specs.items():
        model = models.get(source, info)
        if spec.kind in TORCH_KINDS:
            try:  # an attention path that would drop a model feature (soft-capping)
                resolve_attn(str(spec.options.get("attn", "auto")), model)
            except CheckpointError as exc:
                raise SpecError(f"--{source} {spec.text}: {exc}") from None
        if spec.options.get("routing") == "replay" and not engine_capabilities(spec).forced_experts:
            raise SpecError(f"--{source} {spec.text}: option routing=replay: engine {spec.kind!r} cannot follow "
                            f"another pass's experts (the torch engines {', '.join(TORCH_KINDS)} can)")
        if spec.options.get("routing") == "replay" and model.num_experts is None:
            raise SpecError(f"--{source} {spec.text}: option routing=replay: this model has no MoE router to "
                            f"replay ({model.path}/config.json names no experts)")


def spec_info(source: str, spec: EngineSpec, info: CheckpointInfo) -> CheckpointInfo:
    """The checkpoint a spec's engine runs: its `checkpoint=PATH`'s facts (config.json, no weights
    loaded), else the audited checkpoint's `info`."""
    if "checkpoint" not in spec.options:
        return info
    try:
        return checkpoint_info(str(spec.options["checkpoint"]))
    except CheckpointError as exc:
        raise SpecError(f"--{source} {spec.text}: {exc}") from None


def check_context(scan: FileScan, models: dict[str, CheckpointInfo], info: CheckpointInfo,
                  specs: dict[str, EngineSpec], *, file: str) -> None:
    """Refuse, before any replay, a stream longer than the declared context of a model an engine
    runs (`models`: each model engine's checkpoint by source; `info`, the audited one): its positions
    past that have no trained embedding, and the replay would score noise without a word."""
    length, rollout_id, branch_id = scan.longest
    for source, model in models.items():
        limit = model.max_positions
        if limit is None or length <= limit:
            continue
        context = (f"the model's context of {limit} (config.json)" if model is info else
                   f"the context of {limit} of --{source} {specs[source].text} ({model.path}/config.json)")
        too_long = sum(n > limit for n in scan.stream_lengths)  # streams that reach past it
        raise RolloutError(f"{length} tokens to replay (context included), past {context}; {too_long} "
                           f"stream{'s' if too_long != 1 else ''} in all", file=file, rollout=rollout_id,
                           field=f"branch {branch_id!r}")


def stored_routing(blocks: FileBlocks, scan: FileScan) -> list[StreamRouting] | None:
    """The sampler's routing per selected stream (its fed positions, as an engine's is kept), from
    the rollouts' routed_experts; None when the file stores none. The routing must be this model's
    ([MoE layers][top-k] as config.json builds them), checked here before any replay."""
    if scan.routing is None:
        return None
    info = blocks.info
    line, rollout_id, shape = scan.routing
    if info.moe_layers is None:
        raise RolloutError(f"routed_experts stored, but {info.path}/config.json names no experts (a dense model "
                           "routes nothing)", file=blocks.path, line=line, rollout=rollout_id)
    if tuple(shape) != (info.moe_layers, info.experts_per_token):
        raise RolloutError(f"routed_experts has {shape[0]} layers x top-{shape[1]} per token, but the model "
                           f"routes {info.moe_layers} layers x top-{info.experts_per_token} ({info.path}/config.json)",
                           file=blocks.path, line=line, rollout=rollout_id)
    return list(stored_routing_streams(blocks, shape))


def stored_routing_streams(blocks: FileBlocks, shape: tuple[int, ...]) -> Iterator[StreamRouting]:
    """Each selected stream's stored routing (rows of -1 where none was stored), in plan order."""
    for rollout, branch_id in blocks.streams():
        experts = full_routed_experts(rollout, branch_id, shape)[:-1]
        yield StreamRouting(experts=experts, margin=np.full(experts.shape[:2], np.nan, dtype=np.float32))


def check_stored_routing(specs: dict[str, EngineSpec], blocks: FileBlocks, stored: list[StreamRouting]) -> None:
    """A routing=replay engine that follows the stored routing needs a row at every position it feeds."""
    replaying = [source for source, spec in specs.items() if spec.options.get("routing") == "replay"]
    if not replaying:
        return
    streams = [(rollout.id, branch_id) for rollout, branch_id in blocks.streams()]  # plan order
    for (rollout_id, branch_id), routed in zip(streams, stored, strict=True):
        missing = np.flatnonzero(routed.experts[:, 0, 0] < 0)
        if len(missing):
            source = replaying[0]
            raise SpecError(f"--{source} {specs[source].text}: routing=replay follows the stored routed_experts, "
                            f"which have no row for rollout {rollout_id!r} branch {branch_id!r} position "
                            f"{int(missing[0])}, a position the trainer feeds ({len(missing)} such in that stream)")
