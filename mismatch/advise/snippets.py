"""A recommendation's config snippet for a framework release: the diagnosed causes and each fix's
why as comments, then the release's own keys (the framework module's `render`)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from mismatch.advise.cause import Cause
from mismatch.advise.choice import describe
from mismatch.advise.correction_modes import MODES
from mismatch.frameworks.protocol import Recommendation, Target
from mismatch.frameworks.registry import module as framework_module
from mismatch.frameworks.registry import parse_target
from mismatch.results import summary_model as model
from mismatch.results.summary_model import Params


# What a framework logs on the audit's tokens at its settings (advice.logged_metrics):
# {"settings": {...}, "pair": "A/B", "metrics": {key: value}}.
Logged = dict[str, Any]


def render_config(recommendations: Iterable[Recommendation | Params], target: Target | str,
                  logged: Logged | None = None, causes: Sequence[Cause | model.Cause] = ()) -> str:
    """A ready-to-paste snippet with the target release's real keys: YAML (verl, trl, areal), TOML
    (prime-rl), CLI flags (slime, openrlhf). The diagnosed `causes` (summary.json diagnosis) lead
    its comments; fixes without a config key become comments. A correction the release cannot
    express is said so and left out (recommend for the target chooses one it can)."""
    if isinstance(target, str):
        target = parse_target(target, detect=False)
    module = framework_module(target.framework)
    recs = [r if isinstance(r, Recommendation) else Recommendation(**r) for r in recommendations]
    by_kind = {r.kind: r for r in recs}
    lines = [f"# mismatch recommend --for {target.framework}=={target.release.version}"]
    lines += [f"# note: {target.note}"] if target.note else []
    lines += [f"# cause: {cause.title} ({cause.pair})" for cause in causes if not cause.minor]
    lines += [f"# {rec.kind}: {rec.why} (cost: {rec.cost})" if rec.cost else f"# {rec.kind}: {rec.why}"
              for rec in recs]
    correction = by_kind.get("correction")
    if correction is not None and module.express(correction.params["mode"], correction.params,
                                                 target.release) is None:
        lines.append(f"# {target.label} cannot express {describe(_as_correction(correction))}: "
                     f"nothing to set for it (mismatch recommend --for {target.framework} picks one it can)")
        del by_kind["correction"]
    lines += module.render(by_kind, target)
    if logged:
        lines.append(f"# on these tokens, with {_settings_words(logged['settings'])}, {target.label} logs: "
                     + ", ".join(f"{key} {_fmt(value)}" for key, value in logged["metrics"].items()))
    return "\n".join(_wrapped(lines)) + "\n"


def _as_correction(recommendation: Recommendation) -> model.Correction:
    """A correction's mode and its own parameters (without the measured extras)."""
    names = MODES[recommendation.params["mode"]].params
    return model.Correction(mode=recommendation.params["mode"], params={k: recommendation.params[k] for k in names})


def snippet_settings(recommendations: Sequence[Recommendation], target: Target) -> Params:
    """The correction settings the snippet sets, under the framework's own names."""
    correction = next((r for r in recommendations if r.kind == "correction"), None)
    if correction is None:
        return {}
    return framework_module(target.framework).express(correction.params["mode"], correction.params,
                                                       target.release) or {}


def _settings_words(settings: Params) -> str:
    return ", ".join(f"{key}={value}" for key, value in settings.items()) or "its defaults"


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _wrapped(lines: list[str], width: int = 100) -> list[str]:
    """Comment lines wrapped to `width` columns (a snippet is read in an editor); config lines as
    they are (a YAML value or a shell flag must not be split)."""
    out = []
    for line in lines:
        if line.startswith("# ") and len(line) > width:
            out += textwrap.wrap(line[2:], width=width, initial_indent="# ", subsequent_indent="#   ",
                                 break_on_hyphens=False, break_long_words=False)
        else:
            out.append(line)
    return out
