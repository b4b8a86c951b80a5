"""summary.json's analysis sections as typed records: alignment, render drift, prefix consistency
and localization (the turn onset, layers, kernels, layer types, index flips).

Each record lists every key its producer writes (analysis/alignment.py, rollouts/drift.py,
analysis/prefixes.py, localize/), so a section decoded and encoded again is the same JSON key for
key. A key a producer writes only sometimes (or a section written empty, `{}`) is `UNSET` and left
out of the file again; readers test such a field with `is UNSET`/truthiness, or read it through
`present(...)` (summary_model). Row tables whose columns an analysis decides (a turn's pair metrics,
a drift span) stay `Table`: lists of maps, read by the keys their producer always writes.

A leaf, like summary_model: the standard library and msgspec only.
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET, Struct, UnsetType, convert, field

# NaN and +-inf are written as null; an int stays an int (a count or a top_k written as a number)
Number = int | float | None
# Rows whose columns the analysis that writes them decides (the pair metrics of a turn, a drift span).
Table = list[dict[str, Any]]


class _Open(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """A section an analysis writes: every key optional (UNSET: not written), unknown keys ignored."""


class SamplerDeclaration(_Open):
    """What the rollouts' meta.sampler declares of the engine that sampled them (docs/format.md):
    its engine, dtype and attention, its log-probs' semantics (raw | processed) and temperature, the
    checkpoint it loaded. The values are the user's, as written (read, never held to a type)."""

    engine: Any = UNSET
    dtype: Any = UNSET
    attn: Any = UNSET
    logprobs: Any = UNSET
    temperature: Any = UNSET
    top_p: Any = UNSET
    top_k: Any = UNSET
    min_p: Any = UNSET
    checkpoint: Any = UNSET


class EngineRouting(_Open):
    """`engines.<source>.routing` (engines/hf.py describe): the MoE layers whose experts it recorded,
    its routing mode, and, under routing=replay, the source whose experts it followed (`from`)."""

    moe_layers: int | UnsetType = UNSET
    mode: str | None | UnsetType = UNSET
    followed: str | None | UnsetType = field(default=UNSET, name="from")


class ConfigSetting(_Open):
    """One setting a framework config read (frameworks/configs/derived.py Setting): its key, value,
    fate (status), and the engine option it became."""

    side: str | UnsetType = UNSET
    key: str | UnsetType = UNSET
    value: Any = UNSET
    status: str | UnsetType = UNSET
    option: str | None | UnsetType = UNSET
    note: str | UnsetType = UNSET


class ModelCheck(_Open):
    """The model a --train config names against the audited checkpoint (configs/model_check.py)."""

    named: str | UnsetType = UNSET
    verdict: str | UnsetType = UNSET  # same | differs | unknown
    line: str | None | UnsetType = UNSET  # the audit's first line


class FromConfig(_Open):
    """`engines.<source>.from_config`: the framework config a side's spec was read from, its
    settings' fates, what the first screen must say (notices), and the options set over it."""

    framework: str | UnsetType = UNSET
    file: str | UnsetType = UNSET
    loader: str | UnsetType = UNSET
    side: str | UnsetType = UNSET
    spec: str | UnsetType = UNSET
    model: str | None | UnsetType = UNSET
    notices: list[str] | UnsetType = UNSET
    framework_settings: dict[str, Any] | UnsetType = UNSET
    settings: list[ConfigSetting] | UnsetType = UNSET
    overrides: dict[str, Any] | UnsetType = UNSET
    model_check: ModelCheck | UnsetType = UNSET


# --- alignment (analysis/alignment.py, analysis/truncation.py, replay/truncation.py) ------------

class AlignmentFinding(_Open):
    """A problem with the stored log-probs: its kind, the rollout it is worst in, what, and the fix."""

    kind: str | UnsetType = UNSET
    rollout: Any = UNSET
    message: str | UnsetType = UNSET
    fix: str | None | UnsetType = UNSET


class KeptMassRatio(_Open):
    """The token ratio of one pair over the truncated sampler's tokens (its mean is the kept mass)."""

    pair: str | UnsetType = UNSET
    n_tokens: int | UnsetType = UNSET
    ratio_mean: Number | UnsetType = UNSET
    frac_outside_band: Number | UnsetType = field(default=UNSET, name="frac_outside_0.9_1.1")


class KeptMassRatios(_Open):
    """`alignment.truncation.ratios` (analysis/truncation.py RATIO_PAIRS): the token ratio against
    the truncated sampler without the kept-set replay (train) and with it (train_processed)."""

    without_replay: KeptMassRatio | UnsetType = UNSET
    with_replay: KeptMassRatio | UnsetType = UNSET


class TruncationEstimate(_Open):
    """The truncation that best explains the stored log-probs on the replay's own distributions:
    its kind (top_p, top_k, min_p) and value, the share of tokens it explains, and the others tried."""

    kind: str | UnsetType = UNSET
    value: int | float | UnsetType = UNSET
    confidence: float | UnsetType = UNSET
    range: list[int | float] | UnsetType = UNSET
    n_tokens: int | UnsetType = UNSET
    tolerance_nats: float | UnsetType = UNSET
    others: dict[str, dict[str, Any]] | UnsetType = UNSET


class Truncation(_Open):
    """`alignment.truncation`: stored log-probs above the replay's (raised), below (lowered), the kept
    mass, then what meta.sampler declares against what the data estimate, and the kept-mass ratios."""

    truncated: bool | UnsetType = UNSET
    n_tokens: int | UnsetType = UNSET
    frac_raised: Number | UnsetType = UNSET
    frac_lowered: Number | UnsetType = UNSET
    frac_unlikely_lowered: Number | UnsetType = UNSET
    kept_mass_mean: Number | UnsetType = UNSET
    kept_mass_q01: Number | UnsetType = UNSET
    declared: dict[str, int | float] | None | UnsetType = UNSET  # top_p / top_k / min_p as meta.sampler says
    declared_fit: Number | UnsetType = UNSET
    estimate: TruncationEstimate | None | UnsetType = UNSET
    replayed: dict[str, Any] | UnsetType = UNSET
    replayed_from: str | UnsetType = UNSET
    ratios: KeptMassRatios | UnsetType = UNSET


class Alignment(_Open):
    """`alignment` (analysis.alignment): is the stored column the quantity the replay computes: its
    best shift (stored[i] fits token i + shift) and each shift's fit, its semantics (raw, processed,
    truncated, unknown), the temperature that fits, the share of positions with no, padded or
    constant log-probs, what meta.sampler declared, and the findings. `{}`: nothing stored to check."""

    stored: str | None | UnsetType = UNSET
    replayed: str | None | UnsetType = UNSET
    shift: int | UnsetType = UNSET
    shift_fit: dict[str, Number] | UnsetType = UNSET
    shift_by_rollout: dict[str, int] | UnsetType = UNSET
    padded_zero_frac: Number | UnsetType = UNSET
    constant_frac: Number | UnsetType = UNSET
    missing_trainable_frac: Number | UnsetType = UNSET
    logprob_semantics: str | UnsetType = UNSET
    estimated_temperature: Number | UnsetType = UNSET
    semantics: dict[str, Any] | UnsetType = UNSET
    declared: dict[str, Any] | None | UnsetType = UNSET  # meta.sampler
    truncation: Truncation | UnsetType = UNSET
    findings: list[AlignmentFinding] | UnsetType = UNSET

    @property
    def declaration(self) -> SamplerDeclaration:
        """`declared` read as meta.sampler's keys (every field UNSET where it declares nothing)."""
        return convert(self.declared or {}, SamplerDeclaration, strict=False)


# --- render drift (rollouts/drift.py) --------------------------------------------------------------

class DriftSpan(_Open):
    """One drifted span (rollouts/drift.py): where (rollout, turn, segment, role, the message it
    starts in), the stored and re-rendered text, its kind (retokenized | whitespace | case |
    think_dropped | tool_call | content), the trainable tokens it touches, the ids and a few unchanged
    tokens either side; a recorded one (`source` "recorded") also its branch, request and at_turn."""

    rollout: Any = UNSET
    turn: int | None | UnsetType = UNSET
    segment: int | UnsetType = UNSET
    role: Any = UNSET
    message: int | None | UnsetType = UNSET
    stored: str | UnsetType = UNSET
    rendered: str | UnsetType = UNSET
    kind: str | UnsetType = UNSET
    in_tool_call: bool | UnsetType = UNSET
    trainable_tokens: int | UnsetType = UNSET
    stored_start: int | UnsetType = UNSET
    stored_ids: Any = UNSET
    rendered_ids: Any = UNSET
    stored_context: str | UnsetType = UNSET
    rendered_context: str | UnsetType = UNSET
    branch: Any = UNSET
    request: Any = UNSET
    at_turn: Any = UNSET
    source: str | UnsetType = UNSET


class Drift(_Open):
    """`drift` (rollouts.drift): re-rendered tokens that differ from the sampled ones: the rollouts
    checked, without messages, recorded, drifted; the spans by kind and the trainable tokens they
    touch. `spans` rows: rollout, turn, segment, role, message, stored, rendered, kind, ... ."""

    num_rollouts_checked: int | UnsetType = UNSET
    num_rollouts_without_messages: int | UnsetType = UNSET
    num_rollouts_recorded: int | UnsetType = UNSET
    num_rollouts_drifted: int | UnsetType = UNSET
    num_spans: int | UnsetType = UNSET
    spans_by_kind: dict[str, int] | UnsetType = UNSET
    trainable_tokens_touched: int | UnsetType = UNSET
    spans: list[DriftSpan] | UnsetType = UNSET


# --- prefix consistency (analysis/prefixes.py) -----------------------------------------------------

class WorstPrefix(_Open):
    rollouts: list[str] | UnsetType = UNSET
    pos: int | UnsetType = UNSET
    spread: Number | UnsetType = UNSET


class PrefixConsistency(_Open):
    """One source of `prefix_consistency`: of the tokens whose prefix another request shares, how many
    prefixes, the share whose log-probs agree bit for bit, the largest spread, and where it is."""

    n_shared_tokens: int | UnsetType = UNSET
    n_prefixes: int | UnsetType = UNSET
    frac_prefixes_bitwise_equal: Number | UnsetType = UNSET
    max_abs_spread: Number | UnsetType = UNSET
    worst: WorstPrefix | None | UnsetType = UNSET

    @property
    def split(self) -> bool:
        """Some shared prefix got different log-probs in different requests."""
        return isinstance(self.frac_prefixes_bitwise_equal, float) and self.frac_prefixes_bitwise_equal < 1.0


# --- localization (localize/) ----------------------------------------------------------------------

class PositionSlope(_Open):
    """The gap's linear growth along position (localize.slope): per 1000 tokens, its 95% CI, and the
    cluster-robust (per sequence) error where sequences were counted."""

    unit_tokens: int | UnsetType = UNSET
    n_tokens: int | UnsetType = UNSET
    slope_per_1k: Number | UnsetType = UNSET
    intercept: Number | UnsetType = UNSET
    se: Number | UnsetType = UNSET
    ci95_per_1k: list[Number] | None | UnsetType = UNSET
    p_value: Number | UnsetType = UNSET
    dof: int | None | UnsetType = UNSET
    grows_with_position: bool | UnsetType = UNSET
    n_sequences: int | UnsetType = UNSET
    se_cluster: Number | UnsetType = UNSET
    ci95_cluster_per_1k: list[Number] | None | UnsetType = UNSET
    p_value_cluster: Number | UnsetType = UNSET


class DepartingRollout(_Open):
    rollout: Any = UNSET
    abs_mean_before: Number | UnsetType = UNSET
    abs_mean_from: Number | UnsetType = UNSET


class Onset(_Open):
    """`localization.turns.onset`: the rollouts that step up at the onset turn, worst first, and what
    that turn holds that the turns before it did not."""

    turn: int | UnsetType = UNSET
    n_rollouts_compared: int | UnsetType = UNSET
    n_rollouts_departing: int | UnsetType = UNSET
    rollouts: list[DepartingRollout] | UnsetType = UNSET
    rows_by_role: dict[str, int] | UnsetType = UNSET
    rows_by_branch_kind: dict[str, int] | UnsetType = UNSET
    new_roles: list[str] | UnsetType = UNSET
    new_branch_kinds: list[str] | UnsetType = UNSET


class TurnLocalization(_Open):
    """`localization.turns` (localize.turns): the pair it reads, the first turn where the gap steps
    up (null: none does) by the onset rule, who departs there, the drift along position, and the
    tables (by turn, probability bucket, role, branch kind; each row a turn's pair metrics)."""

    pair: str | UnsetType = UNSET
    trainable_only: bool | UnsetType = UNSET
    n_tokens: int | UnsetType = UNSET
    onset_turn: int | None | UnsetType = UNSET
    onset: Onset | None | UnsetType = UNSET
    onset_rule: str | UnsetType = UNSET
    onset_params: dict[str, Any] | UnsetType = UNSET
    by_turn: Table | UnsetType = UNSET  # turn, the pair metrics, onset_stat, compared, departs, ...
    position_slope: PositionSlope | UnsetType = UNSET
    by_prob_bucket: Table | UnsetType = UNSET
    by_role: Table | UnsetType = UNSET
    by_branch_kind: Table | UnsetType = UNSET


class LayerRow(_Open):
    """One hooked point (localize.layers.LayerRow): a sub-block's output or the residual stream."""

    layer: int | UnsetType = UNSET
    block: str | UnsetType = UNSET  # residual | attn | mlp | norm
    module: str | UnsetType = UNSET
    rel_error: Number | UnsetType = UNSET
    rel_error_token_max: Number | UnsetType = UNSET
    input_rel_error: Number | UnsetType = UNSET
    local_rel_error: Number | UnsetType = UNSET
    rel_error_increase: Number | UnsetType = UNSET
    logit_lens_logp_a: Number | UnsetType = UNSET
    logit_lens_logp_b: Number | UnsetType = UNSET
    logit_lens_abs_diff: Number | UnsetType = UNSET
    logit_lens_abs_diff_max: Number | UnsetType = UNSET
    logit_lens_kl: Number | UnsetType = UNSET


class LayerLocalization(_Open):
    """`localization.layers` (localize.layers.LayerReport): where a's residual stream departs from
    b's, per layer and sub-block, with the jump layer and block; `skipped` says why it did not run."""

    skipped: str | UnsetType = UNSET
    a: str | UnsetType = UNSET
    b: str | UnsetType = UNSET
    method: str | UnsetType = UNSET
    jump_rule: str | UnsetType = UNSET
    num_sequences: int | UnsetType = UNSET
    num_tokens: int | UnsetType = UNSET
    embed_rel_error: Number | UnsetType = UNSET
    output_logp_abs_diff_mean: Number | UnsetType = UNSET
    jump_layer: int | None | UnsetType = UNSET
    jump_block: str | None | UnsetType = UNSET
    jump_module: str | None | UnsetType = UNSET
    dist_jump_layer: int | None | UnsetType = UNSET
    dist_jump_rule: str | UnsetType = UNSET
    by_layer: list[LayerRow] | UnsetType = UNSET


class ModuleError(_Open):
    """One module fed the same input on both sides (localize.kernels.ModuleResult): the error it
    introduces, its rounding floor, and per expert for fused MoE experts."""

    name: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    rel_error: Number | UnsetType = UNSET
    max_abs: Number | UnsetType = UNSET
    rounding_floor: Number | UnsetType = UNSET
    num_elements: int | UnsetType = UNSET
    by_expert: list[Number] | UnsetType = UNSET
    worst_expert: int | None | UnsetType = UNSET


class ModuleTypeError(_Open):
    type: str | UnsetType = UNSET
    num_modules: int | UnsetType = UNSET
    rel_error: Number | UnsetType = UNSET
    rel_error_max: Number | UnsetType = UNSET
    max_abs: Number | UnsetType = UNSET


class KernelLocalization(_Open):
    """`localization.kernels` (localize.kernels.KernelReport): module-local error, most first, and
    per module type; `skipped` says why it did not run."""

    skipped: str | UnsetType = UNSET
    reference: str | UnsetType = UNSET
    candidate: str | UnsetType = UNSET
    method: str | UnsetType = UNSET
    num_sequences: int | UnsetType = UNSET
    num_tokens: int | UnsetType = UNSET
    by_module: list[ModuleError] | UnsetType = UNSET
    by_type: list[ModuleTypeError] | UnsetType = UNSET


class LayerTypeShare(_Open):
    layer_type: str | UnsetType = UNSET
    layers: list[int] | UnsetType = UNSET
    local_rel_error_sum: Number | UnsetType = UNSET
    local_rel_error_max: Number | UnsetType = UNSET
    share: Number | UnsetType = UNSET


class LayerTypeSplit(_Open):
    """`localization.layer_types` (localize.layer_types): the layers' local error split by the
    layer's mixer type, the lead type, the jump layer's type, and the paths that differ, in words."""

    a: str | UnsetType = UNSET
    b: str | UnsetType = UNSET
    rule: str | UnsetType = UNSET
    lead_type: str | None | UnsetType = UNSET
    jump_type: str | None | UnsetType = UNSET
    mechanism: str | None | UnsetType = UNSET
    by_type: list[LayerTypeShare] | UnsetType = UNSET


class IndexFlips(_Open):
    """`localization.index_flips` (localize.index_flips): a sparse-attention indexer's top-k flips
    between a and b, the share of k3 on tokens with one, and what replaying b's selection removes."""

    a: str | UnsetType = UNSET
    b: str | UnsetType = UNSET
    index_topk: int | UnsetType = UNSET
    num_sequences: int | UnsetType = UNSET
    by_layer: Table | UnsetType = UNSET
    frac_tokens_with_flip: Number | UnsetType = UNSET
    with_flip: dict[str, Any] | UnsetType = UNSET
    without_flip: dict[str, Any] | UnsetType = UNSET
    k3_share_with_flip: Number | UnsetType = UNSET
    replayed_with_flip: dict[str, Any] | UnsetType = UNSET
    replayed_without_flip: dict[str, Any] | UnsetType = UNSET
    removed_k3_frac: Number | UnsetType = UNSET
    replay_selection: str | UnsetType = UNSET
    num_queries_recorded: int | UnsetType = UNSET
    method: str | UnsetType = UNSET


class Localization(_Open):
    """`localization`: the turn localizer's findings (every audit), and with --localize the layers,
    the kernels, the split by layer type and, for a model with an indexer, its flips."""

    turns: TurnLocalization | None | UnsetType = UNSET
    layers: LayerLocalization | UnsetType = UNSET
    kernels: KernelLocalization | UnsetType = UNSET
    layer_types: LayerTypeSplit | UnsetType = UNSET
    index_flips: IndexFlips | UnsetType = UNSET


# --- the weights diff of an engine run on other weights (mismatch/weights.py) ---------------------

class DifferingTensor(_Open):
    name: str | UnsetType = UNSET
    max_rel_diff: Number | UnsetType = UNSET
    rel_l2_diff: Number | UnsetType = UNSET  # ||a-b|| / ||a||
    experts_differing: list[int] | UnsetType = UNSET  # a stacked expert tensor's experts that differ


class WeightsDiff(_Open):
    """`weights[source]` (WeightsReport.brief): the weights an engine ran (b) against the trainer's
    (a): identical or not, the verdict, and the differing tensors, most changed first."""

    a: str | UnsetType = UNSET
    b: str | UnsetType = UNSET
    identical: bool | UnsetType = UNSET
    verdict: str | UnsetType = UNSET
    n_differing: int | UnsetType = UNSET
    only_a: list[str] | UnsetType = UNSET
    only_b: list[str] | UnsetType = UNSET
    differing: list[DifferingTensor] | UnsetType = UNSET


# --- the whole next-token distribution (analysis/distribution.py) --------------------------------

class BitwiseClaim(_Open):
    """Whether sampled-token bitwise equality carries over to the whole distribution (or the known
    top-K log-probs): the counts behind it and the claim in words."""

    n_sampled_equal: int | UnsetType = UNSET
    n_row_equal: int | UnsetType = UNSET
    n_both_equal: int | UnsetType = UNSET
    scope: str | UnsetType = UNSET
    holds: bool | UnsetType = UNSET
    claim: str | UnsetType = UNSET


class NextTokenGap(_Open):
    """One pair of `distribution` (analysis.distribution.pair_result): both sides' distributions over
    the vocabulary at every trainable position: exact or bounded by a top-K side (`bounded` says
    why), KL both ways, TV, top-K overlap and tails, argmax agreement and ranks, the bitwise claim
    checked, the tokens that moved most, the worst positions and the turns (terms:
    mismatch/engines/distributions.py)."""

    k: int | None | UnsetType = UNSET
    full: Any = UNSET
    views: Any = UNSET
    exact: bool | UnsetType = UNSET
    n_positions: int | UnsetType = UNSET
    kl: Number | UnsetType = UNSET
    kl_ab_mean: Number | UnsetType = UNSET
    kl_ba_mean: Number | UnsetType = UNSET
    kl_ab_max: Number | UnsetType = UNSET
    tv_mean: Number | UnsetType = UNSET
    tv_max: Number | UnsetType = UNSET
    tv_hi_mean: Number | UnsetType = UNSET
    topk_overlap_mean: Number | UnsetType = UNSET
    tail_a_mean: Number | UnsetType = UNSET
    tail_b_mean: Number | UnsetType = UNSET
    argmax_agree_frac: Number | UnsetType = UNSET
    rank_differs_frac: Number | UnsetType = UNSET
    n_rank_unknown: int | UnsetType = UNSET
    sampled_abs_log_ratio_mean: Number | UnsetType = UNSET
    bitwise: BitwiseClaim | UnsetType = UNSET
    tokens: Table | UnsetType = UNSET  # token_id, tv_share, n_positions
    worst: Table | UnsetType = UNSET  # rollout, branch, turn, pos, kl_ab, moved_token, ...
    turns: Table | UnsetType = UNSET  # turn, n, kl_ab_mean, tv_mean
    bounded: str | None | UnsetType = UNSET
    seconds: Number | UnsetType = UNSET


# --- diff (analysis/comparison.py, pipeline/diff.py) ---------------------------------------------

class MetricDelta(_Open):
    """One metric of `diff.deltas`: a/reference, b/reference, b - a and its bootstrap 95% CI."""

    a: Number | UnsetType = UNSET
    b: Number | UnsetType = UNSET
    delta: Number | UnsetType = UNSET
    ci95: list[Number] | None | UnsetType = UNSET


class DistributionCloser(_Open):
    """`diff.distribution`: which config is closer on the whole next-token distribution (mean KL),
    decided only where both sides are exact."""

    kl: dict[str, Number] | UnsetType = UNSET  # {"a": ..., "b": ...}
    tv_mean: dict[str, Number] | UnsetType = UNSET
    argmax_agree_frac: dict[str, Number] | UnsetType = UNSET
    exact: bool | UnsetType = UNSET
    closer: str | None | UnsetType = UNSET  # a | b | tie; null when a side's KL is only a bound
    rule: str | UnsetType = UNSET


class DisagreeingToken(_Open):
    """One of `diff.where.worst_tokens`: a token where configs a and b disagree most, and the three
    log-probs it got."""

    rollout: str | UnsetType = UNSET
    branch: str | UnsetType = UNSET
    pos: int | UnsetType = UNSET
    token_id: int | UnsetType = UNSET
    logp_a: Number | UnsetType = UNSET
    logp_b: Number | UnsetType = UNSET
    logp_reference: Number | UnsetType = UNSET


class Disagreement(_Open):
    """`diff.where` (analysis.comparison): the turns, position bins and tokens where configs a and b
    disagree most with each other."""

    by_turn: Table | UnsetType = UNSET  # turn, the gap's statistics
    by_position: Table | UnsetType = UNSET  # pos_from, the gap's statistics
    worst_tokens: list[DisagreeingToken] | UnsetType = UNSET


class Comparison(_Open):
    """`diff` (analysis.comparison.ConfigComparison and the engines' throughputs): b/reference -
    a/reference per metric, the closer config by kl_k3 and the rule behind it, where a and b
    disagree most (by turn, by position, the worst tokens), each config's replay speed."""

    deltas: dict[str, MetricDelta] | UnsetType = UNSET
    closer_to_reference: str | UnsetType = UNSET  # a | b | tie
    closer_rule: str | UnsetType = UNSET
    where: Disagreement | UnsetType = UNSET
    throughput_tokens_per_s: dict[str, Number] | UnsetType = UNSET
    distribution: DistributionCloser | None | UnsetType = UNSET


# --- the inputs' identity (identity.run_inputs) ----------------------------------------------------

class NumberOptions(_Open):
    """`inputs.options`: the command's options that change its numbers but not its replay
    (pipeline/stages.py number_options: NUMBER_OPTIONS, a clip range as its two bounds, and
    skip_invalid, which decides the rollouts measured)."""

    clip_eps_low: Any = UNSET
    clip_eps_high: Any = UNSET
    seed: Any = UNSET
    probe: Any = UNSET
    distribution: Any = UNSET
    skip_invalid: Any = UNSET


class RunInputs(_Open):
    """`inputs`: everything a resumed or merged run must share with the run it continues: the
    command, mismatch's version, the block size, the rollouts file's size and digest, the
    checkpoint's files and each engine's parsed options by content, and the number options."""

    command: str | UnsetType = UNSET
    mismatch_version: str | UnsetType = UNSET
    block_size: int | UnsetType = UNSET
    rollouts: dict[str, Any] | None | UnsetType = UNSET  # size, digest
    checkpoint: Any = UNSET
    engines: dict[str, Any] | UnsetType = UNSET
    options: NumberOptions | UnsetType = UNSET


# --- strata (analysis/strata.py) ---------------------------------------------------------------------

class Stratum(_Open):
    """One dimension of `strata[pair]` (length, position, prob, entropy): each bucket's lower edge,
    tokens, mean k3, mean |log-ratio| and mean log-ratio (null where empty); `unavailable` says why
    a dimension was not measured (the entropy without a torch engine)."""

    edges: list[Number] | UnsetType = UNSET
    n_tokens: list[int] | UnsetType = UNSET
    kl_k3: list[Number] | UnsetType = UNSET
    log_ratio_abs_mean: list[Number] | UnsetType = UNSET
    log_ratio_mean: list[Number] | UnsetType = UNSET
    unavailable: str | UnsetType = UNSET
