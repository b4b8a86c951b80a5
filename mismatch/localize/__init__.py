"""Localizers: where a gap comes from — by turn and position, by layer, by kernel.

`turns` works on the token table (numpy/pandas only); `layers` and `kernels` rerun the model with
hooks (torch), so they are imported only when asked for. `localize_models` runs both for a pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec import UNSET

from mismatch.engines import TORCH_KINDS, ReplayRequest, parse_spec
from mismatch.results.section_records import KernelLocalization, LayerLocalization, LayerRow, Localization
from mismatch.results.summary_model import present

if TYPE_CHECKING:
    from mismatch.localize.layers import LayerReport


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


def localized_what(found: Localization) -> list[str]:
    """One line per localizer: what it found, or what was skipped and why (said, never silent)."""
    lines = []
    for name, block, say in (("layers", found.layers or LayerLocalization(), _layers_found),
                             ("kernels", found.kernels or KernelLocalization(), _kernels_found)):
        lines.append(f"{name}: skipped: {block.skipped}" if block.skipped is not UNSET else f"{name}: {say(block)}")
    split, flips = present(found.layer_types), present(found.index_flips)
    if split:
        shares = ", ".join(f"{t.layer_type} {t.share:.0%}" for t in split.by_type or ())
        lines.append(f"layer types: {split.mechanism or split.lead_type or 'no sub-block differs'} ({shares})")
    if flips:
        removed = present(flips.removed_k3_frac)
        lines.append(f"index flips: {flips.frac_tokens_with_flip:.1%} of tokens after a flipped query carry "
                     f"{flips.k3_share_with_flip or 0:.0%} of k3; index replay removes "
                     + (f"{removed:.0%}" if removed is not None else "nothing measurable")
                     + f" ({flips.replay_selection or 'simulated'} selection)")
    return lines


def _layers_found(block: LayerLocalization) -> str:
    layer, kind, module = present(block.jump_layer), present(block.jump_block), present(block.jump_module)
    if layer is None:
        return ("the embedding output already differs most" if kind == "embed"
                else "both configs agree bit for bit at every layer")
    worst = max((r for r in block.by_layer or () if r.layer == layer and r.module == module),
                key=lambda r: r.local_rel_error or 0.0, default=LayerRow())
    local = worst.local_rel_error
    mean = block.output_logp_abs_diff_mean
    return (f"the error jumps at layer {layer}, {kind} ({module}"
            + (f", local rel_error {local:.3g}" if isinstance(local, (int, float)) else "") + ")"
            + f"; output |Δlog-prob| mean {mean if isinstance(mean, float) else float('nan'):.3g}")


def _kernels_found(block: KernelLocalization) -> str:
    modules = [m for m in block.by_module or () if isinstance(m.rel_error, (int, float))]
    if not modules:
        return "no module compared"
    ranked = sorted(modules, key=lambda m: -m.rel_error)
    if ranked[0].rel_error == 0.0:
        return f"all {len(modules)} modules agree bit for bit fed the same input"
    nonzero = sum(m.rel_error > 0.0 for m in modules)
    top = ", ".join(f"{m.name} (rel_error {m.rel_error:.3g})" for m in ranked[:3] if m.rel_error > 0.0)
    return f"{nonzero} of {len(modules)} modules differ fed the same input; largest: {top}"


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
        report = compare_layers(checkpoint, requests, a=a, b=b, max_tokens=max_tokens)
        out["layers"] = report.to_dict()
        out |= _by_mechanism(checkpoint, requests, report, a=a, b=b)
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


def _by_mechanism(checkpoint: str | Path, requests: list[ReplayRequest], layers: LayerReport, *,
                  a: str, b: str) -> dict[str, Any]:
    """The layers' error split by layer type (every model), and the index flips of a model with
    DSA's indexer (issue #47: hybrids, sparse attention, sinks)."""
    from mismatch.localize.index_flips import has_indexer, index_flips
    from mismatch.localize.layer_types import split_by_layer_type

    out: dict[str, Any] = {"layer_types": split_by_layer_type(checkpoint, layers).to_dict()}
    if has_indexer(str(checkpoint)):
        out["index_flips"] = index_flips(str(checkpoint), requests, a=a, b=b).to_dict()
    return out
