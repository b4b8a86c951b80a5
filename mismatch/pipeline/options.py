"""What each command of the flow is asked to do, as one frozen object handed down its stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch.analysis.clip import ClipRange
from mismatch.replay import DEFAULT_BLOCK, ProgressFactory, Shard


DEFAULT_INFER = "hf-decode"


@dataclass(kw_only=True, slots=True, frozen=True)
class RunOptions:
    """Where the results go and how the run is cut: the same for every command that replays."""

    out: Path | None = None  # no results dir: the library keeps the token table in memory
    force: bool = False  # replace an existing results dir (and a work dir of other inputs)
    shard: Shard | None = None
    block_size: int = DEFAULT_BLOCK
    progress: ProgressFactory | None = None
    # source -> what its framework config set (pipeline/configured.py), for summary.json's engines
    from_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    skip_invalid: bool = False  # audit the valid rollouts; the others counted and listed (summary.json skipped)

    # --distribution K | full: each pair of engines' whole next-token distributions (replay/distribution.py)
    distribution: str | None = None
    # Set by pipeline.configured.resolve_options, the one pass at the edge that resolves the framework
    # configs and holds them against the checkpoint: a command never resolves its options again.
    resolved: bool = False

    @property
    def distribution_pairs(self) -> tuple[tuple[str, str], ...]:
        """The pairs of engine sources whose distributions --distribution compares."""
        return ()

    @property
    def sources(self) -> dict[str, str]:
        """The engine spec each source of the command replays ({} for a command that replays none)."""
        return {}


# The engine pairs --distribution compares (a merge of shards rebuilds the same ones).
AUDIT_DISTRIBUTION_PAIRS = (("train", "infer"),)
DIFF_DISTRIBUTION_PAIRS = (("a", "reference"), ("b", "reference"))


@dataclass(kw_only=True, slots=True, frozen=True)
class AuditOptions(RunOptions):
    train: str = "hf"
    infer: str | None = None  # None: hf-decode, or the rollout engine of a --train framework config
    localize_models: bool = False  # also rerun both configs with hooks (layers, kernels)
    clip: ClipRange = ClipRange()  # the PPO clip range the gap is measured against
    probe: bool = False  # also run the kernel probes at the checkpoint's shapes
    # framework -> the correction settings the run uses, under its own names (`--for NAME:KEY=VALUE`, or
    # what a --train framework config sets): its metrics are computed with them, over its defaults, and
    # summary.json framework_settings records them
    framework_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    framework: str | None = None  # the framework `--for` named: its snippet leads the report (summary.json framework)
    force_model: bool = False  # replay even when the --train config names another model than the checkpoint

    @property
    def sources(self) -> dict[str, str]:
        return {"train": self.train, "infer": self.infer or DEFAULT_INFER}

    @property
    def distribution_pairs(self) -> tuple[tuple[str, str], ...]:
        return AUDIT_DISTRIBUTION_PAIRS


@dataclass(kw_only=True, slots=True, frozen=True)
class DiffOptions(RunOptions):
    a: str
    b: str
    reference: str = "hf"
    seed: int = 0  # of the bootstrap over rollouts

    @property
    def sources(self) -> dict[str, str]:
        return {"a": self.a, "b": self.b, "reference": self.reference}

    @property
    def distribution_pairs(self) -> tuple[tuple[str, str], ...]:
        return DIFF_DISTRIBUTION_PAIRS
