"""Module-local error: how much gap each kernel *introduces* between two torch configurations.

The kernel step of localize (after turns and layers): every leaf module of the candidate runs on
the reference's own input, so its error is its own, not inherited; gives `localization.kernels`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mismatch.checkpoint import checkpoint_info, load_model
from mismatch.engines.hf import HFOptions, resolve_device
from mismatch.engines.logprobs import token_logprobs
from mismatch.engines.spec import options_from, parse_spec
from mismatch.errors import CheckpointError, MismatchError, SpecError

LM_HEAD = "lm_head"
LM_HEAD_TYPE = "lm_head+log_softmax"
METHOD = ("each module of the candidate is fed the reference's captured input (cast to the "
          "candidate's dtype) and its output is compared with the reference's output; "
          "rel_error = ||out_c - out_r|| / ||out_r|| over all replayed tokens")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModuleResult:
    name: str            # e.g. "model.layers.0.self_attn.q_proj"
    type: str            # Linear | RMSNorm | Embedding | RoPE | attention | SiLU-mul | lm_head+log_softmax
    rel_error: float     # ||out_c - out_r|| / ||out_r||, pooled over all tokens
    max_abs: float       # max |out_c - out_r| (for lm_head+log_softmax: max |Δlogp| of the realized token)
    # ||round(out_r) - out_r|| / ||out_r||, rounding to the candidate's output dtype: the error a
    # perfect kernel would still show, because the candidate cannot store the reference's values.
    # None for lm_head+log_softmax, whose log-probs are computed in fp32 in both configurations.
    rounding_floor: float | None
    num_elements: int
    # Fused MoE experts: rel_error over the tokens routed to each expert (by the reference), so a
    # fault in one expert of a 3-D weight tensor is named by its index. None for other modules.
    by_expert: list[float | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "type": self.type, "rel_error": self.rel_error,
               "max_abs": self.max_abs, "rounding_floor": self.rounding_floor,
               "num_elements": self.num_elements}
        if self.by_expert is not None:
            out["by_expert"] = self.by_expert
            ranked = [e for e in range(len(self.by_expert)) if self.by_expert[e] is not None]
            out["worst_expert"] = max(ranked, key=lambda e: self.by_expert[e]) if ranked else None
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class TypeResult:
    type: str
    num_modules: int
    rel_error: float      # pooled over every module of this type
    rel_error_max: float  # the worst single module
    max_abs: float

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "num_modules": self.num_modules, "rel_error": self.rel_error,
                "rel_error_max": self.rel_error_max, "max_abs": self.max_abs}


@dataclass(kw_only=True, slots=True, frozen=True)
class KernelReport:
    reference: str
    candidate: str
    num_sequences: int
    num_tokens: int
    by_module: tuple[ModuleResult, ...]  # ranked: most introduced error first, ties by name
    by_type: tuple[TypeResult, ...]      # ranked the same way

    def to_dict(self) -> dict[str, Any]:
        """The `summary.json["localization"]["kernels"]` object."""
        return {"reference": self.reference, "candidate": self.candidate, "method": METHOD,
                "num_sequences": self.num_sequences, "num_tokens": self.num_tokens,
                "by_module": [m.to_dict() for m in self.by_module],
                "by_type": [t.to_dict() for t in self.by_type]}


@dataclass(slots=True)
class _Tally:
    """Running sums for one module; sums are float64 so the measurement adds no rounding."""

    type: str
    has_floor: bool = True
    sum_sq_diff: float = 0.0
    sum_sq_ref: float = 0.0
    sum_sq_floor: float = 0.0
    max_abs: float = 0.0
    num_elements: int = 0
    expert_sq_diff: dict[int, float] = field(default_factory=dict)
    expert_sq_ref: dict[int, float] = field(default_factory=dict)

    def add_by_expert(self, out_c: torch.Tensor, out_r: torch.Tensor, experts_NK: torch.Tensor) -> None:
        """Per expert: the squared error and norm of the output rows of the tokens routed to it."""
        ref = out_r.to("cpu", torch.float64).reshape(len(experts_NK), -1)
        diff = out_c.to("cpu", torch.float64).reshape(len(experts_NK), -1) - ref
        row_diff, row_ref = diff.square().sum(dim=1), ref.square().sum(dim=1)
        experts = experts_NK.to("cpu", torch.long)
        for expert in torch.unique(experts).tolist():
            rows = (experts == expert).any(dim=1)
            self.expert_sq_diff[expert] = self.expert_sq_diff.get(expert, 0.0) + float(row_diff[rows].sum())
            self.expert_sq_ref[expert] = self.expert_sq_ref.get(expert, 0.0) + float(row_ref[rows].sum())

    def add(self, out_c: torch.Tensor, out_r: torch.Tensor) -> None:
        assert out_c.shape == out_r.shape, (out_c.shape, out_r.shape)
        ref = out_r.to("cpu", torch.float64)
        diff = out_c.to("cpu", torch.float64) - ref
        floor = out_r.to(out_c.dtype).to("cpu", torch.float64) - ref
        self.sum_sq_diff += float(diff.square().sum())
        self.sum_sq_ref += float(ref.square().sum())
        self.sum_sq_floor += float(floor.square().sum())
        self.max_abs = max(self.max_abs, float(diff.abs().max()) if diff.numel() else 0.0)
        self.num_elements += diff.numel()

    def result(self, name: str) -> ModuleResult:
        by_expert = None
        if self.expert_sq_ref:
            by_expert = [_ratio(self.expert_sq_diff[e], self.expert_sq_ref[e]) if e in self.expert_sq_ref else None
                         for e in range(max(self.expert_sq_ref) + 1)]
        return ModuleResult(name=name, type=self.type, rel_error=_ratio(self.sum_sq_diff, self.sum_sq_ref),
                            max_abs=self.max_abs,
                            rounding_floor=_ratio(self.sum_sq_floor, self.sum_sq_ref) if self.has_floor else None,
                            num_elements=self.num_elements, by_expert=by_expert)


def _ratio(sum_sq_num: float, sum_sq_den: float) -> float:
    if sum_sq_num == 0.0:
        return 0.0
    return math.sqrt(sum_sq_num / sum_sq_den) if sum_sq_den else math.inf


@dataclass(slots=True)
class _Capture:
    """One call of a hooked module: its floating-point inputs and outputs (and, for SWAP_INTEGERS
    units, its integer ones). A module may run several times in one forward (Gemma-3 computes
    its rotary tables once per attention type): one capture per call, in call order."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    int_inputs: list[torch.Tensor] = field(default_factory=list)
    int_outputs: list[torch.Tensor] = field(default_factory=list)


def leaf_type(module: nn.Module) -> str | None:
    """The kernel type of a module hooked as a unit; None for modules run between hooked ones."""
    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    name = type(module).__name__
    if name.endswith("RMSNorm"):
        return "RMSNorm"
    if name.endswith("RotaryEmbedding"):  # the cos/sin tables; the rotation itself is in "attention"
        return "RoPE"
    if name.endswith(("TopKRouter", "TopkRouter")):  # MoE: router logits, weights and the chosen experts
        return "Router"
    if name.endswith("Experts"):  # MoE: every expert's MLP, fused 3-D weights included (transformers >= 5)
        return "Experts"
    return None  # activations: act(gate)*up is measured as a whole at down_proj's input


# Units whose integer tensors are part of what flows on (a router's chosen experts, the experts'
# routing input): the candidate gets the reference's, as R3 does, so an expert is measured on the
# tokens the reference sent it, and a router flip does not spill into every module after it.
SWAP_INTEGERS = ("Router", "Experts")


def hooked_leaves(model: nn.Module) -> dict[str, str]:
    """Name → kernel type of the decoder's leaf modules (lm_head is measured with log_softmax)."""
    decoder = model.base_model
    return {name: kind for name, module in decoder.named_modules(prefix=model.base_model_prefix)
            if (kind := leaf_type(module)) is not None and _is_unit(module, kind)}


def _is_unit(module: nn.Module, kind: str) -> bool:
    """A leaf, or fused experts (their only children are activations, which hold no weights)."""
    if kind == "Experts":
        return not any(isinstance(child, nn.Linear) for child in module.modules() if child is not module)
    return not any(True for _ in module.children())


def gap_points(model: nn.Module) -> dict[str, tuple[str, str]]:
    """Code that runs *between* hooked modules, measured at the input of the module after it.

    Name of the consumer → (reported name, type). Between q/k/v_proj and o_proj run RoPE's rotation
    and the attention kernel (SDPA, eager or flash); between gate/up_proj and down_proj runs
    act(gate) * up. Their producers' outputs are replaced by the reference's, so what reaches the
    consumer is that code's module-local output.
    """
    # Gemma names its activation hidden_activation (hidden_act is a deprecated alias it ignores).
    act = str(getattr(model.config, "hidden_activation", None) or getattr(model.config, "hidden_act", "act"))
    mul_type = "SiLU-mul" if act == "silu" else f"{act}-mul"
    points: dict[str, tuple[str, str]] = {}
    for name, module in model.base_model.named_modules(prefix=model.base_model_prefix):
        if isinstance(getattr(module, "o_proj", None), nn.Linear):
            points[f"{name}.o_proj"] = (name, "attention")
        if isinstance(getattr(module, "down_proj", None), nn.Linear):
            points[f"{name}.down_proj"] = (name, mul_type)
    return points


def _floats(tree: Any) -> list[torch.Tensor]:
    return _collect(tree, floating=True)


def _integers(tree: Any) -> list[torch.Tensor]:
    return _collect(tree, floating=False)


def _collect(tree: Any, *, floating: bool) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(tree, lambda tensor: (found.append(tensor), tensor)[1], floating=floating)
    return found


def _map_floats(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return _map_tensors(tree, fn, floating=True)


def _map_integers(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """As _map_floats, for the integer tensors (expert indices)."""
    return _map_tensors(tree, fn, floating=False)


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor], *, floating: bool) -> Any:
    """Rebuild tuples/lists/dicts with every floating-point (or every other) tensor replaced by
    fn(tensor), in order."""
    if isinstance(tree, torch.Tensor):
        return fn(tree) if tree.is_floating_point() == floating else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_tensors(item, fn, floating=floating) for item in tree)
    if isinstance(tree, dict):
        return {key: _map_tensors(value, fn, floating=floating) for key, value in tree.items()}
    return tree


def _cast_like(sources: Iterator[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: next(sources).to(device=t.device, dtype=t.dtype)


@contextmanager
def _hooked(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _reference_pass(model: nn.Module, ids_1L: torch.Tensor,
                    leaves: dict[str, str]) -> tuple[dict[str, list[_Capture]], torch.Tensor]:
    captures: dict[str, list[_Capture]] = {name: [] for name in leaves}
    modules = dict(model.named_modules())

    def pre(name: str):
        def hook(module, args, kwargs):
            captures[name].append(_Capture(inputs=_floats((args, kwargs)), outputs=[],
                                           int_inputs=_integers((args, kwargs))))
        return hook

    def post(name: str):
        def hook(module, args, output):
            captures[name][-1].outputs = _floats(output)
            captures[name][-1].int_outputs = _integers(output)
        return hook

    handles = [h for name in leaves for h in (
        modules[name].register_forward_pre_hook(pre(name), with_kwargs=True),
        modules[name].register_forward_hook(post(name)))]
    with _hooked(handles):
        hidden_1LD = model.base_model(input_ids=ids_1L, use_cache=False).last_hidden_state
    return captures, hidden_1LD


def _candidate_pass(model: nn.Module, ids_1L: torch.Tensor, leaves: dict[str, str],
                    gaps: dict[str, tuple[str, str]], captures: dict[str, list[_Capture]],
                    tallies: dict[str, _Tally]) -> None:
    """Forward the candidate with every hooked module's inputs and outputs swapped for the reference's.

    Swapping inputs makes each module's error its own; swapping outputs too means the code between
    modules (RoPE rotation + attention kernel, act*up) also starts from the reference's values.
    """
    modules = dict(model.named_modules())
    calls = {name: -1 for name in leaves}  # the call of each module now running

    def pre(name: str):
        def hook(module, args, kwargs):
            calls[name] += 1
            capture = captures[name][calls[name]]
            if name in gaps:  # what arrives here was computed by the code between modules
                tallies[gaps[name][0]].add(_floats((args, kwargs))[0], capture.inputs[0])
            swapped = _map_floats((args, kwargs), _cast_like(iter(capture.inputs)))
            if leaves[name] in SWAP_INTEGERS:
                swapped = _map_integers(swapped, _cast_like(iter(capture.int_inputs)))
            return swapped
        return hook

    def post(name: str):
        def hook(module, args, output):
            capture = captures[name][calls[name]]
            for out_c, out_r in zip(_floats(output), capture.outputs, strict=True):
                tallies[name].add(out_c, out_r)
            if leaves[name] == "Experts" and capture.int_inputs:  # the reference's routing: [tokens, k]
                tallies[name].add_by_expert(_floats(output)[0], capture.outputs[0], capture.int_inputs[0])
            swapped = _map_floats(output, _cast_like(iter(capture.outputs)))
            if leaves[name] in SWAP_INTEGERS:
                swapped = _map_integers(swapped, _cast_like(iter(capture.int_outputs)))
            return swapped
        return hook

    handles = [h for name in leaves for h in (
        modules[name].register_forward_pre_hook(pre(name), with_kwargs=True),
        modules[name].register_forward_hook(post(name)))]
    with _hooked(handles):
        # The candidate builds its own attention mask: its form depends on the attention kernel.
        model.base_model(input_ids=ids_1L, use_cache=False)


def load_torch_config(spec_text: str, checkpoint: str | Path) -> tuple[nn.Module, HFOptions]:
    """Model of an `hf` spec (`hf:dtype=bfloat16,attn=eager,checkpoint=...`)."""
    spec = parse_spec(spec_text)
    if spec.kind != "hf":
        raise SpecError(f"module-local errors need torch configurations of kind 'hf' "
                        f"(e.g. hf:dtype=bfloat16), got {spec.text!r}")
    options = options_from(HFOptions, spec)
    info = checkpoint_info(options.checkpoint or checkpoint)
    model = load_model(info, dtype=options.dtype, attn=options.attn, device=resolve_device(options.device))
    return model, options


def budgeted(token_lists: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Sequences in order, the last one cut so the total stays within max_tokens; <2 tokens skipped."""
    kept: list[list[int]] = []
    left = max_tokens
    for tokens in token_lists:
        cut = [int(t) for t in tokens[:left]]
        if len(cut) >= 2:  # one prediction needs two tokens
            kept.append(cut)
            left -= len(cut)
        if left < 2:
            break
    return kept


def module_local_errors(checkpoint: str | Path, token_lists: Sequence[Sequence[int]], *,
                        reference: str = "hf:dtype=float32", candidate: str = "hf:dtype=bfloat16",
                        max_tokens: int = 512) -> KernelReport:
    """Error each module introduces in `candidate` relative to `reference`, ranked.

    Both specs are `hf` engine specs on `checkpoint` (or their own `checkpoint=`). Each sequence is
    replayed alone (batch 1), at most `max_tokens` tokens in all; one sequence's module inputs and
    outputs are held in memory at a time (about 2 x layers x 8 x tokens x hidden floats).
    """
    sequences = budgeted(token_lists, max_tokens)
    if not sequences:
        raise MismatchError("module-local errors need at least one sequence of 2 or more tokens")
    ref_model, ref_options = load_torch_config(reference, checkpoint)
    cand_model, cand_options = load_torch_config(candidate, checkpoint)
    leaves = hooked_leaves(ref_model)
    gaps = gap_points(ref_model)
    if leaves != hooked_leaves(cand_model):
        raise CheckpointError(f"{reference!r} and {candidate!r} load models with different modules; "
                              "module-local errors compare two configurations of one architecture")
    tallies = {name: _Tally(type=kind) for name, kind in leaves.items()}
    tallies.update({name: _Tally(type=kind) for name, kind in gaps.values()})
    tallies[LM_HEAD] = _Tally(type=LM_HEAD_TYPE, has_floor=False)
    softcap = getattr(ref_model.config, "final_logit_softcapping", None)
    ref_device = next(ref_model.parameters()).device
    cand_param = next(cand_model.parameters())
    with torch.inference_mode():
        for tokens in sequences:
            ids_L = torch.tensor(tokens, dtype=torch.long)
            captures, hidden_1LD = _reference_pass(ref_model, ids_L[None].to(ref_device), leaves)
            _candidate_pass(cand_model, ids_L[None].to(cand_param.device), leaves, gaps, captures, tallies)
            # lm_head + log_softmax on the reference's final hidden state, exactly as the engines score.
            hidden_ND = hidden_1LD[0, :-1]
            logp_r = token_logprobs(hidden_ND, ids_L[1:], ref_model.get_output_embeddings(),
                                    chunk=ref_options.chunk, softcap=softcap)
            logp_c = token_logprobs(hidden_ND.to(cand_param.device, cand_param.dtype), ids_L[1:],
                                    cand_model.get_output_embeddings(), chunk=cand_options.chunk,
                                    softcap=softcap)
            tallies[LM_HEAD].add(logp_c, logp_r)
    by_module = sorted((tally.result(name) for name, tally in tallies.items()),
                       key=lambda m: (-m.rel_error, m.name))
    return KernelReport(reference=reference, candidate=candidate, num_sequences=len(sequences),
                        num_tokens=sum(map(len, sequences)), by_module=tuple(by_module),
                        by_type=tuple(_by_type(tallies)))


def _by_type(tallies: dict[str, _Tally]) -> list[TypeResult]:
    groups: dict[str, list[tuple[str, _Tally]]] = {}
    for name, tally in tallies.items():
        groups.setdefault(tally.type, []).append((name, tally))
    results = [TypeResult(type=kind, num_modules=len(members),
                          rel_error=_ratio(sum(t.sum_sq_diff for _, t in members),
                                           sum(t.sum_sq_ref for _, t in members)),
                          rel_error_max=max(t.result(name).rel_error for name, t in members),
                          max_abs=max(t.max_abs for _, t in members))
               for kind, members in groups.items()]
    return sorted(results, key=lambda t: (-t.rel_error, t.type))
