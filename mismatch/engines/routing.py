"""Mixture-of-experts routing inside the torch engines: which experts each position was sent to,
and Rollout Routing Replay (R3, arXiv 2510.11370): forcing another pass's selection.

transformers >= 5 gives every MoE family one router shape: a `*TopKRouter` / `*TopkRouter` module
whose forward returns `(router_logits, routing_weights, selected_experts)` and that the sparse
block calls once per forward (Qwen3-MoE, Mixtral, DeepSeek-V3, ... at transformers 5.19). The
recorder hooks those modules' outputs; the replay hook replaces the selection and recomputes the
weights from the router's own probabilities, as R3 does in the trainer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mismatch.errors import SpecError

ROUTING_MODES = ("own", "replay")


def routers(model: Any) -> list[Any]:
    """The model's MoE routers in layer order (empty for a dense model)."""
    return [module for _, module in model.named_modules()
            if type(module).__name__.endswith(("TopKRouter", "TopkRouter"))]


class RoutingRecorder:
    """Forward hooks on every router, recording each position's experts; `take()` hands over what
    the forwards since the last take recorded."""

    def __init__(self, model: Any) -> None:
        self.modules = routers(model)
        self._calls: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.modules]
        self._handles = [module.register_forward_hook(self._hook(layer))
                         for layer, module in enumerate(self.modules)]

    def _hook(self, layer: int):
        def record(module: Any, inputs: Any, output: Any) -> None:
            import torch

            logits, _, selected = output
            k = selected.shape[-1]
            scores = choice_scores(module, logits)
            top = scores.topk(min(k + 1, scores.shape[-1]), dim=-1).values
            # Every expert chosen (k = all): no runner-up, so no choice could flip.
            margin = (top[:, k - 1] - top[:, k]) if top.shape[-1] > k else torch.full_like(top[:, 0], torch.inf)
            self._calls[layer].append((selected.sort(dim=-1).values.to("cpu").numpy().astype(np.int16),
                                       margin.to("cpu").numpy().astype(np.float32)))
        return record

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """Everything recorded since the last take, positions in the order they were fed:
        experts [positions, layers, k], margin [positions, layers]."""
        experts = np.stack([np.concatenate([c[0] for c in calls]) for calls in self._calls], axis=1)
        margin = np.stack([np.concatenate([c[1] for c in calls]) for calls in self._calls], axis=1)
        self._calls = [[] for _ in self.modules]
        return experts, margin

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@contextmanager
def forced_routing(model: Any, experts_NEK: Any) -> Iterator[None]:
    """While inside, each router sends position n to experts_NEK[n, layer] (a torch int tensor
    over the positions of the next forward, flattened as the router sees them), with weights
    recomputed by the router's own rule at those experts (`replayed_weights`)."""
    def hook(layer: int):
        def replace(module: Any, inputs: Any, output: Any) -> Any:
            import torch

            logits, weights, _ = output
            chosen = experts_NEK[:, layer, :].to(device=logits.device, dtype=torch.long)
            return logits, replayed_weights(module, logits, chosen).to(weights.dtype), chosen
        return replace

    handles = [module.register_forward_hook(hook(layer)) for layer, module in enumerate(routers(model))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def replayed_weights(module: Any, logits: Any, chosen: Any) -> Any:
    """The weights a router gives experts it did not necessarily choose itself, by its own rule
    (transformers 5.19's router forwards):
    - softmax top-k (Qwen3MoeTopKRouter, MixtralTopKRouter): the softmax over all experts at the
      chosen ones, renormalized over them when norm_topk_prob (Mixtral's router always does);
    - grouped sigmoid (DeepseekV3TopkRouter): the bias e_score_correction_bias and the expert
      groups (n_group, topk_group) only pick; the weights are the sigmoid scores of the chosen
      experts without the bias, divided by their sum (+1e-20) when norm_topk_prob, times
      routed_scaling_factor."""
    import torch

    if hasattr(module, "e_score_correction_bias"):
        weights = logits.float().sigmoid().gather(-1, chosen)
        if module.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * module.routed_scaling_factor
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
    if getattr(module, "norm_topk_prob", True):  # Mixtral's router always normalizes
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choice_scores(module: Any, logits: Any) -> Any:
    """What a router ranks experts by: its logits (softmax is monotone), or for grouped sigmoid
    routing the sigmoid scores plus the selection bias (the group restriction left out)."""
    if hasattr(module, "e_score_correction_bias"):
        return logits.float().sigmoid() + module.e_score_correction_bias.float()
    return logits.float()


def check_mode(mode: str, model: Any) -> None:
    if mode not in ROUTING_MODES:
        raise SpecError(f"option routing={mode!r} is not one of: {', '.join(ROUTING_MODES)}")
    if mode == "replay" and not routers(model):
        raise SpecError("option routing=replay: this model has no MoE router to replay")
