"""The layering rule of ARCHITECTURE.md ("Layers"), read from the source: every import statement of
every module (function-level and TYPE_CHECKING ones included, relative ones resolved) must go to
its own package or a layer below it, the reports never reach an engine or a replay, and no two
modules import each other through any chain.

import-linter (grimp) walks a package's own folder and so cannot see `mismatch.probes` and
`mismatch.reports`, which the wheel maps from the repo's probes/ and reports/ folders
(pyproject.toml `package-dir`); this reads the same mapping.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Top first. A module in a layer imports from its own package, or from any layer below; modules of
# one layer joined by " | " import nothing of each other.
LAYERS = (
    "__main__",
    "cli",
    "hooks",
    "demo | record",
    "pipeline",
    "reports",
    "present",
    "advise",
    "trend",
    "frameworks",
    "localize | probes",
    "replay | identity",
    "analysis",
    "engines | weights",
    "rollouts",
    "results",
    "streams | checkpoint",
    "workers | batch",
    "errors | version",
)
# Beyond the layers: (importer package, what it must never import).
FORBIDDEN = (
    ("reports", ("engines", "replay", "localize", "probes")),
    ("analysis", ("engines", "weights")),  # the token table in, numbers out: no model, no engine
)
# Packages the rest of mismatch reaches through their __init__ only (its public names): the report's
# modules are its own; what the terminal shares with it is mismatch.present's.
PUBLIC_ONLY = ("reports",)


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # module name
    imported: str  # module name, resolved to a module of the project
    file: Path
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.importer} imports {self.imported}"


def project_modules(repo: Path) -> dict[str, Path]:
    """Every module of the package as installed: mismatch/ plus the folders pyproject maps into it."""
    config = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"mismatch": repo / "mismatch", **{name: repo / folder for name, folder in config["package-dir"].items()}}
    modules: dict[str, Path] = {}
    for name, folder in roots.items():
        for file in sorted(folder.rglob("*.py")):
            parts = list(file.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([name, *parts])] = file
    return modules


def imports(modules: dict[str, Path]) -> Iterator[Import]:
    """Every import of a project module by a project module. `from a import b` is an import of a.b
    when that is a module, else of a (as grimp, import-linter's graph, counts them)."""
    for name, file in modules.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            for target in _targets(node, package, modules):
                found = _project_module(target, modules)
                if found is not None and found != name:
                    yield Import(name, found, file, node.lineno)


def _targets(node: ast.AST, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, *([node.module] if node.module else [])])
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def _project_module(target: str, modules: dict[str, Path]) -> str | None:
    """The project module a dotted import names: itself, or the nearest package above it."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def _layer_of(module: str) -> tuple[int, str] | None:
    """(depth, package) of a module: 0 is the top layer; None for the root package itself."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for depth, layer in enumerate(LAYERS):
        if parts[1] in [name.strip() for name in layer.split("|")]:
            return depth, parts[1]
    raise AssertionError(f"{module} is in no layer: add its package to tests/layering.py LAYERS")


def violations(repo: Path) -> list[str]:
    """Each upward or sideways import, each forbidden one, each reach into a PUBLIC_ONLY package's
    modules, and each cycle, as one line."""
    modules = project_modules(repo)
    found = list(imports(modules))
    out: list[str] = []
    for item in dict.fromkeys(found):  # one line per import statement
        a, b = _layer_of(item.importer), _layer_of(item.imported)
        if a is None or b is None or a[1] == b[1]:
            continue
        if b[0] < a[0]:
            out.append(f"{item} (upward: {a[1]} is below {b[1]})")
        elif b[0] == a[0]:
            out.append(f"{item} (sideways: {a[1]} and {b[1]} are one layer, independent)")
    for item in found:
        for importer, banned in FORBIDDEN:
            if item.importer.split(".")[1:2] == [importer] and item.imported.split(".")[1] in banned:
                out.append(f"{item} (forbidden: {importer} never imports {item.imported.split('.')[1]})")
    for item in found:
        package = item.imported.split(".")[1:2]
        if package and package[0] in PUBLIC_ONLY and item.imported != f"mismatch.{package[0]}" \
                and item.importer.split(".")[1:2] != package:
            out.append(f"{item} (internal: outside {package[0]}, import mismatch.{package[0]}'s public names)")
    # The root package's lazy public names (PEP 562) import upward by design, on first use only.
    out.extend(f"cycle: {' -> '.join(cycle)}" for cycle in cycles([item for item in found if item.importer != "mismatch"]))
    return out


def cycles(found: list[Import]) -> list[list[str]]:
    """One chain per strongly connected group of modules (Tarjan's algorithm, iteratively)."""
    graph: dict[str, set[str]] = {}
    for item in found:
        graph.setdefault(item.importer, set()).add(item.imported)
        graph.setdefault(item.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups
