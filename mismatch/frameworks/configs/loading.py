"""The one way a config reader reads a file: bounded, and refusing what is not a config in one line.

Every reader (verl, TRL, OpenRLHF, slime, prime-rl) reads its file through `text()` and, for YAML
or TOML, `yaml_value()` / `toml_table()`. A config is small text: a file that is empty, binary (a
NUL byte, or not UTF-8) or larger than MAX_BYTES is "not a FRAMEWORK config". YAML is read with
PyYAML's SafeLoader (no `!!python/...` object tags: PyYAML refuses them as unknown tags) and bounded
while it is composed, before any Python object exists: at most MAX_ALIASES aliases, nesting at most
MAX_DEPTH deep and MAX_NODES nodes with every alias expanded. A billion-laughs file (`a: &a [x, x]`,
`b: &b [*a, *a]`, ...) shares its nodes, so PyYAML builds it cheaply; what explodes is whatever
walks it afterwards (OmegaConf, a reader's own loop), hence the bound on the expanded count.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from mismatch.errors import SpecError

MAX_BYTES = 4 * 1024 * 1024  # the largest upstream example config is ~40 kB
MAX_DEPTH = 64               # verl's composed config nests 6 deep
MAX_ALIASES = 256
MAX_NODES = 200_000          # verl's composed config: ~1,500 nodes


def text(path: Path, what: str) -> str:
    """The file as text, or one line saying why it is not a `what` config (`what`: "verl")."""
    article = "an" if what[:1].lower() in "aeiou" else "a"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the {what} config: {exc.strerror or exc}") from None
    if not data.strip():
        raise SpecError(f"{path}: not {article} {what} config (the file is empty)")
    if len(data) > MAX_BYTES:
        raise SpecError(f"{path}: not {article} {what} config ({len(data):,} bytes; a config is under {MAX_BYTES:,})")
    if b"\x00" in data:
        raise SpecError(f"{path}: not {article} {what} config (a binary file: NUL byte at offset {data.index(0)})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not {article} {what} config (not UTF-8 text: byte {exc.start})") from None


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts aliases, depth and expanded nodes while composing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0
        self.depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: ANN401 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _Bound(f"more than {MAX_ALIASES} YAML aliases", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _Bound(f"nested more than {MAX_DEPTH} deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def compose_document(self) -> Any:  # noqa: ANN401
        node = super().compose_document()
        if node is not None and _expanded(node, {}) > MAX_NODES:
            raise _Bound(f"more than {MAX_NODES:,} values with its aliases expanded (an alias bomb?)",
                         node.start_mark)
        return node


class _Bound(yaml.YAMLError):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many nodes `node` is with its aliases expanded (shared nodes counted once per use)."""
    if id(node) in sizes:
        return sizes[id(node)]
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded(key, sizes) + _expanded(value, sizes) for key, value in node.value)
    sizes[id(node)] = min(size, MAX_NODES + 1)  # past the bound the exact size does not matter
    return sizes[id(node)]


def yaml_value(source: str, path: Path | str, what: str) -> Any:  # noqa: ANN401 - any YAML value
    """The YAML document in `source` (JSON is YAML), bounded as above; one line naming the file's line
    for invalid YAML, an object tag or a bound crossed."""
    loader = _BoundedLoader(source)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise SpecError(f"{_where(path, exc)}: invalid YAML in the {what} config: {_problem(exc)}") from None
    except RecursionError:  # PyYAML's emitter-side recursion on pathological input: the bound above missed it
        raise SpecError(f"{path}: the {what} config is nested too deep") from None
    finally:
        loader.dispose()


def yaml_node(source: str, path: Path | str, what: str) -> yaml.Node | None:
    """The composed (bounded) YAML node tree, for readers that want each key's line."""
    loader = _BoundedLoader(source)
    try:
        return loader.get_single_node()
    except yaml.YAMLError as exc:
        raise SpecError(f"{_where(path, exc)}: invalid YAML in the {what} config: {_problem(exc)}") from None
    finally:
        loader.dispose()


def toml_table(source: str, path: Path | str, what: str) -> dict[str, Any]:
    """The TOML document in `source`; one line for invalid TOML or nesting past MAX_DEPTH."""
    try:
        table = tomllib.loads(source)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: invalid TOML in the {what} config: {exc}") from None
    except RecursionError:
        raise SpecError(f"{path}: the {what} config is nested too deep") from None
    if _depth(table, 0) > MAX_DEPTH:
        raise SpecError(f"{path}: the {what} config is nested more than {MAX_DEPTH} deep")
    return table


Record = TypeVar("Record")
# msgspec's ValidationError: "Expected `int | null`, got `str` - at `$.a.b`" (no path when the root is
# wrong), or a constraint of the record's: "Expected `float` > 0 - at `$.a.b`"
_INVALID = re.compile(r"^Expected `(?P<expected>[^`]*)`(?P<rest>.*?)(?: - at `\$(?P<at>[^`]*)`)?$")
_EXPECTED = (("object", "a mapping"), ("array", "a list"), ("float", "a number"), ("int", "an integer"),
             ("bool", "true or false"), ("str", "a string"))


def decoded(tree: Any, kind: type[Record], path: Path | str,  # noqa: ANN401 - a parsed file
            wanted: tuple[tuple[str, str], ...] = ()) -> Record:
    """`tree` (a parsed config) as the typed record `kind`, decoded once at the boundary by msgspec
    (unknown keys ignored, each missing key the record's default). A value of the wrong type is one
    SpecError naming the file, the dotted key and the value as the file gives it: `f.yaml: a.b='eight'
    is not an integer`; `wanted` words what some keys must be more precisely ("a positive number")."""
    try:
        return msgspec.convert(tree, kind)
    except msgspec.ValidationError as exc:
        found = _INVALID.match(str(exc))
        if found is None:
            raise SpecError(f"{path}: {exc}") from None
        key = (found["at"] or "").lstrip(".")
        typed = next((words for name, words in _EXPECTED if name in found["expected"]), found["expected"])
        expected = dict(wanted).get(key) or (typed if found["rest"].startswith(", got") else
                                             f"`{found['expected']}`{found['rest']}")
        if not key:
            raise SpecError(f"{path}: the config is not {expected}") from None
        if "[...]" in key:  # a map's value: msgspec does not name the map's key
            raise SpecError(f"{path}: {key.partition('[...]')[0]}: each value must be {expected}") from None
        raise SpecError(f"{path}: {key}={_at(tree, key)!r} is not {expected}") from None


def _at(tree: Any, key: str) -> Any:  # noqa: ANN401 - the value msgspec refused, by its dotted key
    for part in re.findall(r"[^.\[\]]+", key):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part.strip("'\"")] if isinstance(tree, dict) else None
    return tree


def _depth(value: Any, level: int) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def _where(path: Path | str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f"{path}:{mark.line + 1}" if mark is not None else str(path)


def _problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return " ".join(str(problem).split())
