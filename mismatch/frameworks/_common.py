"""What the framework modules share: the pair's arrays their metrics read, a metric's record, and
the parts of a recommendation every snippet renderer looks at."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from mismatch.analysis import terms


SAFETY_BOUND = 20.0  # verl and slime clamp log-ratios to +-20 before exp (rollout_corr_helper.py:75)


class PairArrays:
    """A pair's trainable tokens with both log-probs defined, and their sequence and rollout
    (codes 0..k-1 in table order); the log-ratio and the group sizes are made once."""

    def __init__(self, logp_a: np.ndarray, logp_b: np.ndarray, seq: np.ndarray, rollout: np.ndarray,
                 log_ratio: np.ndarray | None = None) -> None:
        self.logp_a = logp_a    # the trainer side (log pi_train in the frameworks' terms)
        self.logp_b = logp_b    # the rollout side (log pi_rollout)
        self.seq = seq          # each token's sequence (one branch of one rollout)
        self.rollout = rollout  # each token's rollout
        self.log_ratio = logp_a - logp_b if log_ratio is None else log_ratio
        self._counts = {id(seq): np.bincount(seq), id(rollout): np.bincount(rollout)}
        self._starts = {id(codes): _run_starts(codes, self._counts[id(codes)]) for codes in (seq, rollout)}
        self._means: dict[tuple[int, int, float], np.ndarray] = {}

    # Terms several metrics share, made once per pair.
    @cached_property
    def ratio(self) -> np.ndarray:
        return terms.ratio(self.log_ratio)

    @cached_property
    def k1(self) -> np.ndarray:
        return terms.k1(self.log_ratio)

    @cached_property
    def k3(self) -> np.ndarray:
        return terms.k3(self.log_ratio)

    @cached_property
    def abs_log_ratio(self) -> np.ndarray:
        return np.abs(self.log_ratio)

    @cached_property
    def clamped_ratio_sq(self) -> np.ndarray:
        """exp(log-ratio clamped to +-SAFETY_BOUND)^2, verl's and slime's chi-square term."""
        return np.square(np.exp(np.clip(self.log_ratio, -SAFETY_BOUND, SAFETY_BOUND)))

    @cached_property
    def prob_abs_diff(self) -> np.ndarray:
        return terms.prob_abs_diff(self.logp_a, self.logp_b)

    @cached_property
    def seq_log_ratio(self) -> np.ndarray:
        """Each sequence's log-ratio summed (its sequence-level log importance ratio)."""
        return self._sums(self.seq, self.log_ratio)

    def per(self, codes: np.ndarray, values: np.ndarray, eps: float = 0.0) -> np.ndarray:
        """Mean of `values` per code (`seq` or `rollout`), `eps` added to each count (verl's
        masked_mean divides by count + 1e-8); kept for the pair's own log-prob arrays, which several
        metrics average per sequence."""
        own = values is self.logp_a or values is self.logp_b
        key = (id(codes), id(values), eps)
        if own and key in self._means:
            return self._means[key]
        means = self._sums(codes, values) / (self._counts[id(codes)] + eps)
        if own:
            self._means[key] = means
        return means

    def _sums(self, codes: np.ndarray, values: np.ndarray) -> np.ndarray:
        counts, starts = self._counts[id(codes)], self._starts[id(codes)]
        return np.bincount(codes, weights=values, minlength=len(counts)) if starts is None else \
            np.add.reduceat(values, starts)


def _run_starts(codes: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
    """Where each code's run begins when the codes are 0, 0, 1, 2, 2, ... (every code present, in
    order: a chunk's sequences and rollouts are), so a sum per code is a sum per run (reduceat,
    ~20x faster than a weighted bincount); None otherwise."""
    if not len(codes) or not counts.all() or (len(codes) > 1 and (codes[1:] < codes[:-1]).any()):
        return None
    return np.concatenate([[0], np.cumsum(counts)[:-1]])


# How a metric's values from every chunk of the table combine (analysis/framework_metrics.py):
# mean, max, min, median, std (sample, ddof 1), ess ((sum w)^2 / (n sum w^2)), ess_eps (the same
# with 1e-8 added to the mean weight, as verl normalizes), pearson (of two rows).
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


def clamped(p: PairArrays) -> np.ndarray:
    return np.clip(p.log_ratio, -SAFETY_BOUND, SAFETY_BOUND)


def probs(p: PairArrays) -> np.ndarray:
    """[2, tokens]: pi_train and pi_rollout."""
    return np.exp(np.stack([p.logp_a, p.logp_b]))


# --- which release a snippet targets ---

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


def _versioned(releases: tuple[Release, ...]) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        for release in releases:
            Version(release.version)
    except InvalidVersion:
        return False
    return True


def nearest_release(releases: tuple[Release, ...], version: str | None) -> tuple[Release, str]:
    """The release whose keys serve `version`: the newest read release not newer than it (keys hold
    from a release until one we read changes them), else the oldest; a note when `version` is not a
    release we read. None: the newest."""
    from packaging.version import InvalidVersion, Version

    newest = releases[-1]
    if version is None:
        return newest, ""
    if not _versioned(releases):  # commits: a prefix of one names it
        named = [r for r in releases if r.version.startswith(version) or version.startswith(r.version)]
        return (named[0], "") if named else (newest, f"{version} is not a commit mismatch has read: the keys "
                                                     f"below are {newest.version}'s ({newest.read_from})")
    try:
        asked = Version(version)
    except InvalidVersion:
        raise ValueError(f"{version!r} is not a version") from None
    read = sorted(releases, key=lambda r: Version(r.version))
    exact = [r for r in read if Version(r.version) == asked]
    if exact:
        return exact[0], ""
    older = [r for r in read if Version(r.version) < asked]
    chosen = older[-1] if older else read[0]
    where = ("newer than any release mismatch has read" if chosen is read[-1] and older
             else "older than any release mismatch has read" if not older else "not a release mismatch has read")
    return chosen, (f"{version} is {where} ({', '.join(r.version for r in read)}): "
                    f"the keys below are {chosen.version}'s, the nearest")


# --- settings given on the command line (--for NAME:KEY=VALUE), parsed ---

def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


def optional_float(text: str) -> float | None:
    """A float, or null / none for no bound."""
    if text.strip().lower() in ("null", "none", ""):
        return None
    return float(text)


def optional_str(text: str) -> str | None:
    return None if text.strip().lower() in ("null", "none", "") else text.strip()


def yaml_scalar(value: Any) -> str:
    """A YAML value as the frameworks' loaders read it back: null, true/false, a float's repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str) and not value.isidentifier():  # "0.5_5.0" must stay a string
        return f'"{value}"'
    return str(value)
