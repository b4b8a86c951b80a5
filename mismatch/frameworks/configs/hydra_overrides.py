"""verl's run-script command line as Hydra reads it: `key=value` overrides, `+key=`/`++key=`, `~key`
and `GROUP=OPTION` (an option of a config group of verl's defaults list, e.g. `model_engine=megatron`),
each value read as YAML, as Hydra's override grammar reads plain values. Read against verl 0.9.1
(trainer/config/ppo_trainer.yaml's defaults list; the PyPI wheel)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mismatch.errors import SpecError
from mismatch.frameworks.configs.kinds import verl_entry_or_refused
from mismatch.frameworks.configs.loading import yaml_value
from mismatch.frameworks.configs.scripts import command_line

NAME = "verl"
VERSION = "0.9.1"

# verl 0.9.1's ppo_trainer.yaml defaults list: the config groups a dotless `GROUP=OPTION` override picks
# an option of (Hydra's group override), and each group's options in that release.
GROUPS: dict[str, tuple[str, ...]] = {
    "model_engine": ("dp", "megatron", "torchtitan", "veomni"),  # trainer/config/model_engine/*.yaml
    "actor": (), "ref": (), "rollout": (), "model": (), "critic": (), "data": (), "reward": (), "algorithm": (),
    "distillation": (), "transfer_queue": (), "legacy_reward_impl": (), "optim": (), "engine": (),
}
# model_engine=OPTION sets actor.strategy (trainer/config/actor/{dp,megatron,veomni,torchtitan}_actor.yaml:16)
ENGINE_STRATEGY = {"dp": "fsdp", "megatron": "megatron", "torchtitan": "torchtitan", "veomni": "veomni"}
# The top-level sections of verl 0.9.1's composed config (_generated_ppo_trainer.yaml): a dotless
# override that is neither a group nor one of these, Hydra refuses.
SECTIONS = ("actor_rollout_ref", "data", "critic", "custom_reward_function", "reward_model", "sandbox_fusion",
            "reward", "algorithm", "distillation", "transfer_queue", "trainer", "global_profiler", "skip",
            "ray_kwargs", "hydra")
# `$NAME` or `${NAME...}` with no dot or colon in NAME: the shell's, not one of OmegaConf's interpolations
_SHELL_VARIABLE = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*([:}]-|\})|[A-Za-z_])")
GROUP_CHOICES = "__groups__"  # where _from_overrides keeps the `GROUP=OPTION` overrides


def from_overrides(path: Path, text: str) -> dict[str, Any]:
    """Hydra's overrides of a run script: `key=value` (each value read as YAML, as Hydra's override
    grammar reads plain values), `+key=`/`++key=` (add or force a key), `~key` (delete it) and
    `GROUP=OPTION` (a dotless key: the option of a config group of verl's defaults list, e.g.
    `model_engine=megatron`). A line that launches something else than verl's PPO loop is refused."""
    launched = LAUNCHER.search(text)
    if launched is not None:
        verl_entry_or_refused(path, launched["module"] or launched["script"])
    words, unread = command_line(path, text, LAUNCHER)
    if unread:
        raise SpecError(f"{path}: the launch line names ${{{unread[0]}[@]}}, an array the file does not define: "
                        "give the command line as it ran (the script's `set -x` line)")
    tree: dict[str, Any] = {}
    for word in words:
        if word.startswith("~") and "." in word:  # ~key or ~key=value: Hydra deletes the key
            _put(path, tree, word, word[1:].partition("=")[0], None)
            continue
        key, eq, value = word.partition("=")
        key = key.lstrip("+")
        if not eq or key.startswith("-") or "/" in key or not key:
            continue  # the interpreter, the module, flags: not overrides
        if _SHELL_VARIABLE.search(value):
            raise SpecError(f"{path}: override {word!r} holds a shell variable: give the command line as it ran "
                            "(the script's `set -x` line), or a YAML")
        if "." not in key:
            _group(path, tree, word, key, value)
            continue
        _put(path, tree, word, key, yaml_value(value.strip(), f"{path}: override {key}", NAME) if value.strip() else None)
    if not tree:
        raise SpecError(f"{path}: neither a verl YAML config nor a command line with key=value overrides")
    return tree


# A run script's launch line: `python3 -m MODULE` or `python3 SCRIPT.py` (not `python3 -c ...`).
LAUNCHER = re.compile(r"\b(?:python3?|torchrun)(?:\s+--?[\w-]+(?:=\S+)?)*\s+(?:-m\s+(?P<module>[A-Za-z_][\w.]*)|(?P<script>[^\s-]\S*\.py))")


def _group(path: Path, tree: dict[str, Any], word: str, key: str, value: str) -> None:
    if key in GROUPS:
        options = GROUPS[key]
        if options and value not in options:
            raise SpecError(f"{path}: override {word!r}: verl {VERSION}'s {key} group has no option {value!r} "
                            f"(it has: {', '.join(options)})")
        tree.setdefault(GROUP_CHOICES, {})[key] = value
    elif key not in SECTIONS:
        raise SpecError(f"{path}: override {word!r}: {key} is neither a config group of verl {VERSION}'s defaults "
                        f"list nor a section of its config")


def _put(path: Path, tree: dict[str, Any], word: str, key: str, value: Any) -> None:
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError(f"{path}: override {word!r}: {part} is set to a value and a section")
    node[leaf] = value
