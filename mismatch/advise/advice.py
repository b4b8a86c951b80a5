"""The advice on an audit: summary.json's diagnosis, verdicts, recommendations and every
framework's snippet (`advise`, what the audit writes), and what `mismatch recommend` answers for
one framework release (`for_target`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mismatch.advise.diagnose import diagnose
from mismatch.advise.evidence import PAIR
from mismatch.advise.recommend import recommend, recommendation_records
from mismatch.advise.snippets import Logged, render_config, snippet_settings
from mismatch.advise.verdicts import verdicts
from mismatch.frameworks.protocol import Target
from mismatch.frameworks.registry import FRAMEWORKS, default_target
from mismatch.results import summary_model as model
from mismatch.results.summary_model import ProbeResult, Summary, present, to_builtins


@dataclass(kw_only=True, slots=True, frozen=True)
class AuditAdvice:
    """advise()'s part of summary.json: the diagnosis, each pair's verdict naming its cause, the
    recommendations and each framework's config snippet for them."""

    diagnosis: model.Diagnosis
    verdicts: dict[str, model.Verdict]
    recommendations: list[model.Recommendation]
    config_snippets: dict[str, str]

    def parts(self) -> dict[str, object]:
        """The summary sections it sets (pipeline.summary.with_parts)."""
        return {"diagnosis": self.diagnosis, "verdicts": self.verdicts,
                "recommendations": self.recommendations, "config_snippets": self.config_snippets}


def advise(summary: Summary, *, probes: list[ProbeResult] | None = None) -> AuditAdvice:
    """summary.json's diagnosis, recommendations (the rule on the summary and the `probes`' evidence)
    and each framework's config snippet for them; each pair's verdict names its cause. The summary
    is read, never edited: the command builds its summary with the part returned."""
    diagnosis = diagnose(summary, probes=probes)
    # Each framework's snippet chooses among the corrections its release can express (the one
    # installed here, else the newest mismatch has read).
    targets = [default_target(framework) for framework in FRAMEWORKS]
    snippets = {target.framework: render_config(recommend(summary, target, probes=probes), target,
                                                causes=diagnosis.causes) for target in targets}
    return AuditAdvice(diagnosis=diagnosis.to_record(),
                       verdicts=verdicts(summary.pairs, diagnosis, {s: summary.engine(s) for s in summary.engines}),
                       recommendations=recommendation_records(recommend(summary, probes=probes)),
                       config_snippets=snippets)


@dataclass(kw_only=True, slots=True, frozen=True)
class Advice:
    """What `mismatch recommend` answers: the recommendations for a target (or framework-neutral),
    its snippet, and the target framework's own metrics at the settings it runs or will run."""

    recommendations: list[model.Recommendation]
    diagnosis: model.Diagnosis  # summary.json's "diagnosis", on these findings
    target: Target | None = None
    snippet: str | None = None
    logged: Logged | None = None

    def to_dict(self) -> dict[str, object]:
        target = self.target
        return {"diagnosis": to_builtins(self.diagnosis), "recommendations": to_builtins(self.recommendations),
                "framework": target.framework if target else None,
                "release": target.release.version if target else None, "note": target.note if target else None,
                "config": self.snippet, "logged": self.logged}


def for_target(summary: Summary, target: Target | None, *, results: Path | None = None,
               probes: list[ProbeResult] | None = None) -> Advice:
    """The rule for `target`'s release (the modes it can express), its snippet, and what the target
    framework logs on the audit's tokens (results/tokens.parquet) at the settings the user named in
    the target, else at those the snippet sets."""
    stored_probes = present(summary.probes.results) if summary.probes else None
    if target is None and probes is None:
        diagnosed = present(summary.diagnosis)
        return Advice(recommendations=list(summary.recommendations),
                      diagnosis=diagnosed if diagnosed is not None else diagnose(summary, probes=stored_probes).to_record())
    found = probes if probes is not None else stored_probes
    diagnosis = diagnose(summary, probes=found)
    recs = recommend(summary, target, probes=found)
    if target is None:
        return Advice(recommendations=recommendation_records(recs), diagnosis=diagnosis.to_record())
    logged = None
    if results is not None:
        settings = target.settings or snippet_settings(recs, target)
        logged = logged_metrics(results, replace(target, settings=settings))
    return Advice(recommendations=recommendation_records(recs), diagnosis=diagnosis.to_record(), target=target,
                  logged=logged, snippet=render_config(recs, target, logged, causes=diagnosis.causes))


def logged_metrics(results: Path, target: Target, pair: str = PAIR) -> Logged | None:
    """The target framework's metrics on the results dir's tokens at the target's settings (over
    its defaults): one pass over tokens.parquet, in chunks."""
    from mismatch.frameworks.metrics import framework_metrics, settings_used
    from mismatch.results import TOKENS_FILE, tokens_chunks

    a, b = pair.split("/")
    file = Path(results) / TOKENS_FILE
    if not file.is_file():
        return None
    chunks = tokens_chunks([file])
    first = next(iter(chunks()), None)
    if first is None or f"logp_{a}" not in first.columns or f"logp_{b}" not in first.columns:
        return None
    settings = {target.framework: settings_used([target])[target.framework]}
    found = framework_metrics(chunks, [(a, b)], settings)[pair].get(target.framework) or {}
    return {"settings": settings[target.framework], "pair": pair, "metrics": found}
