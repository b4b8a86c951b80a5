"""summary.json as typed records: the contract `mismatch.summary/v1`, written and read through them.

`Summary` is the whole file; each section a stage returns is one record below (the pair metrics,
verdicts, the diagnosis with its causes, refusals and bf16 envelope, recommendations, simulated
corrections, the shard, the clip range, the rollouts skipped). Maps whose keys a run decides
(engines as they describe themselves, framework settings, the localizers' and analyses' tables)
stay `dict[str, ...]`. The shipped JSON Schema (mismatch/data/summary.schema.json) is GENERATED
from these records (`json_schema`, `python -m mismatch.results.summary_model`), never edited by
hand; a test regenerates it and compares it byte for byte.

A section present in only some runs defaults to `UNSET` and is then left out of the file (an
audit's `alignment`, a shard's `inputs`, a diff's `diff`); a reader tests it with
`is not UNSET` (or `present(...)`). Unknown keys are ignored on reading (readers must ignore keys
they do not know). NaN and +-inf are written as null, so every metric reads `float | None`.

This module is a leaf: it imports only the standard library and msgspec.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from mismatch.results.section_records import (
    Alignment,
    Comparison,
    Drift,
    EngineRouting,
    FromConfig,
    Localization,
    NextTokenGap,
    PrefixConsistency,
    RunInputs,
    SamplerDeclaration,
    Stratum,
    WeightsDiff,
)

SCHEMA_NAME = "mismatch.summary/v1"

_T = TypeVar("_T")

# An open-ended section, whose keys the analysis that writes it decides (alignment, drift, routing,
# localization's tables, an engine's self-description): a map, read with the keys its producer names.
Section = dict[str, Any]
# A recommendation's or a correction's parameters, under the names its mode or fix takes.
Params = dict[str, Any]
# A summary.json file's JSON as parsed, before it is decoded into records (what gate's consistency
# checks read: a hand-edited file is bad input they name, not a type error).
JSONObject = dict[str, Any]

NonNegative = Annotated[int, Meta(ge=0)]
Number = float | None  # NaN and +-inf are written as null
PairName = Annotated[str, Meta(pattern="^[^/]+/[^/]+$")]


class _Record(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """A section of summary.json: keyword-built, its UNSET fields left out of the file."""


class PairMetrics(_Record, kw_only=True):
    """One pair's metrics over trainable tokens (analysis.metrics.PAIR_METRICS, in that order), where
    log_ratio = logp_A - logp_B and ratio = exp(log_ratio). kl_k1/k2/k3 are Schulman's estimators of
    KL(B || A) from samples of B; chi2_* the chi-square divergence per token / per sequence; ess the
    effective sample size of the ratio as importance weights; ratio_qXYZ its quantiles."""

    n_tokens: int | None
    n_rollouts: int | None
    log_ratio_mean: Number
    log_ratio_abs_mean: Number
    log_ratio_abs_max: Number
    ratio_mean: Number
    ratio_std: Number
    ratio_min: Number
    ratio_max: Number
    ratio_q001: Number
    ratio_q01: Number
    ratio_q99: Number
    ratio_q999: Number
    kl_k1: Number
    kl_k2: Number
    kl_k3: Number
    chi2_token: Number
    chi2_seq: Number
    ppl_ratio: Number
    ess: Number
    prob_abs_diff_mean: Number
    prob_abs_diff_max: Number
    frac_outside_2: Number
    bitwise_equal_frac: Number


Pairs = dict[PairName, PairMetrics]


class RowCounts(_Record, kw_only=True):
    """`counts`: the token table's rollouts, branches (streams), tokens and trainable tokens."""

    rollouts: NonNegative | UnsetType = UNSET
    branches: NonNegative | UnsetType = UNSET
    tokens: NonNegative | UnsetType = UNSET
    trainable_tokens: NonNegative | UnsetType = UNSET


class TurnRow(_Record, kw_only=True):
    """`turns[i]`: the pair metrics of one turn's trainable tokens."""

    turn: int
    pairs: Pairs


class RoleRow(_Record, kw_only=True):
    """`roles[i]`: the pair metrics of one chat role's tokens, trainable or not."""

    role: str
    pairs: Pairs


class BranchKindRow(_Record, kw_only=True):
    """`branch_kinds[i]`: the pair metrics of one branch kind's trainable tokens."""

    branch_kind: str
    pairs: Pairs


class Verdict(_Record, kw_only=True, omit_defaults=False):
    """`verdicts["A/B"]`: the pair's gap level, what the pair measures, and one plain sentence
    ending with the diagnosed cause."""

    level: str
    meaning: str | None = None
    text: str


class CauseWhere(_Record, kw_only=True):
    """Where a cause is and what it names, the keys its kind sets (mismatch/advise: each rule's
    Cause) and nothing else: the alignment shift and the rollouts it hits; the temperatures; the turn,
    the drift spans and their places; the sources, the weights' layers, modules, experts and a
    layer type's share, in words; the truncation declared or estimated and the kept mass; the pair
    and its gap; the token off the sampled ones; the checkpoint the rollouts declare; the next
    command when nothing explains the gap. The recommendations take it as their parameters (in
    this order, without `words`, which they say as `at`)."""

    shift: int | UnsetType = UNSET
    trainer_temperature: float | UnsetType = UNSET
    stored_temperature: int | float | None | UnsetType = UNSET
    config_key: str | None | UnsetType = UNSET
    estimated_temperature: int | float | None | UnsetType = UNSET
    like_for_like: str | None | UnsetType = UNSET
    like_for_like_level: str | None | UnsetType = UNSET
    turn: int | UnsetType = UNSET
    spans: int | UnsetType = UNSET
    rollouts: list[Any] | UnsetType = UNSET
    new_roles: list[str] | UnsetType = UNSET
    new_branch_kinds: list[str] | UnsetType = UNSET
    places: list[dict[str, Any]] | UnsetType = UNSET  # rollout, turn
    differs: dict[str, list[Any]] | UnsetType = UNSET  # a setting -> its two sides' values
    source: str | None | UnsetType = UNSET
    layer_type: str | UnsetType = UNSET
    layers: list[int] | UnsetType = UNSET
    modules: list[str] | UnsetType = UNSET
    experts: list[str] | UnsetType = UNSET
    share: float | UnsetType = UNSET
    jump: bool | UnsetType = UNSET
    mechanism: str | None | UnsetType = UNSET
    words: str | UnsetType = UNSET
    infer: str | None | UnsetType = UNSET  # the --infer spec to audit again with
    top_p: int | float | UnsetType = UNSET
    top_k: int | float | UnsetType = UNSET
    min_p: int | float | UnsetType = UNSET
    declared_fit: Number | UnsetType = UNSET
    misdeclared: bool | UnsetType = UNSET
    estimate: dict[str, int | float] | UnsetType = UNSET  # {kind: value}
    confidence: Number | UnsetType = UNSET
    range: list[int | float] | UnsetType = UNSET
    kept_mass_mean: Number | UnsetType = UNSET
    ratios: dict[str, Any] | UnsetType = UNSET  # alignment.truncation.ratios
    bf16_source: str | UnsetType = UNSET
    sources: list[str] | UnsetType = UNSET
    pair: str | UnsetType = UNSET
    k3_share: Number | UnsetType = UNSET
    frac_tokens_with_flip: Number | UnsetType = UNSET
    removed_k3_frac: Number | UnsetType = UNSET
    gap: str | UnsetType = UNSET
    slope_per_1k: Number | UnsetType = UNSET
    token_id: int | None | UnsetType = UNSET
    positions: list[dict[str, Any]] | UnsetType = UNSET  # rollout, pos
    kl: Number | UnsetType = UNSET
    kl_k3: Number | UnsetType = UNSET
    checkpoint: str | UnsetType = UNSET
    declared: Any = UNSET  # what the rollouts' meta.checkpoint declares
    declared_by_rollouts: list[str] | UnsetType = UNSET
    next: str | UnsetType = UNSET
    ruled_out: list[str] | UnsetType = UNSET
    envelope: Any = UNSET  # the bf16 envelope (Envelope's keys), or null


class Cause(_Record, kw_only=True, omit_defaults=False):
    """A diagnosed cause of one pair's gap: its evidence, what rules the others out, where it
    is (layer, module, expert, turn, rollouts) and the fix at its source."""

    kind: str
    pair: str
    title: str
    evidence: list[str]
    rules_out: list[str]
    fix: str
    where: CauseWhere
    minor: bool = False


class Refusal(_Record, kw_only=True):
    """A cause found but not claimed: the admissibility test it failed, and why."""

    kind: str
    pair: str
    test: Literal["size", "consistency"]
    why: str


class Envelope(_Record, kw_only=True):
    """The bf16 gap measured on these weights (two replays of the checkpoint in two dtypes)."""

    pair: str
    kl_k3: float
    words: str


class Diagnosis(_Record, kw_only=True, omit_defaults=False):
    """The evidence turned into ranked causes before any advice (mismatch.advise.diagnose; its
    RULE is in `rule`)."""

    causes: list[Cause]
    findings: list[str]
    refused: list[Refusal] = []
    envelope: Envelope | None = None
    rule: str | None = None


class Recommendation(_Record, kw_only=True, omit_defaults=False):
    """A fix or a correction recommended: its kind, its parameters, why, and its cost."""

    kind: str
    params: Params = {}
    why: str
    cost: str | None = None


class CorrectionTurn(_Record, kw_only=True):
    """One turn of a simulated correction: its tokens, the share the correction touched, and their
    mean weight."""

    turn: Any = UNSET
    n_tokens: int | UnsetType = UNSET
    frac_tokens_affected: Number | UnsetType = UNSET
    weight_mean: Number | UnsetType = UNSET


class Correction(_Record, kw_only=True, omit_defaults=False):
    """An IS correction the frameworks ship, simulated on the run's own tokens: its mode and
    parameters, then what it does to them (the share of tokens, sequences and rollouts it
    touches, its weights' mean/max/std, their effective sample size, by turn)."""

    mode: str
    params: Params
    frac_tokens_affected: Number = None
    frac_rollouts_affected: Number = None
    weight_mean: Number = None
    weight_max: Number = None
    ess: Number = None
    weight_std: Number = None
    level: str | None = None
    n_tokens: int | None = None
    n_sequences: int | None = None
    n_rollouts: int | None = None
    frac_sequences_affected: Number = None
    by_turn: list[CorrectionTurn] = []


class ProbeResult(_Record, kw_only=True):
    """One kernel probe (probes/result.py's ProbeResult): an op under one variation that differs
    between engines (its `source`: batch_size, chunking, split_kv, dtype, ...), and whether the two
    outputs agree bit for bit. Every field optional on reading: a caller may name only the ones it
    measured."""

    family: str | UnsetType = UNSET
    op: str | UnsetType = UNSET
    variation: str | UnsetType = UNSET
    source: str | UnsetType = UNSET
    dtype: str | UnsetType = UNSET
    device: str | UnsetType = UNSET
    applicable: bool | UnsetType = UNSET  # False: the variation does not exist on this device
    bitwise_equal_frac: Number | UnsetType = UNSET
    max_abs_diff: Number | UnsetType = UNSET
    max_ulp_diff: int | None | UnsetType = UNSET
    num_elements: int | UnsetType = UNSET
    note: str | UnsetType = UNSET
    num_flipped: int | None | UnsetType = UNSET
    flipped_frac: Number | UnsetType = UNSET


class Probes(_Record, kw_only=True):
    """audit --probe: the machine the probes ran on, and each probe's result."""

    environment: dict[str, Any] | UnsetType = UNSET
    results: list[ProbeResult] | UnsetType = UNSET


def probe_results(data: Any) -> list[ProbeResult]:
    """Probe results given as plain data (ProbeResult.to_dict()'s) as records."""
    return from_builtins(data, list[ProbeResult])


class PublishedFile(_Record, kw_only=True):
    """A published table's row count and content digest (what a merge and the readers check)."""

    rows: NonNegative
    sha256: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]


class Shard(_Record, kw_only=True):
    """Which slice of the blocks a run replayed (0 of 1: all of them), the shards a merge came
    from, and each published table's rows and digest."""

    index: NonNegative
    count: Annotated[int, Meta(ge=1)]
    block_size: Annotated[int, Meta(ge=1)]
    merged_from: list[str] | UnsetType = UNSET
    files: dict[str, PublishedFile] | UnsetType = UNSET


class Clip(_Record, kw_only=True):
    """The PPO clip range [1 - eps_low, 1 + eps_high] and, per pair, the share of trainable
    tokens outside it, overall, by turn and by branch kind."""

    eps_low: float
    eps_high: float
    range: list[float] | UnsetType = UNSET
    pairs: dict[str, Number]
    turns: dict[str, list[dict[str, Any]]] | UnsetType = UNSET
    branch_kinds: dict[str, list[dict[str, Any]]] | UnsetType = UNSET


class SkippedRollout(_Record, kw_only=True):
    line: int | None
    rollout: str | None | UnsetType = UNSET
    error: str


class Skipped(_Record, kw_only=True):
    """audit --skip-invalid: the rollouts of the file left out for an error (count), the valid
    ones audited (valid), and the first 100 of those left out."""

    count: NonNegative
    valid: NonNegative
    rollouts: list[SkippedRollout]


class DeclaredRow(_Record, kw_only=True):
    checkpoint: str | Section  # a name or path, or {path|name, sha256: {file: digest}}
    rollouts: Annotated[int, Meta(ge=1)]
    match: Literal["same weights", "same name", "other weights", "another name"]


class DeclaredCheckpoint(_Record, kw_only=True):
    """audit: the checkpoint each rollout declares it was sampled by (meta.checkpoint) against the
    audited one, when any rollout declares one: each distinct declaration with its rollout count and
    match (same weights, same name, other weights, another name; docs/format.md), whether all agree,
    whether any was compared by its weight digests, and the line said first when they disagree (null
    when they agree)."""

    rollouts: NonNegative
    undeclared: NonNegative
    declared: list[DeclaredRow]
    agrees: bool
    by_weights: bool | UnsetType = UNSET
    line: str | None | UnsetType = UNSET


class EngineEntry(_Record, kw_only=True):
    """What readers rely on of one engine in `engines`: these keys held to their types. Each
    backend's describe() adds its own facts, kept as they are: `engines` stays a map of sections,
    checked against this record on reading (`partial_summary`); `Summary.engine` reads one through it."""

    kind: str | UnsetType = UNSET
    spec: str | UnsetType = UNSET
    name: Any = UNSET  # a stored stream's name (`stored:NAME`)
    dtype: Any = UNSET
    attn: Any = UNSET
    checkpoint: Any = UNSET  # the weights it ran, where not the audited checkpoint
    device: Any = UNSET
    logprob_semantics: Any = UNSET
    tokens_per_s: Any = UNSET  # its replay speed
    seconds: Any = UNSET
    options: dict[str, Any] | UnsetType = UNSET  # the spec's options (temperature=, ...)
    routing: EngineRouting | UnsetType = UNSET  # a routing=replay engine: the pass it followed (`from`)
    meta: SamplerDeclaration | None | UnsetType = UNSET  # the sampler's declaration (meta.sampler)
    from_config: FromConfig | UnsetType = UNSET  # what a framework config set (pipeline/configured.py)

    @classmethod
    def of(cls, description: Section) -> EngineEntry:
        """An engine's description (what describe() returned, or summary.json's `engines.<source>`)
        read through the keys readers rely on."""
        return msgspec.convert(description, cls, strict=False)


class Summary(_Record, kw_only=True):
    """What audit, diff and merge write into DIR/summary.json. NaN and infinities are written as
    null. Keys not listed here may be added by later versions; readers must ignore them. The pair
    metrics are mismatch.analysis.metrics.PAIR_METRICS (log_ratio = log pi_A - log pi_B over the
    trainable tokens)."""

    schema: Literal["mismatch.summary/v1"]
    command: Literal["audit", "diff"]
    mismatch_version: str
    created_unix: float
    checkpoint: str
    rollouts_file: str
    counts: RowCounts
    engines: dict[str, Section]  # each engine as it described itself: EngineEntry's keys, and its own
    pairs: Pairs
    verdicts: dict[str, Verdict]
    turns: list[TurnRow]
    roles: list[RoleRow]
    branch_kinds: list[BranchKindRow]
    localization: Localization
    corrections: list[Correction]
    recommendations: list[Recommendation]
    clip: Clip | UnsetType = UNSET
    shard: Shard | UnsetType = UNSET
    inputs: RunInputs | None | UnsetType = UNSET
    alignment: Alignment | UnsetType = UNSET
    trees: dict[str, Any] | UnsetType = UNSET
    framework_metrics: dict[str, dict[str, dict[str, Number]]] | UnsetType = UNSET  # pair -> framework -> metric
    framework_settings: Annotated[dict[str, Section], Meta(description=(
        "The correction settings (each framework's own names) its framework_metrics were computed with: "
        "the newest read release's defaults, under what the rollouts declared, under --for's or a config's."))] \
        | UnsetType = UNSET
    drift: Drift | UnsetType = UNSET
    routing: dict[str, Any] | UnsetType = UNSET
    # per source; a merge that could not group the shards' prefixes says why under `not_merged`
    prefix_consistency: dict[str, PrefixConsistency | str] | UnsetType = UNSET
    weights: Annotated[dict[str, WeightsDiff], Meta(description=(
        "per engine run on another checkpoint than the trainer's: the weights diff against it "
        "(mismatch.weights.WeightsReport.brief)"))] | UnsetType = UNSET
    probes: Probes | UnsetType = UNSET
    strata: Annotated[dict[str, dict[str, Stratum]], Meta(description=(
        "Per pair (A/B), the gap over the trainable tokens split on fixed bucket edges by the token's rollout "
        "length (its trained tokens), its position in the stream, its probability under B (exp logp_B), and the "
        "A side's entropy at the position where a torch engine recorded it (else `unavailable`, saying why). "
        "Means are null in an empty bucket. mismatch trend reads them across steps."))] | UnsetType = UNSET
    distribution: Annotated[dict[str, NextTokenGap], Meta(description=(
        "--distribution only. Per engine pair (A/B), the gap between the two sides' whole next-token "
        "distributions over the trainable positions (docs/distribution.md; terms defined in "
        "mismatch/engines/distributions.py). `kl` is the mean KL(A||B); exact when `exact` (both sides gave "
        "every token's log-prob), else a lower bound (`bounded` says why)."))] | UnsetType = UNSET
    framework: Annotated[str, Meta(description=(
        "The framework `audit --for NAME` named: its config snippet leads the report's first screen."))] \
        | UnsetType = UNSET
    diff: Comparison | UnsetType = UNSET
    skipped: Skipped | UnsetType = UNSET
    declared_checkpoint: DeclaredCheckpoint | UnsetType = UNSET
    diagnosis: Diagnosis | UnsetType = UNSET
    config_snippets: dict[str, str] | UnsetType = UNSET

    @property
    def semantics(self) -> str | None:
        """What the stored log-probs are (alignment.logprob_semantics: raw, processed, truncated,
        unknown); None where nothing stored was checked."""
        return present(self.alignment.logprob_semantics) if self.alignment else None

    @property
    def grows_with_position(self) -> bool | None:
        """Whether the gap grows along position (localization.turns.position_slope); None: not fitted."""
        turns = self.localization.turns
        return present(turns.position_slope.grows_with_position) if turns and turns.position_slope else None

    @property
    def onset_turn(self) -> int | None:
        """The first turn where the gap steps up (localization.turns); None: none does, or not run."""
        turns = self.localization.turns
        return present(turns.onset_turn) if turns else None

    def metric(self, pair: str, name: str) -> float | int | None:
        """One metric of one pair; None when the pair is not measured or the metric is null."""
        metrics = self.pairs.get(pair)
        return getattr(metrics, name) if metrics is not None else None

    def engine(self, source: str) -> EngineEntry:
        """One source's engine as it described itself, the keys readers rely on (`meta` for the
        sampler's declaration); every field UNSET where the run has no such source."""
        return EngineEntry.of(self.engines.get(source, {}))

    @property
    def declared(self) -> SamplerDeclaration:
        """What meta.sampler declares (every field UNSET where it declares nothing)."""
        return present(self.engine("sampler").meta) or SamplerDeclaration()

    def split_prefixes(self) -> dict[str, PrefixConsistency]:
        """The sources whose shared prefixes did not all get the same log-probs (analysis.prefixes)."""
        return {source: found for source, found in self.prefix_findings().items() if found.split}

    def prefix_findings(self) -> dict[str, PrefixConsistency]:
        """prefix_consistency's sources (without a merge's `not_merged` note)."""
        return {source: found for source, found in (present(self.prefix_consistency) or {}).items()
                if isinstance(found, PrefixConsistency)}

    def section(self, name: str) -> dict[str, Any]:
        """An open-ended section (`alignment`, `drift`, `routing`, `weights`, ...) as its map, empty
        where the summary has none."""
        value = getattr(self, name)
        return value if isinstance(value, dict) else {}

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON data (what summary.json holds, NaN kept in memory): the
        transitional view for readers not yet on the records."""
        return to_builtins(self)


# What an audit's summary always holds beside the common sections, and a diff's.
AUDIT_REQUIRED = ("alignment", "trees", "framework_metrics", "clip", "config_snippets", "inputs")
DIFF_REQUIRED = ("diff", "inputs")


def present(value: _T | UnsetType) -> _T | None:
    """An optional section's value, None where the summary has none."""
    return None if value is UNSET else value


def _plain(value: Any) -> Any:
    """numpy scalars and arrays, and subclasses of str (torch's TorchVersion in the probes'
    environment), as JSON values (msgspec's hook for types it does not know)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, str):
        return str.__str__(value)  # its characters, whatever its own __str__ says
    raise NotImplementedError(f"{type(value).__name__} is not JSON data")


def to_builtins(record: Any) -> Any:
    """A record as plain dicts, lists and numbers."""
    return msgspec.to_builtins(record, enc_hook=_plain)


def from_builtins(data: Any, type: type[_T] = Summary) -> _T:  # noqa: A002 (msgspec's own name)
    """Plain JSON data as `type` (the whole summary by default); raises msgspec.ValidationError
    naming the field's path ($.pairs["A/B"].kl_k3) where the data does not fit."""
    return msgspec.convert(data, type, strict=False)


_EMPTY_SECTIONS: dict[str, Any] = {
    "schema": SCHEMA_NAME, "command": "audit", "mismatch_version": "", "created_unix": 0.0, "checkpoint": "",
    "rollouts_file": "", "counts": {}, "engines": {}, "pairs": {}, "verdicts": {}, "turns": [], "roles": [],
    "branch_kinds": [], "localization": {}, "corrections": [], "recommendations": []}


def partial_summary(data: Any) -> Summary:
    """A summary made by hand or by an older mismatch, which may lack sections a run always writes
    and metrics of a pair: each missing section read as empty, each missing metric as null. What
    is there is held to its type as `from_builtins` holds it."""
    filled = {**_EMPTY_SECTIONS, **data}
    filled["pairs"] = _filled_pairs(filled["pairs"])
    for key in ("turns", "roles", "branch_kinds"):
        if isinstance(filled[key], list):
            filled[key] = [{**row, "pairs": _filled_pairs(row.get("pairs"))} if isinstance(row, dict) else row
                           for row in filled[key]]
    summary = from_builtins(filled)
    msgspec.convert(summary.engines, dict[str, EngineEntry], strict=False)  # the keys readers rely on, typed
    return summary


def partial_metrics(data: Any) -> PairMetrics:
    """One pair's metrics made by hand: each missing metric null."""
    return from_builtins(_filled_metrics(data), PairMetrics)


def _filled_pairs(pairs: Any) -> Any:
    if not isinstance(pairs, dict):
        return pairs
    return {name: _filled_metrics(metrics) for name, metrics in pairs.items()}


def _filled_metrics(metrics: Any) -> Any:
    if not isinstance(metrics, dict):
        return metrics
    return {**dict.fromkeys(PairMetrics.__struct_fields__), **metrics}


def encode(summary: Summary) -> str:
    """summary.json's text: one-space indent, NaN and +-inf as null."""
    return json.dumps(_finite(to_builtins(summary)), indent=1) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of summary.json, generated from `Summary`: msgspec's,
    with the top-level record inlined and the per-command required sections added."""
    _, definitions = msgspec.json.schema_components([Summary, EngineEntry], ref_template="#/$defs/{name}")
    top = definitions.pop("Summary")
    top["properties"]["engines"]["additionalProperties"] = {"$ref": "#/$defs/EngineEntry"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://mismatch.dev/schemas/summary-v1.json",
        **top,
        "title": "mismatch summary.json (mismatch.summary/v1)",
        "allOf": [
            {"if": {"properties": {"command": {"const": "audit"}}}, "then": {"required": list(AUDIT_REQUIRED)}},
            {"if": {"properties": {"command": {"const": "diff"}}}, "then": {"required": list(DIFF_REQUIRED)}},
        ],
        "$defs": definitions,
    }


def schema_text() -> str:
    """The shipped schema file's text, as `json_schema` generates it."""
    return json.dumps(json_schema(), indent=1, sort_keys=False) + "\n"


if __name__ == "__main__":  # regenerate mismatch/data/summary.schema.json
    import sys
    from pathlib import Path

    target = Path(__file__).parent.parent / "data" / "summary.schema.json"
    target.write_text(schema_text())
    sys.stdout.write(f"wrote {target}\n")
