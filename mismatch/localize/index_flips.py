"""Index flips: DeepSeek Sparse Attention's indexer choosing other keys on the two sides, measured
like MoE routing flips, and index replay simulated (one side forced to the other's selection).

Beside `layers` in localize, for a checkpoint with a lightning indexer (DeepSeek-V3.2, GLM-5's
`glm_moe_dsa`) -> `summary.json["localization"]["index_flips"]`.

Terms. A *query* is a fed position q; the indexer's *selection* at q in a layer is the set of keys
(positions <= q) its top-k kept. A query *flips* in a layer when a's selection and b's differ as sets;
a scored token *has a flip* when the query that predicts it (the position before it) flips in any
indexer layer (the convention of `analysis/routing`: the token's own position). The gap of a token is
log_ratio = logp_a - logp_b and its k3 (analysis/terms). *Index replay* reruns a with every indexer's
output replaced by b's selection at the same positions, as `routing=replay` does for experts (and as
vLLM's RFC #48305 lists "DSA index replay" beside R3): what it removes is the gap the flips carried.
When the rollouts carry the sampler's own selections (format v1 `indexer_topk`), a is forced to
those instead, at the positions they were recorded (`replay_selection`: recorded | simulated).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from mismatch.analysis.terms import k3
from mismatch.engines import TORCH_KINDS, ReplayRequest, load_engine, parse_spec
from mismatch.errors import MismatchError, SpecError
from mismatch.localize.model_config import read_model_config


def indexers(model: Any) -> list[Any]:
    """The model's DSA indexers in layer order (empty for a model without sparse attention).
    transformers 5.19 names them `*Indexer` (GlmMoeDsaIndexer, DeepseekV32Indexer); their forward
    returns the top-k key indices [batch, queries, k]."""
    return [module for _, module in model.named_modules() if type(module).__name__.endswith("Indexer")]


class _Selections:
    """Forward hooks on every indexer: record each call's top-k, or replace it with given ones."""

    def __init__(self, model: Any, forced: list[np.ndarray] | None = None) -> None:
        self.modules = indexers(model)
        self.forced = forced               # per layer [positions, k] to serve, in feeding order
        self.calls: list[list[np.ndarray]] = [[] for _ in self.modules]
        self.seen = [0] * len(self.modules)
        self.handles = [module.register_forward_hook(self._hook(layer)) for layer, module in enumerate(self.modules)]

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, output: Any) -> Any:
            import torch

            own = output[0].to("cpu").numpy().astype(np.int64)  # [queries, k'], k' = min(topk, keys)
            num, k = own.shape
            start = self.seen[layer]
            self.seen[layer] += num
            if self.forced is None:
                # A call with fewer keys than top-k (decode's first steps) selected all of them.
                self.calls[layer].append(np.pad(own, ((0, 0), (0, module.index_topk - k)), constant_values=-1))
                return None
            given = self.forced[layer][start:start + num]
            if k < module.index_topk or not len(given):
                return None  # every key is selected on both sides: nothing to force
            chosen = own.copy()
            query = np.arange(start, start + len(given))[:, None]
            # A short query's top-k holds masked (future) keys: keep those on the query itself. A row
            # of -1 is a query whose selection was not recorded: it keeps its own.
            recorded = (given >= 0).any(axis=1, keepdims=True)
            chosen[:len(given)] = np.where(recorded, np.where((given >= 0) & (given <= query), given, query),
                                           own[:len(given)])
            return torch.from_numpy(chosen[None].astype(np.int32)).to(output.device)
        return hook

    def take(self) -> list[np.ndarray]:
        out = [np.concatenate(calls) for calls in self.calls]
        self.calls, self.seen = [[] for _ in self.modules], [0] * len(self.modules)
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _flipped(sel_a: np.ndarray, sel_b: np.ndarray, topk: int) -> np.ndarray:
    """Per query: do a's and b's selections differ as sets? A query with at most top-k keys
    (positions 0..topk-1) selected every key on both sides: never flipped."""
    num = min(len(sel_a), len(sel_b))
    past = np.arange(num) + 1 > topk  # past top-k, every pick is a valid distinct key
    return past & (np.sort(sel_a[:num], axis=1) != np.sort(sel_b[:num], axis=1)).any(axis=1)


@dataclass(kw_only=True, slots=True, frozen=True)
class GapPart:
    """The gap on a set of scored tokens."""

    n_tokens: int
    k3_sum: float
    k3_mean: float | None
    log_ratio_abs_mean: float | None

    @classmethod
    def of(cls, log_ratio: np.ndarray) -> GapPart:
        n = len(log_ratio)
        return cls(n_tokens=n, k3_sum=float(k3(log_ratio).sum()), k3_mean=float(k3(log_ratio).mean()) if n else None,
                   log_ratio_abs_mean=float(np.abs(log_ratio).mean()) if n else None)


@dataclass(kw_only=True, slots=True, frozen=True)
class IndexFlips:
    a: str
    b: str
    index_topk: int
    num_sequences: int
    by_layer: tuple[dict[str, Any], ...]   # {layer, n_queries, n_queries_past_topk, frac_queries_flipped}
    frac_tokens_with_flip: float
    with_flip: GapPart
    without_flip: GapPart
    k3_share_with_flip: float | None       # of the pair's summed k3
    replayed_with_flip: GapPart            # a forced to b's selection, the same tokens
    replayed_without_flip: GapPart
    removed_k3_frac: float | None          # 1 - replayed k3 / own k3, all scored tokens
    replay_selection: str                  # "recorded": the rollouts' indexer_topk; "simulated": b's selection
    num_queries_recorded: int              # queries forced to a recorded selection (0 when simulated)

    def to_dict(self) -> dict[str, Any]:
        from mismatch.results import json_safe

        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = ({g.name: getattr(value, g.name) for g in fields(value)} if isinstance(value, GapPart)
                           else list(value) if isinstance(value, tuple) else value)
        return json_safe(out | {"method": __doc__.split("Terms. ")[1].strip()})


def has_indexer(checkpoint: str) -> bool:
    """Does config.json declare DSA's indexer (an `index_topk`)? Read before any model loads."""
    return read_model_config(checkpoint).language_model.index_topk is not None


def index_flips(checkpoint: str, requests: Sequence[ReplayRequest], *, a: str, b: str,
                max_sequences: int | None = None) -> IndexFlips:
    """Index flips of `a` against reference `b` (torch specs: hf, hf-decode) on the same requests,
    and a rerun of `a` forced to b's selection."""
    for flag, spec in (("a", a), ("b", b)):
        if parse_spec(spec).kind not in TORCH_KINDS:
            raise SpecError(f"index flips: --{flag} {spec} must be a torch engine ({', '.join(TORCH_KINDS)}): "
                            "the indexer's selection is read with hooks")
    requests = list(requests)[:max_sequences]
    recorded = _recorded(checkpoint, requests)
    engine_b = load_engine(b, checkpoint)
    try:
        logp_b, sel_b, topk = _run(engine_b, requests, forced=None)
    finally:
        engine_b.close()
    engine_a = load_engine(a, checkpoint)
    try:
        logp_a, sel_a, _ = _run(engine_a, requests, forced=None)
        forced = sel_b if recorded is None else recorded
        if recorded is not None and len(recorded[0]) != len(sel_b[0]):
            raise MismatchError(f"index replay: the rollouts' indexer_topk has {len(recorded[0])} layers, the "
                                f"checkpoint {len(sel_b[0])} indexers")
        logp_r, _, _ = _run(engine_a, requests, forced=forced)
    finally:
        engine_a.close()
    num_layers = len(sel_b[0]) if sel_b else 0
    flipped_layers = [[_flipped(sel_a[i][layer], sel_b[i][layer], topk) for layer in range(num_layers)]
                      for i in range(len(requests))]
    by_layer = []
    for layer in range(num_layers):
        flips = np.concatenate([f[layer] for f in flipped_layers])
        past = np.concatenate([np.arange(len(f[layer])) + 1 > topk for f in flipped_layers])
        by_layer.append({"layer": layer, "n_queries": int(len(flips)), "n_queries_past_topk": int(past.sum()),
                         "frac_queries_flipped": float(flips.mean()) if len(flips) else None})
    token_flip, ratio, ratio_r = [], [], []
    for i, request in enumerate(requests):
        # Token t (t >= score_from) is predicted by query t - 1.
        any_flip = np.any(np.stack(flipped_layers[i]), axis=0) if num_layers else np.zeros(0, bool)
        queries = np.arange(request.score_from, len(request.tokens)) - 1
        token_flip.append(any_flip[queries] if len(any_flip) else np.zeros(len(queries), bool))
        ratio.append(logp_a[i] - logp_b[i])
        ratio_r.append(logp_r[i] - logp_b[i])
    flip, lr, lr_r = np.concatenate(token_flip), np.concatenate(ratio), np.concatenate(ratio_r)
    keep = ~np.isnan(lr) & ~np.isnan(lr_r)
    flip, lr, lr_r = flip[keep], lr[keep], lr_r[keep]
    with_flip, without_flip = GapPart.of(lr[flip]), GapPart.of(lr[~flip])
    total = with_flip.k3_sum + without_flip.k3_sum
    replayed_total = float(k3(lr_r).sum())
    return IndexFlips(a=a, b=b, index_topk=topk, num_sequences=len(requests), by_layer=tuple(by_layer),
                      frac_tokens_with_flip=float(flip.mean()) if len(flip) else 0.0,
                      with_flip=with_flip, without_flip=without_flip,
                      k3_share_with_flip=with_flip.k3_sum / total if total > 0 else None,
                      replayed_with_flip=GapPart.of(lr_r[flip]), replayed_without_flip=GapPart.of(lr_r[~flip]),
                      removed_k3_frac=1.0 - replayed_total / total if total > 0 else None,
                      replay_selection="simulated" if recorded is None else "recorded",
                      num_queries_recorded=0 if recorded is None else int(sum(
                          (layers[0] >= 0).any(axis=1).sum() for layers in recorded)))


def _recorded(checkpoint: str, requests: list[ReplayRequest]) -> list[list[np.ndarray]] | None:
    """Per request, per layer, the recorded selections [positions, k] (rows of -1 where none), or
    None when no request carries any. Checked before any model loads: the config's top-k, and no
    key after its query (causal attention selects among the keys before it and itself)."""
    if all(request.indexer_topk is None for request in requests):
        return None
    topk = read_model_config(checkpoint).language_model.index_topk
    out = []
    for n, request in enumerate(requests):
        if request.indexer_topk is None:
            out.append(None)
            continue
        selected = request.indexer_topk
        if selected.shape[2] != topk:
            raise MismatchError(f"index replay: request {n}: the rollouts' indexer_topk holds top-{selected.shape[2]} "
                                f"selections, the checkpoint's index_topk is {topk}")
        late = np.argwhere(selected > np.arange(len(selected))[:, None, None])
        if len(late):
            position, layer, _ = (int(x) for x in late[0])
            raise MismatchError(f"index replay: request {n}: indexer_topk at position {position} layer {layer} "
                                f"selects key {int(selected[position, layer].max())}, after its query")
        out.append([selected[:, layer] for layer in range(selected.shape[1])])
    layers = next(len(r) for r in out if r is not None)
    shape = next(r[0].shape[1] for r in out if r is not None)
    return [r if r is not None else [np.full((len(q.tokens), shape), -1, np.int32)] * layers
            for r, q in zip(out, requests)]


def _run(engine: Any, requests: list[ReplayRequest], *, forced: list[list[np.ndarray]] | None
         ) -> tuple[list[np.ndarray], list[list[np.ndarray]], int]:
    """Each request replayed alone: its log-probs and each indexer layer's selection per fed query."""
    modules = indexers(engine.model)
    if not modules:
        raise MismatchError(f"index flips: {type(engine.model).__name__} has no DSA indexer (sparse attention)")
    topk = int(modules[0].index_topk)
    logps, selections = [], []
    for index, request in enumerate(requests):
        with _hooked(engine.model, forced[index] if forced is not None else None) as hooks:
            logps.append(np.asarray(engine.replay([request])[0], dtype=np.float64))
            selections.append(hooks.take() if forced is None else [])
    return logps, selections, topk


@contextmanager
def _hooked(model: Any, forced: list[np.ndarray] | None) -> Iterator[_Selections]:
    hooks = _Selections(model, forced)
    try:
        yield hooks
    finally:
        hooks.remove()


def selections(checkpoint: str, spec: str, requests: Sequence[ReplayRequest]) -> list[np.ndarray]:
    """The indexer selections a torch engine makes on each request, int32 [L, layers, top-k] per
    request (-1 in empty slots): the rows format v1's `indexer_topk` carries, as a sampler records them."""
    engine = load_engine(spec, checkpoint)
    try:
        _, selected, _ = _run(engine, list(requests), forced=None)
    finally:
        engine.close()
    out = []
    for layers in selected:
        rows = np.stack(layers, axis=1).astype(np.int32)
        # A query before the top-k-th key "selects" masked future keys (transformers' top-k over -inf
        # scores): no key there, -1, as an engine that records only real keys writes it.
        rows[rows > np.arange(len(rows))[:, None, None]] = -1
        out.append(np.sort(rows, axis=-1))
    return out
