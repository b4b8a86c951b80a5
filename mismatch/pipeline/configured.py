"""The sources whose spec names a trainer framework's config (`verl:ppo.yaml`), as the engine specs
that config derives (frameworks/configs/), before anything else of a command runs: the derived
spec is what the work dir's identity, the replay and summary.json see, and each source's table of
settings rides on the options into summary.json `engines.<source>.from_config`."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from mismatch.frameworks.configs import config_framework, resolve
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
    return dataclasses.replace(options, **changes, from_config=tables)


def _rollout_side(train: str) -> str | None:
    """`verl:ppo.yaml[,...]` → `verl:ppo.yaml,side=infer` (the trainer's own options left out)."""
    framework = config_framework(train)
    if framework is None:
        return None
    path = train.strip().partition(":")[2].partition(",")[0]
    return f"{framework}:{path},side=infer"
