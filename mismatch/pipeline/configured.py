"""The sources whose spec names a trainer framework's config (`verl:ppo.yaml`), as the engine specs
that config derives (frameworks/configs/), before anything else of a command runs: the derived
spec is what the work dir's identity, the replay and summary.json see, and each source's table of
settings rides on the options into summary.json `engines.<source>.from_config`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

from mismatch.errors import MismatchError
from mismatch.frameworks.configs import config_framework, resolve
from mismatch.frameworks.configs.model_check import MODEL_KEYS, check_model
from mismatch.pipeline.options import DEFAULT_INFER, AuditOptions, RunOptions

O = TypeVar("O", bound=RunOptions)


def with_configs(options: O) -> O:
    """`options` with each framework-config source resolved (the same options when none is, or
    when they were resolved already). An audit's infer left unset replays the rollout engine of a
    --train framework config, else hf-decode."""
    if options.from_config:
        return options
    requested = dict(options.sources)
    if isinstance(options, AuditOptions) and options.infer is None:
        requested["infer"] = _rollout_side(options.train) or DEFAULT_INFER
    changes, tables = {}, {}
    for source, text in requested.items():
        if config_framework(text) is not None:
            resolved = resolve(text, source)
            changes[source], tables[source] = resolved.spec, resolved.from_config
        elif source == "infer" and isinstance(options, AuditOptions):
            changes[source] = text
    if isinstance(options, AuditOptions):  # a config's own correction settings, where --for gave none
        from_train = tables.get("train", {})
        framework, settings = from_train.get("framework"), from_train.get("framework_settings") or {}
        if framework and settings and framework not in options.framework_settings:
            changes["framework_settings"] = {**options.framework_settings, framework: dict(settings)}
    return dataclasses.replace(options, **changes, from_config=tables)


def with_model_check(checkpoint: str | Path, options: O) -> O:
    """`options` with the --train config's model compared with the checkpoint (summary.json
    engines.train.from_config.model_check); MismatchError for a clear mismatch unless force_model."""
    table = options.from_config.get("train")
    if table is None or not table.get("model") or "model_check" in table:
        return options
    check = check_model(str(table["model"]), Path(checkpoint), MODEL_KEYS.get(table["framework"], "model"))
    if check.verdict == "differs" and not getattr(options, "force_model", False):
        raise MismatchError(check.line)
    return dataclasses.replace(options, from_config={**options.from_config,
                                                     "train": {**table, "model_check": check.to_dict()}})


def model_line(options: RunOptions) -> str | None:
    """The audit's first line: the --train config's model against the checkpoint, None without one."""
    return (options.from_config.get("train", {}).get("model_check") or {}).get("line")


def _rollout_side(train: str) -> str | None:
    """`verl:ppo.yaml[,...]` → `verl:ppo.yaml,side=infer` (the trainer's own options left out)."""
    framework = config_framework(train)
    if framework is None:
        return None
    path = train.strip().partition(":")[2].partition(",")[0]
    return f"{framework}:{path},side=infer"
