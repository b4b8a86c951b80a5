"""Localizers: where a gap comes from — by turn and position, by layer, by kernel.

`turns` works on the token table (numpy/pandas only); `layers` and `kernels` rerun the model with
hooks (torch), so they are imported only when asked for. `localize_models` runs both for a pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch.engines import ReplayRequest, parse_spec

TORCH_KINDS = ("hf", "hf-decode")


def check_localizable(a: str, b: str, *, flag: str = "--localize") -> None:
    """Refuse up front (before any replay) a model localization that cannot run: the hooks need
    both configs as torch models in this process."""
    from mismatch.errors import MismatchError

    for spec in (a, b):
        kind = parse_spec(spec).kind
        if kind not in TORCH_KINDS:
            raise MismatchError(
                f"{flag}: the layer and kernel localizers hook torch models ({', '.join(TORCH_KINDS)}); "
                f"{spec!r} is {kind!r}. Nearest: localize the torch config closest to it, e.g. the "
                "hf-decode or hf dtype that `mismatch diff` shows closest to your engine")


def localized_what(found: dict[str, Any]) -> list[str]:
    """One line per localizer: what ran, or what was skipped and why (said, never silent)."""
    lines = []
    for name in ("layers", "kernels"):
        block = found.get(name) or {}
        lines.append(f"{name}: skipped: {block['skipped']}" if "skipped" in block else f"{name}: done")
    return lines


def localize_models(checkpoint: str | Path, requests: list[ReplayRequest], *, a: str, b: str,
                    max_tokens: int = 2048) -> dict[str, Any]:
    """`layers` (both torch kinds) and `kernels` (both `hf`: module-local error) for specs a vs b.

    b is the reference. Pairs that are not torch engines (vLLM, http, stored) get a `skipped`
    reason instead: hooks need the model in this process.
    """
    from mismatch.localize.kernels import module_local_errors
    from mismatch.localize.layers import compare_layers

    kinds = (parse_spec(a).kind, parse_spec(b).kind)
    out: dict[str, Any] = {}
    if all(kind in TORCH_KINDS for kind in kinds):
        out["layers"] = compare_layers(checkpoint, requests, a=a, b=b, max_tokens=max_tokens).to_dict()
    else:
        out["layers"] = {"skipped": f"layers need torch engines ({', '.join(TORCH_KINDS)}), got {kinds}"}
    if kinds == ("hf", "hf"):
        token_lists = [request.tokens for request in requests]
        out["kernels"] = module_local_errors(checkpoint, token_lists, reference=b, candidate=a,
                                             max_tokens=max_tokens).to_dict()
    else:
        out["kernels"] = {"skipped": f"module-local error needs two `hf` configs (it compares the same full "
                                     f"forward module by module), got {kinds[0]} and {kinds[1]}"}
    return out
