"""By layer: the residual stream of two torch configurations compared layer by layer and sub-block.

The layer step of localize (after turns, before kernels): the same tokens through two `hf` /
`hf-decode` engines with forward hooks -> `summary.json["localization"]["layers"]`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mismatch.engines import TORCH_KINDS, ReplayRequest, load_engine, parse_spec
from mismatch.engines.hf import TorchEngineBase
from mismatch.engines.hf_decode import DecodeSession, feed_chunks, round_states
from mismatch.engines.logprobs import token_logprobs
from mismatch.errors import MismatchError, SpecError
from mismatch.localize.lens_distribution import DIST_JUMP_RULE, dist_jump, lens_kl
from mismatch.results import json_safe

DEFAULT_MAX_TOKENS = 2048
Site = tuple[int, str]  # (layer index, sub-block name or OUTPUT): one hooked point
EMBED: Site = (-1, "embed")  # the embedding output: the residual stream before layer 0
OUTPUT = "output"       # site name of a decoder layer's output (the residual stream after it)

METHOD = ("both configurations replay the same tokens one sequence at a time with forward hooks on "
          "each decoder layer and its sub-blocks; rel_error = ||h_a - h_b|| / ||h_b|| in fp32 over all "
          "scored positions; local_rel_error = the same for a's sub-block fed b's input (error it "
          "introduces, not inherits); logit lens = realized token's log-prob after final norm + lm_head "
          "applied to each layer's residual, each configuration with its own weights")
JUMP_RULE = ("jump_layer = the layer whose residual rel_error rises most over the previous layer's (the "
             "embedding's for layer 0); jump_block = the kind of its sub-block with the largest "
             "local_rel_error (ties: largest rel_error - input_rel_error). jump_layer null with "
             "jump_block 'embed': the embedding output already differs most; both null: a and b agree "
             "bit for bit")


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerRow:
    """One hooked point: a sub-block's output, or the residual stream after a layer."""

    layer: int
    block: str                      # "residual" | "attn" | "mlp" | "norm"
    module: str                     # attribute name in the layer ("self_attn", ...) or "output"
    rel_error: float                # ||h_a - h_b|| / ||h_b|| pooled over all scored positions
    rel_error_token_max: float      # the worst single position
    # Sub-blocks only: the error of what the block read, and the error it adds on b's input.
    input_rel_error: float | None = None
    local_rel_error: float | None = None
    # Residual rows only.
    rel_error_increase: float | None = None   # over the previous layer's (layer 0: the embedding's)
    logit_lens_logp_a: float | None = None    # mean realized-token log-prob read out after this layer
    logit_lens_logp_b: float | None = None
    logit_lens_abs_diff: float | None = None  # mean |logp_a - logp_b| of that read-out
    logit_lens_abs_diff_max: float | None = None
    logit_lens_kl: float | None = None  # the whole distribution read out here: mean KL(a‖b) (issue #48)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerReport:
    a: str
    b: str
    num_sequences: int
    num_tokens: int                 # scored positions compared
    embed_rel_error: float
    jump_layer: int | None
    jump_block: str | None          # "attn" | "mlp" | "norm" | "embed" | None
    jump_module: str | None         # the sub-block's attribute name, e.g. "mlp"
    by_layer: tuple[LayerRow, ...]  # per layer: its sub-blocks in execution order, then "residual"
    dist_jump_layer: int | None = None  # the layer whose read-out KL rises most (DIST_JUMP_RULE)

    def residual(self) -> list[LayerRow]:
        return [row for row in self.by_layer if row.block == "residual"]

    def row(self, layer: int, module: str) -> LayerRow:
        return next(r for r in self.by_layer if r.layer == layer and r.module == module)

    def to_dict(self) -> dict[str, Any]:
        """The `summary.json["localization"]["layers"]` object (JSON-safe: NaN/inf -> null)."""
        last = self.residual()[-1] if self.residual() else None
        return json_safe({
            "a": self.a, "b": self.b, "method": METHOD, "jump_rule": JUMP_RULE,
            "num_sequences": self.num_sequences, "num_tokens": self.num_tokens,
            "embed_rel_error": self.embed_rel_error,
            "output_logp_abs_diff_mean": last.logit_lens_abs_diff if last else None,
            "jump_layer": self.jump_layer, "jump_block": self.jump_block, "jump_module": self.jump_module,
            "dist_jump_layer": self.dist_jump_layer, "dist_jump_rule": DIST_JUMP_RULE,
            "by_layer": [row.to_dict() for row in self.by_layer],
        })


def compare_layers(checkpoint: str | Path, inputs: Sequence[ReplayRequest] | Sequence[Sequence[int]], *,
                   a: str, b: str, max_tokens: int = DEFAULT_MAX_TOKENS) -> LayerReport:
    """Compare configuration `a` against reference `b` layer by layer on the same tokens.

    `a` and `b` are engine specs of kind `hf` (one full forward, as a trainer scores) or
    `hf-decode` (prefill + KV-cached decode, as a sampler scores), with their usual options
    (`dtype`, `attn`, `device`, `checkpoint=` for other weights, `prefill`). `inputs` are replay
    requests (`plan_replay(...).requests`) or plain token-id lists (scored from position 1; the
    decode path then feeds them token by token). Sequences run alone (batch 1), in order, until
    `max_tokens` scored positions; the last one is cut to fit.

    Memory: both models, plus one sequence's captures in the models' dtypes (a Llama layer: 22
    tensors of [length, hidden]); `max_tokens` also caps the sequence length.
    """
    specs = {"a": parse_spec(a), "b": parse_spec(b)}
    for source, spec in specs.items():
        if spec.kind not in TORCH_KINDS:
            raise SpecError(f"--{source} {spec.text}: the layer localizer hooks torch models; use an engine "
                            f"of kind {' or '.join(TORCH_KINDS)} (e.g. hf:dtype=bfloat16), not {spec.kind!r}")
    if max_tokens < 1:
        raise MismatchError(f"max_tokens must be at least 1, got {max_tokens}")
    requests = _budget(_as_requests(inputs), max_tokens)  # bad input fails before any model loads
    engines: dict[str, TorchEngineBase] = {}
    try:
        for source in ("b", "a"):
            engines[source] = load_engine(specs[source], str(checkpoint))  # type: ignore[assignment]
        return _compare(engines["a"], engines["b"], requests, a=specs["a"].text, b=specs["b"].text)
    finally:
        for engine in engines.values():
            engine.close()


def compare_layers_on_rollouts(checkpoint: str | Path, rollouts: str | Path, *, a: str, b: str,
                               max_tokens: int = DEFAULT_MAX_TOKENS) -> LayerReport:
    """`compare_layers` on a rollouts file: every branch (with its context), in file order."""
    from mismatch.checkpoint import checkpoint_info
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts

    loaded = load_rollouts(rollouts, vocab_size=checkpoint_info(checkpoint).vocab_size)
    return compare_layers(checkpoint, plan_replay(loaded).requests, a=a, b=b, max_tokens=max_tokens)


def _as_requests(inputs: Sequence[ReplayRequest] | Sequence[Sequence[int]]) -> list[ReplayRequest]:
    requests = []
    for item in inputs:
        if isinstance(item, ReplayRequest):
            requests.append(item)
            continue
        tokens = np.asarray(item, dtype=np.int64)
        # A bare token list: the first token is the prompt, the rest was sampled.
        requests.append(ReplayRequest(tokens=tokens, generated=np.arange(len(tokens)) > 0, score_from=1))
    return requests


def _budget(requests: list[ReplayRequest], max_tokens: int) -> list[ReplayRequest]:
    """Requests in order until max_tokens scored positions; the last one cut to fit."""
    kept, left = [], max_tokens
    for request in requests:
        first = max(request.score_from, 1)  # position 0 has no prediction
        num_scored = len(request.tokens) - first
        if num_scored <= 0:
            continue
        if num_scored > left:
            stop = first + left
            request = ReplayRequest(tokens=request.tokens[:stop], generated=request.generated[:stop],
                                    score_from=request.score_from)
        kept.append(request)
        left -= min(num_scored, left)
        if left == 0:
            break
    if not kept:
        raise MismatchError("the layer localizer needs at least one sequence with a scored token "
                            "(two or more tokens)")
    return kept


# ---------------------------------------------------------------------------------------------
# Model structure


@dataclass(kw_only=True, slots=True, frozen=True)
class _Structure:
    embed: nn.Module
    layers: tuple[nn.Module, ...]
    blocks: tuple[tuple[tuple[str, str, nn.Module], ...], ...]  # per layer: (name, kind, module)
    final_norm: nn.Module

    def signature(self) -> list[list[tuple[str, str]]]:
        return [[(name, kind) for name, kind, _ in blocks] for blocks in self.blocks]


def block_kind(name: str, module: nn.Module) -> str | None:
    """"norm" | "attn" | "mlp" for a decoder layer's child, None for anything else (dropout, ...)."""
    lowered = name.lower()
    # Phi-3's resid_attn_dropout / resid_mlp_dropout are named like blocks but compute nothing at eval.
    if isinstance(module, nn.Dropout) or "dropout" in lowered:
        return None
    # Norms first: "post_attention_layernorm" also contains "attention".
    if "norm" in lowered or type(module).__name__.endswith("Norm"):
        return "norm"
    if "attn" in lowered or "attention" in lowered:
        return "attn"
    if "mlp" in lowered or lowered in ("feed_forward", "ffn", "block_sparse_moe", "moe"):
        return "mlp"
    return None


def decoder_structure(model: nn.Module) -> _Structure:
    """Embedding, decoder layers, their sub-blocks and the final norm of a Llama-style causal LM.

    Found generically: `model.base_model.layers` (Llama, Qwen2, Mistral, Gemma, ...), the
    children of each layer named like a norm / attention / MLP, and `base_model.norm`.
    """
    base = model.base_model
    layers = getattr(base, "layers", None)
    final_norm = getattr(base, "norm", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not isinstance(final_norm, nn.Module):
        raise MismatchError(f"layer localizer: {type(model).__name__} has no `base_model.layers` and "
                            "`base_model.norm` (a Llama-style decoder is needed)")
    blocks = tuple(tuple((name, kind, child) for name, child in layer.named_children()
                         if (kind := block_kind(name, child)) is not None) for layer in layers)
    return _Structure(embed=model.get_input_embeddings(), layers=tuple(layers), blocks=blocks,
                      final_norm=final_norm)


# ---------------------------------------------------------------------------------------------
# Capture


def _first_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]


def _hidden_input(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor, cache: Any) -> tuple[tuple, dict]:
    """The same call with another hidden-state input, and `cache` in place of any KV cache."""
    from transformers.cache_utils import Cache

    swap = lambda value: cache if isinstance(value, Cache) else value  # noqa: E731
    if args and isinstance(args[0], torch.Tensor):
        return (hidden, *map(swap, args[1:])), {k: swap(v) for k, v in kwargs.items()}
    return tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()} | {"hidden_states": hidden}


@dataclass(slots=True)
class _Capture:
    """Per site key (layer, name): the [positions, D] chunks seen in one sequence."""

    inputs: dict[Site, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[Site, list[torch.Tensor]] = field(default_factory=dict)
    local: dict[Site, list[torch.Tensor]] = field(default_factory=dict)
    order: list[Site] = field(default_factory=list)  # sub-block sites, first-call order

    def cat(self) -> _Capture:
        join = lambda parts: {key: torch.cat(chunks) for key, chunks in parts.items()}  # noqa: E731
        return _Capture(inputs=join(self.inputs), outputs=join(self.outputs), local=join(self.local),
                        order=self.order)


class _Hooks:
    """Forward hooks that capture one configuration's sites; with a reference, also re-run each
    sub-block on the reference's input (the same call otherwise, a private KV cache)."""

    def __init__(self, engine: TorchEngineBase, structure: _Structure, reference: _Capture | None) -> None:
        self.engine, self.reference = engine, reference
        self.capture = _Capture()
        self.seen: dict[Site, int] = {}
        self.local_cache: Any = None
        self.in_local = False
        self.handles = [structure.embed.register_forward_hook(self._output_hook(EMBED))]
        for index, (layer, blocks) in enumerate(zip(structure.layers, structure.blocks, strict=True)):
            self.handles.append(layer.register_forward_hook(self._output_hook((index, OUTPUT))))
            for name, _, module in blocks:
                self.handles.append(module.register_forward_hook(self._block_hook((index, name)),
                                                                 with_kwargs=True))

    def _output_hook(self, key: Site):
        def hook(module, args, output):
            if not self.in_local:
                self.capture.outputs.setdefault(key, []).append(_first_tensor(output)[0].detach().clone())
        return hook

    def _block_hook(self, key: Site):
        def hook(module, args, kwargs, output):
            if self.in_local:
                return
            hidden_1CD = _hidden_input(args, kwargs)
            if key not in self.capture.inputs:
                self.capture.order.append(key)
            self.capture.inputs.setdefault(key, []).append(hidden_1CD[0].detach().clone())
            self.capture.outputs.setdefault(key, []).append(_first_tensor(output)[0].detach().clone())
            if self.reference is not None:
                local_CD = self._rerun(module, key, hidden_1CD, args, kwargs)
                self.capture.local.setdefault(key, []).append(local_CD)
            self.seen[key] = self.seen.get(key, 0) + hidden_1CD.shape[1]
        return hook

    def _rerun(self, module: nn.Module, key: Site, hidden_1CD: torch.Tensor,
               args: tuple, kwargs: dict) -> torch.Tensor:
        """This sub-block, as called just now, but on the reference's input at the same positions."""
        start, num = self.seen.get(key, 0), hidden_1CD.shape[1]
        ref_CD = self.reference.inputs[key][start:start + num].to(hidden_1CD.device, hidden_1CD.dtype)
        if len(ref_CD) < num:
            # The reference fed fewer positions (decode never feeds the last token). Causal: a
            # trailing position changes no earlier output, and its own output is not compared.
            ref_CD = torch.cat([ref_CD, hidden_1CD[0, len(ref_CD):]])
        local_args, local_kwargs = _with_hidden(args, kwargs, ref_CD[None], self.local_cache)
        self.in_local = True
        try:
            return _first_tensor(module(*local_args, **local_kwargs))[0].detach().clone()
        finally:
            self.in_local = False

    def span(self, request: ReplayRequest) -> _Capture:
        """Replay one sequence the way the engine does; the captures, concatenated over positions."""
        from transformers import DynamicCache

        engine = self.engine
        self.capture, self.seen = _Capture(), {}
        # The re-run's own KV cache: fed only reference inputs, in lockstep with the real one.
        self.local_cache = DynamicCache(config=engine.model.config)
        with torch.inference_mode():
            if engine.kind == "hf":
                ids_1L = torch.from_numpy(request.tokens)[None].to(engine.device)
                engine.decoder(input_ids=ids_1L)
            else:
                session = DecodeSession(engine.model, engine.device, engine.options.state_dtype)
                for start, stop in feed_chunks(request.generated, prefill=engine.options.prefill == "prompt"):
                    session.feed(request.tokens[start:stop])
                    round_states(self.local_cache, engine.options.state_dtype)  # the re-run's state as the real one
        return self.capture.cat()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------
# Comparison

@dataclass(slots=True)
class _Tally:
    """Pooled relative error; squared norms summed in float64 from fp32 differences."""

    sum_sq_diff: float = 0.0
    sum_sq_ref: float = 0.0
    token_max: float = 0.0

    def add(self, x_PD: torch.Tensor, ref_PD: torch.Tensor) -> None:
        ref = ref_PD.float()
        diff_sq_P = (x_PD.to(ref.device).float() - ref).square().sum(-1)
        ref_sq_P = ref.square().sum(-1)
        self.sum_sq_diff += float(diff_sq_P.double().sum())
        self.sum_sq_ref += float(ref_sq_P.double().sum())
        if len(diff_sq_P):
            per_token = torch.where(diff_sq_P == 0, 0.0, (diff_sq_P / ref_sq_P).sqrt())
            self.token_max = max(self.token_max, float(per_token.max()))

    def rel(self) -> float:
        if self.sum_sq_diff == 0.0:
            return 0.0
        return math.sqrt(self.sum_sq_diff / self.sum_sq_ref) if self.sum_sq_ref else math.inf


@dataclass(slots=True)
class _Lens:
    sum_kl: float = 0.0  # KL(a‖b) of the whole read-out distribution, summed over positions
    sum_logp_a: float = 0.0
    sum_logp_b: float = 0.0
    sum_abs_diff: float = 0.0
    max_abs_diff: float = 0.0
    count: int = 0

    def add(self, logp_a: torch.Tensor, logp_b: torch.Tensor) -> None:
        abs_diff = (logp_a - logp_b).abs()
        self.sum_logp_a += float(logp_a.sum())
        self.sum_logp_b += float(logp_b.sum())
        self.sum_abs_diff += float(abs_diff.sum())
        self.max_abs_diff = max(self.max_abs_diff, float(abs_diff.max()) if len(abs_diff) else 0.0)
        self.count += len(abs_diff)


def _logit_lens(engine: TorchEngineBase, final_norm: nn.Module, hidden_LD: torch.Tensor, first: int,
                targets_P: torch.Tensor) -> torch.Tensor:
    """Realized next-token log-probs read out of a layer's residual with the model's own head.

    The norm sees the whole captured sequence as [1, L, D], the call the model itself makes, so
    the last layer's read-out is computed the way the engine computes its log-probs.
    """
    with torch.inference_mode():
        normed_PD = final_norm(hidden_LD[None])[0, first:first + len(targets_P)]
        return token_logprobs(normed_PD, targets_P, engine.lm_head, chunk=engine.options.chunk,
                              softcap=engine.softcap)


@dataclass(slots=True)
class _Totals:
    """Everything pooled over the sequences, per site."""

    output: defaultdict[Site, _Tally] = field(default_factory=lambda: defaultdict(_Tally))
    input: defaultdict[Site, _Tally] = field(default_factory=lambda: defaultdict(_Tally))
    local: defaultdict[Site, _Tally] = field(default_factory=lambda: defaultdict(_Tally))
    lens: defaultdict[int, _Lens] = field(default_factory=lambda: defaultdict(_Lens))
    order: list[Site] = field(default_factory=list)
    num_tokens: int = 0

    def add(self, cap_a: _Capture, cap_b: _Capture, first: int, stop: int) -> None:
        """Positions first..stop-1 of one sequence's captures (a against reference b)."""
        self.order = self.order or cap_b.order
        self.num_tokens += stop - first
        for site, out_b in cap_b.outputs.items():
            self.output[site].add(cap_a.outputs[site][first:stop], out_b[first:stop])
        for site, in_b in cap_b.inputs.items():
            self.input[site].add(cap_a.inputs[site][first:stop], in_b[first:stop])
            self.local[site].add(cap_a.local[site][first:stop], cap_b.outputs[site][first:stop])


def _compare(engine_a: TorchEngineBase, engine_b: TorchEngineBase, requests: list[ReplayRequest], *,
             a: str, b: str) -> LayerReport:
    structure_a, structure_b = decoder_structure(engine_a.model), decoder_structure(engine_b.model)
    if structure_a.signature() != structure_b.signature():
        raise MismatchError(f"layer localizer: {a} and {b} have different decoder layers; compare two "
                            "configurations of one architecture")
    vocab = engine_b.model.config.vocab_size
    hooks_b = _Hooks(engine_b, structure_b, reference=None)
    hooks_a = _Hooks(engine_a, structure_a, reference=None)
    totals, norms = _Totals(), (structure_a.final_norm, structure_b.final_norm)
    try:
        for request in requests:
            if int(request.tokens.max()) >= vocab:
                raise MismatchError(f"token id {int(request.tokens.max())} is outside the vocabulary "
                                    f"({vocab} ids) of {b}")
            cap_b = hooks_b.span(request)
            hooks_a.reference = cap_b  # a's sub-blocks are re-run on these inputs
            cap_a = hooks_a.span(request)
            # Hidden state at j predicts token j+1: compare the positions whose next token is scored.
            first, stop = max(request.score_from, 1) - 1, len(request.tokens) - 1
            totals.add(cap_a, cap_b, first, stop)
            targets_P = torch.from_numpy(request.tokens[first + 1:stop + 1])
            for index in range(len(structure_b.layers)):
                site = (index, OUTPUT)
                totals.lens[index].add(
                    _logit_lens(engine_a, structure_a.final_norm, cap_a.outputs[site], first, targets_P),
                    _logit_lens(engine_b, structure_b.final_norm, cap_b.outputs[site], first, targets_P))
                totals.lens[index].sum_kl += lens_kl((engine_a, engine_b), norms, (cap_a.outputs[site], cap_b.outputs[site]),
                                                     first, len(targets_P))
    finally:
        hooks_b.remove()
        hooks_a.remove()
    rows = _rows(structure_b, totals)
    embed_error = totals.output[EMBED].rel()
    jump_layer, jump_block, jump_module = _jump(rows, embed_error)
    return LayerReport(a=a, b=b, num_sequences=len(requests), num_tokens=totals.num_tokens,
                       embed_rel_error=embed_error, jump_layer=jump_layer, jump_block=jump_block,
                       jump_module=jump_module, by_layer=tuple(rows), dist_jump_layer=dist_jump(rows))


def _rows(structure: _Structure, totals: _Totals) -> list[LayerRow]:
    kinds = {(index, name): kind for index, blocks in enumerate(structure.blocks) for name, kind, _ in blocks}
    rows: list[LayerRow] = []
    previous = totals.output[EMBED].rel()
    for index in range(len(structure.layers)):
        for site in (s for s in totals.order if s[0] == index):
            output = totals.output[site]
            rows.append(LayerRow(layer=index, block=kinds[site], module=site[1], rel_error=output.rel(),
                                 rel_error_token_max=output.token_max, input_rel_error=totals.input[site].rel(),
                                 local_rel_error=totals.local[site].rel()))
        residual, lens = totals.output[(index, OUTPUT)], totals.lens[index]
        count = max(lens.count, 1)
        rows.append(LayerRow(layer=index, block="residual", module=OUTPUT, rel_error=residual.rel(),
                             rel_error_token_max=residual.token_max, rel_error_increase=residual.rel() - previous,
                             logit_lens_logp_a=lens.sum_logp_a / count, logit_lens_logp_b=lens.sum_logp_b / count,
                             logit_lens_abs_diff=lens.sum_abs_diff / count,
                             logit_lens_abs_diff_max=lens.max_abs_diff, logit_lens_kl=lens.sum_kl / count))
        previous = residual.rel()
    return rows


def _jump(rows: list[LayerRow], embed_error: float) -> tuple[int | None, str | None, str | None]:
    """(jump_layer, jump_block, jump_module) by JUMP_RULE."""
    residual = [row for row in rows if row.block == "residual"]
    increases = [embed_error] + [row.rel_error_increase for row in residual]  # embedding, layer 0, ...
    top = max(range(len(increases)), key=lambda i: increases[i])  # the first of equals
    if increases[top] <= 0:
        return None, None, None
    if top == 0:
        return None, "embed", None
    layer = residual[top - 1].layer
    blocks = [row for row in rows if row.layer == layer and row.block != "residual"]
    if not blocks:
        return layer, None, None
    # Ties (all zero: the layer only amplified what it inherited) go to the biggest amplifier.
    worst = max(blocks, key=lambda row: (row.local_rel_error, row.rel_error - row.input_rel_error))
    return layer, worst.block, worst.module
