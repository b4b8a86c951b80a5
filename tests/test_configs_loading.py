"""Hostile files given to every config reader: one line naming the file (SpecError, exit 2 at the
CLI), never a traceback, never gigabytes. The bounded loader (frameworks/configs/loading.py) is
what each reader reads through.

Covered: empty, blank, binary (NUL), not UTF-8, over 4 MiB, a billion-laughs alias bomb (also as
TRL's `dtype: *alias` and behind slime's --custom-config-path), YAML nested 1,000 deep (block and
flow), a `!!python/object` tag and an unknown tag, a verl `${...}` interpolation that refers back to
itself and one through a resolver (`${oc.env:HOME}`), `temperature: hot`, a verl override holding a
tag or a backtick, TOML nested 3,000 deep and 200 tables deep, a slime or OpenRLHF file with no
command line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from mismatch.errors import SpecError
from mismatch.frameworks.configs.loading import decoded
from mismatch.frameworks.configs import read_config
from mismatch.frameworks.configs.derived import Machine

FRAMEWORKS = ("verl", "trl", "openrlhf", "slime", "prime-rl")
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(9))
VERL_BASE = ("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 2\n  rollout:\n    name: vllm\n"
             "    log_prob_micro_batch_size_per_gpu: 2\n")
# name -> (bytes, {framework: what its one line says}); a framework left out only has to refuse it in one line
CASES: dict[str, tuple[bytes, dict[str, str]]] = {
    "empty": (b"", {fw: "config (the file is empty)" for fw in FRAMEWORKS}),
    "blank": (b"  \n\n", {fw: "config (the file is empty)" for fw in FRAMEWORKS}),
    "binary": (bytes(range(256)) * 4, {fw: "config (a binary file: NUL byte at offset 0)" for fw in FRAMEWORKS}),
    "latin1": ("temperature: caf\xe9\n".encode("latin-1"), {fw: "config (not UTF-8 text: byte 16)" for fw in FRAMEWORKS}),
    "huge": (b"a: 1\n" * 1_000_000, {fw: "config (5,000,000 bytes; a config is under" for fw in FRAMEWORKS}),
    "laughs": (LAUGHS.encode(), {"verl": "aliases expanded (an alias bomb?)", "trl": "aliases expanded"}),
    "trl_alias": ((LAUGHS + "dtype: *j\n").encode(), {"trl": ":1: invalid YAML in the trl config: more than 200,000"}),
    "deep_block": (("a: " + "[" * 1000 + "]" * 1000 + "\n").encode(), {"verl": "nested more than 64 deep",
                                                                       "trl": "nested more than 64 deep"}),
    "deep_flow": (("{a: " * 3000 + "1" + "}" * 3000).encode(), {"trl": "nested more than 64 deep"}),
    "python_tag": (b"actor_rollout_ref: !!python/object/apply:os.system ['echo hi']\n",
                   {"verl": "could not determine a constructor for the tag", "trl": "python/object/apply:os.system"}),
    "unknown_tag": (b"temperature: !foo 1\n", {"trl": "could not determine a constructor for the tag '!foo'"}),
    "self_reference": ((VERL_BASE + "    temperature: ${actor_rollout_ref.rollout.temperature}\n").encode(),
                       {"verl": "the interpolation refers back to itself"}),
    "resolver": ((VERL_BASE + "    temperature: ${oc.env:HOME}\n").encode(),
                 {"verl": "an interpolation the built-in reader does not resolve"}),
    "hot": ((VERL_BASE + "    temperature: hot\n").encode(), {"verl": "temperature='hot' is not a positive number"}),
    "trl_hot": (b"temperature: hot\n", {"trl": ":1: temperature: could not convert string to float: 'hot'"}),
    "override_tag": (b"python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name='!!python/object/apply:os.system"
                     b" [x]'\n", {"verl": "could not determine a constructor for the tag"}),
    "override_backtick": (b"python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=`whoami`\n",
                          {"verl": "found character '`' that cannot start any token"}),
    "deep_toml": (("a = " + "[" * 3000 + "]" * 3000 + "\n").encode(), {"prime-rl": "nested too deep"}),
    "deep_tables": ("".join(f"[{'.'.join(['x'] * i)}]\n" for i in range(1, 200)).encode(),
                    {"prime-rl": "nested more than 64 deep"}),
    "no_command_line": (b"just: words\n", {"openrlhf": "not an OpenRLHF PPO config: no openrlhf.cli.train_ppo_ray line",
                                          "slime": "not a slime config: no train.py command line"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_file_is_one_line_for_every_reader(case: str, tmp_path: Path) -> None:
    data, expected = CASES[case]
    path = tmp_path / f"{case}.cfg"
    path.write_bytes(data)
    for framework in FRAMEWORKS:
        started = time.monotonic()
        try:
            read_config(framework, path, Machine())
        except SpecError as error:
            message = str(error)
            assert "\n" not in message and message.startswith(str(path)), message
            assert expected.get(framework, "") in message, (framework, message)
        else:
            assert framework not in expected, f"{framework} read {case}"
        assert time.monotonic() - started < 5, (framework, case)


def test_slime_custom_config_alias_bomb_is_refused_naming_that_file(tmp_path: Path) -> None:
    (tmp_path / "laughs.yaml").write_text(LAUGHS)
    script = tmp_path / "run.sh"
    script.write_text("python3 train.py --custom-config-path laughs.yaml --hf-checkpoint m\n")
    with pytest.raises(SpecError, match=r"laughs\.yaml:1: invalid YAML in the slime --custom-config-path config: "
                                        r"more than 200,000 values"):
        read_config("slime", script, Machine())


def test_a_few_aliases_are_read_as_yaml_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "grpo.yaml"
    path.write_text("common: &t 0.7\ntemperature: *t\nuse_vllm: true\n")
    derived = read_config("trl", path, Machine())
    assert "temperature=0.7" in derived.specs["train"]


class Inner(msgspec.Struct, kw_only=True):
    size: int | None = None
    sizes: list[int] = []
    by_name: dict[str, int] = {}
    scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0


class Outer(msgspec.Struct, kw_only=True):
    inner: Inner = msgspec.field(default_factory=Inner)


def test_a_decoded_config_names_the_key_and_the_value_the_file_gives() -> None:
    """loading.decoded: a msgspec ValidationError as one line naming the file, the dotted key and the value
    as written (not as converted), worded by the record's type or the reader's own words."""
    assert decoded({"inner": {"size": 3, "other": "ignored"}}, Outer, "f.yaml") == Outer(inner=Inner(size=3))
    for tree, message in (({"inner": {"size": "eight"}}, "f.yaml: inner.size='eight' is not an integer"),
                          ({"inner": {"sizes": [1, "x"]}}, "f.yaml: inner.sizes[1]='x' is not an integer"),
                          ({"inner": {"by_name": {"k": "v"}}}, "f.yaml: inner.by_name: each value must be an integer"),
                          ({"inner": 3}, "f.yaml: inner=3 is not a mapping"),
                          ([1], "f.yaml: the config is not a mapping"),
                          ({"inner": {"scale": 0}}, "f.yaml: inner.scale=0 is not `float` > 0.0")):
        with pytest.raises(SpecError) as raised:
            decoded(tree, Outer, "f.yaml")
        assert str(raised.value) == message
    with pytest.raises(SpecError, match=r"^f.yaml: inner.scale=0 is not a positive number$"):
        decoded({"inner": {"scale": 0}}, Outer, "f.yaml", (("inner.scale", "a positive number"),))
