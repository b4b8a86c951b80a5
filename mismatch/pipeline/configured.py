"""The sources whose spec names a trainer framework's config (`verl:ppo.yaml`), as the engine specs
that config derives (frameworks/configs/), before anything else of a command runs: the derived
spec is what the work dir's identity, the replay and summary.json see, and each source's table of
settings rides on the options into summary.json `engines.<source>.from_config`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

from mismatch.checkpoint import declared_context
from mismatch.engines.spec import parse_spec
from mismatch.errors import MismatchError, SpecError
from mismatch.frameworks.configs import ENGINE_SIDE_OPTIONS, config_framework, resolve
from mismatch.frameworks.configs.derived import spec_text
from mismatch.frameworks._common import yaml_scalar
from mismatch.frameworks.configs.model_check import MODEL_KEYS, check_model
from mismatch.frameworks.registry import MODULES
from mismatch.pipeline.options import DEFAULT_INFER, AuditOptions, RunOptions
from mismatch.results.section_records import FromConfig
from mismatch.results.summary_model import UNSET, from_builtins, present, to_builtins

O = TypeVar("O", bound=RunOptions)


def resolve_options(checkpoint: str | Path, options: O) -> O:
    """The one options pass, at the edge (the CLI, the library's front doors): the framework configs
    resolved (with_configs), then held against the checkpoint (with_checkpoint_checks), once; the
    options come back marked `resolved`, and a command given resolved options resolves nothing."""
    if options.resolved:
        return options
    return dataclasses.replace(with_checkpoint_checks(checkpoint, with_configs(options)), resolved=True)


def with_configs(options: O) -> O:
    """`options` with each framework-config source resolved (the same options when none is, or
    when they were resolved already). An audit's infer left unset replays the rollout engine of a
    --train framework config, else hf-decode."""
    if options.resolved:
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
    if isinstance(options, AuditOptions) and "train" in tables:  # a config's own correction settings, where --for gave none
        from_train = from_builtins(to_builtins(tables["train"]), FromConfig)
        framework, settings = present(from_train.framework), from_train.framework_settings or {}
        if framework and settings and framework not in options.framework_settings:
            _check_settings(framework, settings, str(from_train.file))
            changes["framework_settings"] = {**options.framework_settings, framework: dict(settings)}
    return dataclasses.replace(options, **changes, from_config=tables)


def _check_settings(framework: str, settings: dict[str, Any], file: str) -> None:
    """A config's correction settings held to what `--for` takes (frameworks/NAME.py SETTINGS), before any
    replay: the audit computes the framework's metrics with them."""
    module = MODULES[framework]
    try:
        for key, value in settings.items():
            if key in module.SETTINGS and not isinstance(value, list):
                module.SETTINGS[key](yaml_scalar(value).strip('"'))
        module.metrics({**module.DEFAULTS, **settings})
    except (ValueError, KeyError, TypeError) as error:
        raise SpecError(f"{file}: {framework}'s correction settings: {error}") from None


def with_checkpoint_checks(checkpoint: str | Path, options: O) -> O:
    """`options` with the framework configs held against the checkpoint, before anything is replayed:
    the --train config's model compared with it (summary.json engines.train.from_config.model_check;
    MismatchError for a clear mismatch unless force_model), and a derived vLLM spec that asks for more
    context than config.json declares replayed at the checkpoint's context, said in a notice."""
    return _with_context_check(Path(checkpoint), _with_model_check(Path(checkpoint), options))


def _with_model_check(checkpoint: Path, options: O) -> O:
    table = config_tables(options).get("train")
    if table is None or not table.model or table.model_check is not UNSET:
        return options
    check = check_model(str(table.model), checkpoint, MODEL_KEYS.get(str(table.framework), "model"))
    if check.verdict == "differs" and not getattr(options, "force_model", False):
        raise MismatchError(check.line)
    return dataclasses.replace(options, from_config={**options.from_config, "train": {
        **options.from_config["train"], "model_check": check.to_dict()}})


def _with_context_check(checkpoint: Path, options: O) -> O:
    """The infer side's max_model_len (from the config, not the user's own override) capped at the
    checkpoint's context: vLLM refuses a larger one with its own message, which names neither the
    config key nor the override that works."""
    table = config_tables(options).get("infer")
    if table is None or not isinstance(options, AuditOptions) or "max_model_len" in (table.overrides or {}):
        return options
    spec = parse_spec(options.infer or DEFAULT_INFER)
    asked, limit = spec.options.get("max_model_len"), declared_context(checkpoint)
    if asked is None or limit is None or int(asked) <= limit:
        return options
    key = next((s.key for s in table.settings or () if (s.option or "").startswith("max_model_len=")),
               "max_model_len")
    capped = spec_text(spec.kind, {**spec.options, "max_model_len": limit})
    notice = (f"{key}={asked} asks vLLM for more context than the checkpoint's {limit} (config.json): the replay "
              f"runs max_model_len={limit} (every rollout fits it, or the audit refuses it by name); "
              f"--infer {capped.split(',max_model_len=')[0]},max_model_len=N sets another")
    return dataclasses.replace(options, infer=capped, from_config={**options.from_config, "infer": {
        **options.from_config["infer"], "spec": capped, "notices": [*(table.notices or []), notice]}})


def config_tables(options: RunOptions) -> dict[str, FromConfig]:
    """Each source a framework config set, as summary.json's `engines.<source>.from_config` records."""
    return {source: from_builtins(to_builtins(table), FromConfig) for source, table in options.from_config.items()}


def model_line(options: RunOptions) -> str | None:
    """The audit's first line: the --train config's model against the checkpoint, None without one."""
    table = config_tables(options).get("train")
    return present(table.model_check.line) if table is not None and table.model_check else None


def _rollout_side(train: str) -> str | None:
    """`verl:ppo.yaml[,...]` → `verl:ppo.yaml,side=infer` (the trainer's own options left out, the rollout
    engine's ones, max_model_len, carried)."""
    framework = config_framework(train)
    if framework is None:
        return None
    path, _, inline = train.strip().partition(":")[2].partition(",")
    carried = [item.strip() for item in inline.split(",") if item.partition("=")[0].strip() in ENGINE_SIDE_OPTIONS]
    return ",".join([f"{framework}:{path}", "side=infer", *carried])
