"""The evidence readers the cause rules (diagnose.py) share: what each side ran, where the
localizers confine an error (layer, module, expert), what the batch-shape probes show, and the
words a cause says them in."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mismatch.results.section_records import ModuleError
from mismatch.results.summary_model import CauseWhere, ProbeResult, SamplerDeclaration, Summary, present
from mismatch.engines import TORCH_KINDS

OUTLIER = 10.0   # a module's error this many times the median module's (and its rounding floor)
MAX_CONFINED = 3  # at most this many modules (or a tenth of them) for "confined to a few modules"
_LAYER = re.compile(r"layers\.(\d+)\.")
# Probe variations that change with what else is in the batch (probes/result.py SOURCES).
BATCH_SOURCES = ("batch_size", "chunking", "split_kv")


@dataclass(kw_only=True, slots=True, frozen=True)
class Side:
    """What one source ran: engine kind, dtype, attention, and which weights (None: not known).
    `replayed`: the source ran a model here; a stored stream (the sampler's, or one replayed as an
    engine: `--infer sampler`, `stored:NAME`) was not, so it is never evidence of how it was made."""

    source: str
    kind: str | None
    dtype: str | None
    attn: str | None
    weights: str | None
    replayed: bool = True

    def differs(self, other: Side) -> dict[str, tuple[Any, Any]]:
        """The facts both sides know that differ: {fact: (this side's, the other's)}."""
        known = {"dtype": (self.dtype, other.dtype), "engine": (self.kind, other.kind),
                 "attn": (self.attn, other.attn)}
        return {name: pair for name, pair in known.items() if None not in pair and pair[0] != pair[1]}


def sides(summary: Summary) -> dict[str, Side]:
    out = {}
    for source in summary.engines:
        engine = summary.engine(source)
        if source == "sampler":  # stored log-probs: what meta.sampler declares of the engine that sampled
            out[source] = _declared_side(source, summary.declared)
            continue
        if engine.kind == "stored":
            # A stored stream replayed as an engine (`--infer sampler`, `--train stored:trainer_old`): the
            # sampler's stream is the sampler's engine; another stored stream's engine is not known.
            out[source] = _declared_side(source, summary.declared if engine.name == "sampler" else SamplerDeclaration())
            continue
        torch = engine.kind in TORCH_KINDS
        out[source] = Side(source=source, kind=_text(present(engine.kind)), dtype=_dtype(present(engine.dtype)),
                           attn=_text(present(engine.attn)) if torch else None,
                           weights=str(present(engine.checkpoint) or summary.checkpoint or "") or None)
    return out


def _declared_side(source: str, declared: SamplerDeclaration) -> Side:
    return Side(source=source, kind=_text(present(declared.engine)), dtype=_dtype(present(declared.dtype)),
                attn=_text(present(declared.attn)), weights=None, replayed=False)


def _text(value: Any) -> str | None:
    return str(value) if value not in (None, "", "auto") else None


def _dtype(value: Any) -> str | None:
    text = _text(value)
    if text is None:
        return None
    text = text.removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(text, text)


@dataclass(kw_only=True, slots=True, frozen=True)
class Confinement:
    """Where the localizers confine an error (`located`'s layers, modules, experts and words), and
    the evidence in words."""

    where: CauseWhere
    words: str


def confined(summary: Summary) -> Confinement | None:
    """The train/infer error confined to a few modules by the kernel localizer (module by module,
    each fed the same input), else by the layer localizer's sub-blocks."""
    localization = summary.localization
    modules = [m for m in (localization.kernels.by_module or []) if isinstance(m.rel_error, (int, float))] \
        if localization.kernels else []
    if modules:
        out = _outliers([(m.name, m.rel_error, present(m.rounding_floor) or 0.0) for m in modules])
        if out is None:
            return None
        experts = []
        for module in modules:
            if module.name in out and module.by_expert:
                expert = _outlying_expert(module.by_expert)
                if expert is not None:
                    experts.append(f"{module.name}[{expert}]")
        named = {m.name: m for m in modules}
        words = ("the kernel localizer (each module fed the same input) finds error only in "
                 + ", ".join(f"{name} (rel_error {named[name].rel_error:.3g})" for name in out)
                 + (f", expert {', '.join(experts)}" if experts else "")
                 + f"; every other of {len(modules)} modules at most {_others_max(modules, out)}")
        return Confinement(where=located(out, experts), words=words)
    rows = [r for r in (localization.layers.by_layer or []) if r.block != "residual"
            and isinstance(r.local_rel_error, (int, float))] if localization.layers else []
    if not rows:
        return None
    names = [(f"model.layers.{r.layer}.{r.module}", r.local_rel_error, 0.0) for r in rows]
    out = _outliers(names)
    if out is None:
        return None
    values = dict((name, error) for name, error, _ in names)
    words = ("the layer localizer finds error introduced only in "
             + ", ".join(f"{name} (local rel_error {values[name]:.3g})" for name in out)
             + f"; every other sub-block at most {max((v for n, v in values.items() if n not in out), default=0):.3g}")
    return Confinement(where=located(out, []), words=words)


def _outliers(errors: list[tuple[str, float, float]]) -> list[str] | None:
    """The names whose error stands out: over OUTLIER times the median error and their own rounding
    floor, when they are few (at most MAX_CONFINED, or a tenth of all)."""
    values = sorted(error for _, error, _ in errors)
    if not values or values[-1] <= 0.0:
        return None
    median = values[len(values) // 2]
    out = [name for name, error, floor in errors if error > OUTLIER * max(median, floor) and error > 0.0]
    if not out or len(out) > max(MAX_CONFINED, len(errors) // 10):
        return None
    return sorted(out, key=lambda name: -dict((n, e) for n, e, _ in errors)[name])


def _outlying_expert(by_expert: list[float | None]) -> int | None:
    found = [(e, value) for e, value in enumerate(by_expert) if isinstance(value, (int, float))]
    out = _outliers([(str(e), value, 0.0) for e, value in found])
    return int(out[0]) if out is not None and len(out) == 1 else None


def _others_max(modules: list[ModuleError], out: list[str]) -> str:
    return f"{max((m.rel_error for m in modules if m.name not in out), default=0.0):.3g}"


def located(names: list[str], experts: list[str]) -> CauseWhere:
    """A cause's `where` for the tensors it names: their layers, modules and experts, and the words
    that say it."""
    layers = sorted({int(m.group(1)) for name in names if (m := _LAYER.search(name))})
    modules = [name.removesuffix(".weight").removesuffix(".bias") for name in names]
    words = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
    if layers:
        words = f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} ({words})"
    if experts:
        words += f", expert {', '.join(experts[:3])}"
    return CauseWhere(layers=layers, modules=modules[:10], experts=experts[:10], words=words)


def batch_variant_from_probes(probes: list[ProbeResult]) -> bool | None:
    """True when an applicable batch-shape probe is not bitwise equal; None when none ran."""
    relevant = [p for p in probes if p.source in BATCH_SOURCES and p.applicable
                and isinstance(p.bitwise_equal_frac, (int, float))]
    if not relevant:
        return None
    return any(p.bitwise_equal_frac < 1.0 for p in relevant)


def facts(differs: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{name} {a} vs {b}" for name, (a, b) in differs.items())


def fact_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{value} {name}" for name, value in counts.items()) or "kinds not recorded"


def listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(map(str, names[:limit]))
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def kl_words(summary: Summary, pair: str) -> str:
    value = summary.metric(pair, "kl_k3")
    return three_digits(value)


def three_digits(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "n/a"


def sampler_spec(sampler: Side) -> str:
    """The --infer spec of the sampler's declared config (engine and dtype; hf-decode for an engine
    mismatch cannot run)."""
    kind = sampler.kind if sampler.kind in ("hf", "hf-decode", "vllm") else "hf-decode"
    return f"{kind}:dtype={sampler.dtype}" if sampler.dtype else kind
