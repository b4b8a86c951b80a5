"""The engine contract: what every backend, plug-in and user engine provides, and the three
capabilities past it that a replay may ask of an engine (routing recorded, experts forced,
log-probs processed like the sampler's, entropy recorded), each declared, never probed.

Backends import the contract from here, not from the package `__init__` (which imports them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from mismatch.streams import ReplayRequest, Sampling, StreamRouting

ProgressFn = Callable[[int], None]  # called with the number of tokens just scored


@dataclass(kw_only=True, slots=True, frozen=True)
class Capabilities:
    """What an engine can do past describe/replay/close. A backend declares them as its class
    attribute `capabilities`; the replay checks the backend's before it loads one, and refuses a
    spec that asks for one its engine lacks."""

    records_routing: bool = False  # recorded_routing(): each request's MoE experts in the last replay
    forced_experts: bool = False   # replay(..., forced_experts=): follows another pass's experts (R3)
    processing: bool = False       # replay(..., processing=): log-probs under the sampler's processing
    records_entropy: bool = False  # recorded_entropy(): each scored position's entropy in the last replay
    # The whole next-token distribution (--distribution, engines/distributions.py): full_distribution:
    # scored_hidden() and full_rows(), the log-softmax over the vocabulary (torch engines);
    # top_logprobs: top_rows(), each position's top-K and the sampled token's rank (vLLM).
    full_distribution: bool = False
    top_logprobs: bool = False


BASIC = Capabilities()  # describe/replay/close only: a user's engine, an HTTP server, vLLM


class Engine(Protocol):
    """What every backend (and a user's `python:MODULE:CALLABLE` factory) provides."""

    def describe(self) -> dict[str, Any]:
        """Facts for summary.json: kind, resolved options, log-prob semantics, throughput."""

    def replay(self, requests: Sequence[ReplayRequest], *,
               progress: ProgressFn | None = None) -> list[np.ndarray]:
        """Per request, float64 log p(tokens[i] | tokens[:i]) for i in score_from..L-1 (NaN at i=0)."""

    def close(self) -> None:
        """Free the model (engines may hold GBs)."""


class CapableEngine(Engine, Protocol):
    """An engine that declares capabilities. `replay` takes the keyword of each one it declares
    (and is never passed one it does not); `recorded_routing` answers when it records routing."""

    capabilities: ClassVar[Capabilities]

    def replay(self, requests: Sequence[ReplayRequest], *, progress: ProgressFn | None = None,
               forced_experts: Sequence[np.ndarray] | None = None,
               processing: Sampling | None = None) -> list[np.ndarray]:
        """As Engine.replay. `forced_experts`: one int [fed positions, MoE layers, top-k] per
        request, the experts each position must be routed to; `processing`: the sampler's
        temperature/top-k/top-p applied to the last step (filtered-out tokens -inf)."""

    def recorded_routing(self) -> list[StreamRouting] | None:
        """Each request's MoE routing in the last replay, in request order (its fed positions);
        None when the model routes nothing (a dense model)."""

    def recorded_entropy(self) -> list[np.ndarray] | None:
        """Each request's entropy per scored token in the last replay (NaN where its log-prob is),
        in request order; None when that replay applied processing."""


class DistributionEngine(Engine, Protocol):
    """What --distribution asks of an engine that declares full_distribution or top_logprobs."""

    def scored_hidden(self, request: ReplayRequest) -> Any:
        """full_distribution: the final hidden states [N, D] that predict the request's scored
        tokens past position 0 (row j predicts token max(score_from, 1) + j)."""

    def full_rows(self, hidden_ND: Any) -> Any:
        """full_distribution: `distributions.FullRows` of those rows (fp32 log-softmax [N, V]); the
        caller passes a chunk at a time."""

    def top_rows(self, requests: Sequence[ReplayRequest], k: int) -> list[Any]:
        """top_logprobs: per request, `distributions.TopRows` of its scored tokens past position 0."""


def capabilities_of(engine: Any) -> Capabilities:
    """The capabilities a backend class or a loaded engine declares; BASIC where it declares none
    (an engine of describe/replay/close only keeps working)."""
    declared = getattr(engine, "capabilities", None)
    return declared if isinstance(declared, Capabilities) else BASIC


def recorded_routing(engine: Any) -> list[StreamRouting] | None:
    """The routing `engine` recorded in its last replay, or None (it records none, or routes none)."""
    return engine.recorded_routing() if capabilities_of(engine).records_routing else None


def recorded_entropy(engine: Any) -> list[np.ndarray] | None:
    """Per request of `engine`'s last replay, the entropy (nats) of the distribution each scored
    token was drawn from, aligned with its log-probs; None where it records none (it declares no
    such capability, or that replay applied processing, whose entropy is another distribution's)."""
    return engine.recorded_entropy() if capabilities_of(engine).records_entropy else None


def replay_asking(engine: Any, requests: Sequence[ReplayRequest], *, progress: ProgressFn | None = None,
                  forced_experts: Sequence[np.ndarray] | None = None,
                  processing: Sampling | None = None) -> list[np.ndarray]:
    """`engine.replay` with only the capability keywords asked for (an engine of the basic
    contract gets none); asking one the engine does not declare is a bug of the caller, which
    checks the capabilities before it loads the engine."""
    asked: dict[str, Any] = {}
    if forced_experts is not None:
        asked["forced_experts"] = forced_experts
    if processing is not None:
        asked["processing"] = processing
    declared = capabilities_of(engine)
    assert all(getattr(declared, name) for name in asked), f"{type(engine).__name__} lacks {sorted(asked)}"
    return engine.replay(requests, progress=progress, **asked)
