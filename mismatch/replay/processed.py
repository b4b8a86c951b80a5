"""The trainer side under the sampler's processing (temperature, top-k, top-p): the processing the
rollouts declare, and the stand-alone pass for processing found only in the data.

An audit plans the processed column with the trainer's own pass (`replay_sources`'s
`processed_source`); `replay_processed` and `recompute_processed` replay it on their own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from mismatch.checkpoint import checkpoint_info
from mismatch.engines import engine_capabilities, load_engine
from mismatch.errors import SpecError
from mismatch.replay.checks import check_column, replay_column
from mismatch.replay.plan import ReplayPlan, plan_replay
from mismatch.results.section_records import SamplerDeclaration
from mismatch.rollouts import load_rollouts
from mismatch.streams import Sampling, StreamRouting


def declared_processing(meta: dict[str, Any] | None) -> Sampling | None:
    """The Sampling the rollouts declare their log-probs were processed under, or None (raw,
    undeclared, or a processing that changes nothing)."""
    if msgspec.convert(meta or {}, SamplerDeclaration, strict=False).logprobs != "processed":
        return None
    sampling = Sampling.from_meta(meta)
    return None if sampling.is_identity else sampling


def replay_processed(plan: ReplayPlan, spec: str, checkpoint: str | os.PathLike[str],
                     sampling: Sampling, *, forced: Sequence[StreamRouting] | None = None) -> np.ndarray:
    """One column of the plan's token table: `spec`'s log-probs under `sampling`'s processing.

    `spec` must name an engine that processes its log-probs (`hf`, `hf-decode`, with any
    options), refused before it loads otherwise. An audit plans this pass with the trainer's own
    (replay_sources, when meta.sampler declares processed log-probs); this stand-alone pass serves
    rollouts whose processing is found only in the data. `forced`: under routing=replay, the
    experts the trainer's own pass followed (one per request, plan order; replay.followed_routing),
    so the two columns differ by the processing alone, as R3 forces the engine's in training.
    """
    if not engine_capabilities(spec).processing:
        raise SpecError(f"{spec}: recomputing under the sampler's temperature/top-k/top-p "
                        "needs a torch engine (hf, hf-decode)")
    engine = load_engine(spec, os.fspath(checkpoint))
    label = f"{spec} (processed)"
    try:
        # Block by block, as replay_sources does: batch composition, and so every bit, is the same.
        parts, first = [], 0
        for _, requests in plan.blocks():
            experts = [stream.experts for stream in forced[first: first + len(requests)]] if forced is not None else None
            parts.append(replay_column(requests, engine, name=label, processing=sampling, forced_experts=experts))
            first += len(requests)
        values = np.concatenate(parts) if parts else np.empty(0)
        check_column(values, plan.table, label)
        return values
    finally:
        engine.close()


def recompute_processed(checkpoint: str | os.PathLike[str], rollouts: str | os.PathLike[str], *,
                        spec: str = "hf", sampling: Sampling | None = None) -> np.ndarray:
    """The trainer side recomputed like the sampler's stored log-probs, aligned with the token
    table `replay_sources` builds for the same file. `sampling` defaults to the first rollout's
    declared `meta.sampler` (the one `summary.engines.sampler.meta` shows)."""
    loaded = load_rollouts(rollouts, vocab_size=checkpoint_info(checkpoint).vocab_size)
    if sampling is None:
        metas = [r.meta.get("sampler") for r in loaded if isinstance(r.meta.get("sampler"), dict)]
        sampling = Sampling.from_meta(metas[0] if metas else None)
    return replay_processed(plan_replay(loaded), spec, checkpoint, sampling)
