"""Which truncation (top-p, top-k or min-p, and its parameter) the sampler ran, estimated from the
trainer's own distributions: the audit's step when stored log-probs read as truncated and
meta.sampler declares none (a declared truncation is replayed, never guessed).

Terms. At a scored token t, the stored log-prob is log p(t) − log m with m the kept mass (analysis/
truncation.py), so the observed kept mass is m_obs = p(t) / q(t) = exp(replayed − stored). A
candidate (family, parameter) keeps a set S on the replay's sorted distribution — top-p P: the
smallest head of mass ≥ P; top-k K: the K largest; min-p M: p ≥ M · max p (vLLM's rules,
engines/processing.kept_mask) — and so predicts m̂ = p(S). A candidate explains a token when t is
in S and |log m̂ − log m_obs| ≤ TOLERANCE. The estimate is the candidate that explains the most
tokens; its confidence is that share; its range, the parameters of its family within SLACK of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from mismatch.engines import engine_capabilities, load_engine
from mismatch.errors import SpecError
from mismatch.replay.plan import ReplayPlan
from mismatch.streams import StreamRouting

TOLERANCE = 0.01     # nats of log kept mass: what one precision's two replays can differ by at the cut
SLACK = 0.02         # share of tokens: parameters of the best family this close to it are as good
MAX_TOKENS = 2048    # tokens the estimate reads (its forward, and [tokens, WIDTH] sorted masses)
WIDTH = 2048         # sorted probabilities kept per position: top-k above it cannot be told apart
GRIDS = {
    "top_p": np.round(np.concatenate([np.arange(0.05, 0.5, 0.05), np.arange(0.5, 1.0, 0.01)]), 2),
    "top_k": np.array([*range(1, 65), 80, 100, 128, 200, 256, 500, 512, 1000, 1024, 2000, 2048]),
    "min_p": np.round(np.concatenate([np.arange(0.01, 0.5, 0.01), np.arange(0.5, 1.0, 0.05)]), 2),
}


def support_profiles(plan: ReplayPlan, stored: np.ndarray, spec: str, checkpoint: str | os.PathLike[str],
                     *, max_tokens: int = MAX_TOKENS,
                     forced: Sequence[StreamRouting] | None = None) -> dict[str, np.ndarray]:
    """The replay's sorted distribution at up to `max_tokens` trainable tokens with a stored
    log-prob, taken request by request in table order: cumulative sorted mass [N, W], the token's
    rank and log-prob, and its stored log-prob. The engine gives its hidden states as its replay
    does (`scored_hidden`), under routing=replay following `forced` (one per request, plan order)."""
    import torch

    if not engine_capabilities(spec).processing:
        raise SpecError(f"{spec}: estimating the sampler's truncation needs a torch engine (hf, hf-decode)")
    engine = load_engine(spec, os.fspath(checkpoint))
    trainable = plan.table["trainable"].to_numpy()
    cums, ranks, logps, stores = [], [], [], []
    row, taken = 0, 0
    try:
        for index, request in enumerate(plan.requests):
            rows = slice(row, row + request.num_scored)
            row += request.num_scored
            wanted = np.flatnonzero(trainable[rows] & np.isfinite(stored[rows]))
            wanted = wanted[(request.score_from + wanted) > 0][: max_tokens - taken]
            if not len(wanted):
                continue
            with torch.inference_mode():
                # Row j predicts token first + j, first = max(score_from, 1).
                hidden_ND = engine.scored_hidden(request, forced[index].experts if forced is not None else None)
                positions = torch.from_numpy(request.score_from + wanted)
                first = max(request.score_from, 1)
                logits_NV = engine.lm_head(hidden_ND[(positions - first).to(hidden_ND.device)]).float()
                if engine.softcap is not None:
                    logits_NV = torch.tanh(logits_NV / engine.softcap) * engine.softcap
                probs_NV = torch.softmax(logits_NV, dim=-1).double()
                target_N = torch.from_numpy(request.tokens)[positions].to(probs_NV.device)
                p_N = probs_NV.gather(1, target_N[:, None])
                sorted_NW = torch.topk(probs_NV, min(WIDTH, probs_NV.shape[-1]), dim=-1).values
            cums.append(sorted_NW.cumsum(-1).cpu().numpy())
            ranks.append((probs_NV > p_N).sum(-1).cpu().numpy())
            logps.append(np.log(p_N[:, 0].cpu().numpy()))
            stores.append(stored[rows][wanted])
            taken += len(wanted)
            if taken >= max_tokens:
                break
    finally:
        engine.close()
    if not cums:
        return {"cum": np.empty((0, 1)), "rank": np.empty(0, np.int64), "logp": np.empty(0), "stored": np.empty(0)}
    return {"cum": np.concatenate(cums), "rank": np.concatenate(ranks), "logp": np.concatenate(logps),
            "stored": np.concatenate(stores)}


def predicted_mass(cum: np.ndarray, rank: np.ndarray, family: str, value: float) -> tuple[np.ndarray, np.ndarray]:
    """(m̂ [N], token kept [N]) of one candidate on the sorted cumulative masses `cum` [N, W]."""
    width = cum.shape[1]
    if family == "top_p":
        last = (cum < value).sum(axis=1)  # index of the token whose mass reaches the head's P
    elif family == "top_k":
        last = np.full(len(cum), int(value) - 1)
    else:  # min_p: p >= value * max p, on the sorted masses' steps
        sorted_p = np.diff(cum, axis=1, prepend=0.0)
        last = (sorted_p >= value * sorted_p[:, :1]).sum(axis=1) - 1
    known = last < width
    mass = np.where(known, cum[np.arange(len(cum)), np.minimum(last, width - 1)], np.nan)
    return mass, known & (rank <= last)


def estimate_truncation(profiles: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """The candidate that explains the most tokens (module docstring), with its confidence, its
    family's range within SLACK, and the best of each other family; None without tokens."""
    cum, rank = profiles["cum"], profiles["rank"]
    if not len(cum):
        return None
    log_observed = profiles["logp"] - profiles["stored"]  # log m_obs
    scores: dict[str, np.ndarray] = {}
    for family, grid in GRIDS.items():
        shares = []
        for value in grid:
            mass, kept = predicted_mass(cum, rank, family, float(value))
            with np.errstate(invalid="ignore", divide="ignore"):
                close = np.abs(np.log(mass) - log_observed) <= TOLERANCE
            shares.append(float(np.mean(kept & close)))
        scores[family] = np.array(shares)
    best_family = max(scores, key=lambda name: float(scores[name].max()))
    best = scores[best_family]
    index = int(best.argmax())
    near = GRIDS[best_family][best >= best[index] - SLACK]
    return {"kind": best_family, "value": _plain(GRIDS[best_family][index]), "confidence": float(best[index]),
            "range": [_plain(near.min()), _plain(near.max())], "n_tokens": int(len(cum)),
            "tolerance_nats": TOLERANCE,
            "others": {name: {"value": _plain(GRIDS[name][int(s.argmax())]), "confidence": float(s.max())}
                       for name, s in scores.items() if name != best_family}}


def _plain(value: Any) -> float | int:
    return int(value) if float(value).is_integer() and value >= 1 else float(value)


def sampler_truncation(plan: ReplayPlan, meta: dict[str, Any] | None, spec: str,
                       checkpoint: str | os.PathLike[str], *,
                       forced: Sequence[StreamRouting] | None = None) -> dict[str, Any]:
    """summary `alignment.truncation`'s `declared`, `estimate`, `declared_fit` and `replayed` (the
    Sampling the like-for-like column replays, as a dict) for stored log-probs that read as
    truncated: what meta.sampler declares is replayed as declared; the estimate is made either way,
    so a declaration the data do not fit (`declared_fit`: the share of tokens it explains, for a
    declaration of one family) is told, not silently replayed. `forced`: the experts a routing=replay
    trainer followed (support_profiles)."""
    from dataclasses import asdict

    from mismatch.streams import Sampling

    declared = Sampling.from_meta(meta)
    profiles = support_profiles(plan, plan.stored["sampler"], spec, checkpoint, forced=forced)
    estimate = estimate_truncation(profiles)
    estimated = Sampling(temperature=declared.temperature,
                         **({estimate["kind"]: estimate["value"]} if estimate is not None else {}))
    if not declared.truncates:
        return {"declared": None, "declared_fit": None, "estimate": estimate, "replayed": asdict(estimated),
                "replayed_from": "estimate"}
    fit = declared_fit(profiles, declared)
    # A declaration the data refute would make the like-for-like pair measure the wrong set (and
    # blame the sampler's weights for it): that pair then replays the estimate, and says so.
    wrong = misdeclared(fit, estimate["confidence"] if estimate is not None else None)
    return {"declared": asdict(declared.truncation), "declared_fit": fit, "estimate": estimate,
            "replayed": asdict(estimated if wrong else declared),
            "replayed_from": "estimate (the declaration does not fit)" if wrong else "declared"}


# The share of stored log-probs a truncation estimated on the replay's own distributions must explain
# before an undeclared truncation is read as one (real top-p/top-k/min-p samples: 92-100%, RESULTS.md).
TRUNCATION_EXPLAINED = 0.5


def truncation_explained(found: dict[str, Any]) -> bool:
    """Whether sampler_truncation's answer is a truncation: declared, or estimated with a kept set of
    this model's that explains at least TRUNCATION_EXPLAINED of the tokens (stored log-probs that sit
    above the replay's with no such set, another model's say, are not one)."""
    estimate = found["estimate"]
    return found["declared"] is not None or (estimate is not None and estimate["confidence"] >= TRUNCATION_EXPLAINED)


def misdeclared(fit: float | None, confidence: float | None) -> bool:
    """A declaration the data do not fit: it explains under 90% of the tokens (`fit`) and the
    estimate (its `confidence`) at least 10 points more."""
    return fit is not None and confidence is not None and fit < 0.9 and confidence >= fit + 0.1


def declared_fit(profiles: dict[str, np.ndarray], declared: Any) -> float | None:
    """The share of tokens a declared truncation of one family explains (as a candidate of
    estimate_truncation would); None for none, or for several families at once."""
    active = [(family, value) for family, value in (("top_p", declared.top_p), ("top_k", declared.top_k),
                                                     ("min_p", declared.min_p))
              if (family == "top_p" and value < 1) or (family != "top_p" and value > 0)]
    if len(active) != 1 or not len(profiles["cum"]):
        return None
    family, value = active[0]
    mass, kept = predicted_mass(profiles["cum"], profiles["rank"], family, float(value))
    with np.errstate(invalid="ignore", divide="ignore"):
        close = np.abs(np.log(mass) - (profiles["logp"] - profiles["stored"])) <= TOLERANCE
    return float(np.mean(kept & close))
