"""What a framework module is (the `Framework` protocol) and the types it shares with advise/: the
release read, the snippet's target, a recommendation to render and a metric the framework logs.

advise/ chooses and words the recommendations; a framework module only turns them into its own
keys (`render`) and says which of its settings compute a simulated correction (`express`). The
registry (registry.py) holds one tuple of modules that satisfy this protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mismatch.frameworks.pair_arrays import PairArrays


@dataclass(frozen=True, slots=True)
class Release:
    """A release of a framework that mismatch has read: its version (or commit, where the framework
    publishes none) and where its facts were read."""

    version: str
    read_from: str  # e.g. "verl 0.9.1 wheel (PyPI)", "slime @ 3f2a... (GitHub, read 2026-12-02)"


@dataclass(frozen=True, slots=True)
class Target:
    """What a snippet and the framework-named metrics are for: a framework, the release whose keys
    are used, the correction settings the user runs (the framework's own names), and a note when
    the release is not the one asked for."""

    framework: str
    release: Release
    settings: dict[str, Any] = field(default_factory=dict)
    asked: str | None = None  # the version asked for or found installed
    note: str = ""            # why `release` differs from `asked`

    @property
    def label(self) -> str:
        version = self.release.version
        return f"{self.framework} {version[:12] if len(version) == 40 else version}"  # a commit: its short form


# The recommendation kinds (advise/recommend.py makes them) and what each costs to run: the other half
# of choosing a fix. `render` reads correction, recompute_old_logprobs, routing_replay, fp16 and
# batch_invariant; the other kinds are fixes outside any trainer config.
COSTS = {
    "no_correction": "none",
    "fix_alignment": "an exporter fix; nothing at run time",
    "fix_renderer": "a harness or chat-template fix; nothing at run time",
    "correction": "a few element-wise operations per token in the loss; no extra pass",
    "recompute_old_logprobs": "one extra forward pass (no backward) over every token of each batch",
    "fp16": "loss scaling in the trainer, and weights within float16's range; memory as bf16",
    "batch_invariant": "inference throughput (reported 10-60% for bitwise modes)",
    "raw_logprobs": "none: an engine setting",
    "match_temperature": "none: a config value",
    "replay_kept_set": "the engine returns each token's kept ids (vLLM --return-sampling-mask); the trainer "
                       "renormalizes over them: no extra pass. Untruncated training rollouts: none",
    "fix_weight_sync": "a fix to the weight sync or the checkpoint; nothing at run time",
    "match_sampler_config": "one more audit, with the sampler's config as --infer",
    "inspect_turn": "reading the named rollouts at that turn (mismatch report)",
    "inspect_token_rows": "reading the named token's rows and logit processing on both sides; nothing at run time",
    "index_replay": "the engine returns each token's DSA indexer top-k (layers x k key positions per token); the "
                    "trainer forces them: no extra pass",
    "align_linear_attention": "an engine setting (the recurrent state's dtype); memory for a float32 state",
    "routing_replay": "the engine returns each token's experts (layers x top-k ids per token); the trainer "
                      "forces them: no extra pass",
}


@dataclass(kw_only=True, slots=True, frozen=True)
class Recommendation:
    """One item of summary.json["recommendations"] (contract: kind, params, why; plus its cost). A
    correction's params hold its simulated `mode` and that mode's own parameters."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    why: str
    cost: str = ""

    def __post_init__(self) -> None:
        if not self.cost:  # what the fix costs to run: the other half of choosing it
            object.__setattr__(self, "cost", COSTS.get(self.kind, ""))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": dict(self.params), "why": self.why, "cost": self.cost}


# How a metric's values from every chunk of the table combine (frameworks/metrics.py): mean, max,
# min, median, std (sample, ddof 1), ess ((sum w)^2 / (n sum w^2)), ess_eps (the same with 1e-8
# added to the mean weight, as verl normalizes), pearson (of two rows).
REDUCTIONS = ("mean", "max", "min", "median", "std", "ess", "ess_eps", "pearson")


@dataclass(frozen=True, slots=True)
class FrameworkMetric:
    """A framework's logged metric: its values on one chunk of whole rollouts (per token, per
    sequence or per rollout: neither a sequence nor a rollout is ever cut), then one reduction over
    all of them, plus `offset` (a chi-square is a mean minus 1)."""

    framework: str
    key: str
    values: Callable[[PairArrays], np.ndarray]
    reduce: str = "mean"
    offset: float = 0.0
    ours: str | None = None  # our pair metric that is the same number
    note: str = ""           # how it differs from ours, when it does

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"{self.framework} {self.key}: reduce {self.reduce!r} is not one of {REDUCTIONS}")


class Framework(Protocol):
    """What every module of mismatch/frameworks/ provides (README.md beside this file); a module
    satisfies it with module-level names (tests/test_frameworks.py checks each registered one)."""

    NAME: str                                  # what --for takes: "verl"
    PACKAGE: str | None                        # its package on the index (the installed version), None if none
    RELEASES: tuple[Release, ...]              # the releases (or commits) read, oldest first
    SETTINGS: Mapping[str, Callable[[str], Any]]  # the correction settings --for NAME:KEY=VALUE takes, parsed
    DEFAULTS: Mapping[str, Any]                # those settings at the newest release's defaults

    def express(self, mode: str, params: Mapping[str, Any], release: Release) -> dict[str, Any] | None:
        """The release's own settings that compute simulated correction `mode` (advise/correction_modes.py
        MODES) with `params`, or None when the release cannot express it."""

    def render(self, by_kind: dict[str, Recommendation], target: Target) -> list[str]:
        """The snippet's lines for the target release: config keys, or comments where there is no key."""

    def metrics(self, settings: Mapping[str, Any]) -> list[FrameworkMetric]:
        """The metrics the framework logs under its own names, at those correction settings."""
