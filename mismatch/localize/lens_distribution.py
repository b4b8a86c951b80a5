"""The layer localizer's read-out of the whole next-token distribution (--distribution's question,
asked layer by layer): each layer's residual through each configuration's own final norm and
lm_head, compared over every token, and the layer where that gap rises most (localize/layers.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DIST_JUMP_RULE = ("dist_jump_layer = the layer whose logit-lens read-out of the whole next-token distribution "
                  "(each configuration's own final norm and lm_head) has the largest rise in mean KL(a‖b) over "
                  "the previous layer's (layer 0: over 0); null when every read-out agrees. It localizes a gap "
                  "off the sampled tokens too; a head that differs moves every layer's read-out, so it shows at "
                  "layer 0")


def lens_kl(engines: tuple[Any, Any], norms: tuple[nn.Module, nn.Module], hidden: tuple[torch.Tensor, torch.Tensor],
            first: int, count: int) -> float:
    """Σ over positions first..first+count-1 of KL(a‖b) between the two read-outs' whole
    distributions (each side's engine, final norm and residual [L, D]), a chunk of positions at a
    time (replay/distribution.py's CHUNK_ELEMENTS)."""
    from mismatch.replay.distribution import CHUNK_ELEMENTS

    engine_a, engine_b = engines
    norm_a, norm_b = norms
    hidden_a_LD, hidden_b_LD = hidden

    total = 0.0
    with torch.inference_mode():
        normed_a = norm_a(hidden_a_LD[None])[0, first:first + count]
        normed_b = norm_b(hidden_b_LD[None])[0, first:first + count]
        step = max(1, CHUNK_ELEMENTS // engine_b.model.config.vocab_size)
        for start in range(0, count, step):
            logp_a = engine_a.full_rows(normed_a[start:start + step]).logp_CV.double()
            logp_b = engine_b.full_rows(normed_b[start:start + step]).logp_CV.double()
            terms = torch.where(logp_a > float("-inf"), logp_a.exp() * (logp_a - logp_b), 0.0)
            total += float(terms.sum())
    return total


def dist_jump(rows: list[Any]) -> int | None:
    """DIST_JUMP_RULE's layer."""
    residual = [row for row in rows if row.block == "residual" and row.logit_lens_kl is not None]
    rises = [(row.logit_lens_kl - (residual[k - 1].logit_lens_kl if k else 0.0), row.layer)
             for k, row in enumerate(residual)]
    best = max(rises, default=(0.0, None), key=lambda item: item[0])
    return best[1] if best[0] > 0 else None

