"""The released RL frameworks, installed for the tests: each release's own wheel (`pip install
--no-deps --target`) in a cached folder, and a driver script run against it in a subprocess.

A release is the schema our snippets and framework-named metrics are held to: a driver
(tests/release_drivers/NAME.py) imports the release's own config and loss code, loads what we
emit into it, and prints what the release made of it as one JSON line. One subprocess per call,
because two releases of one framework cannot share an interpreter.

Installed under .cache/releases (or $MISMATCH_RELEASES); the first test that needs a release
installs it from the package index, later runs reuse it.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("MISMATCH_RELEASES", REPO / ".cache" / "releases"))
DRIVERS = Path(__file__).resolve().parent / "release_drivers"

# The releases under test: the newest on the package index and one older release still in use
# (read 2026-12-02; MACHINE.md). slime and prime-rl publish none: their config source is vendored,
# unmodified, at the commit read that day (tests/data/frameworks/NAME/README.md), and the driver
# puts it on its path itself.
RELEASES: dict[str, tuple[str, ...]] = {
    "verl": ("0.9.1", "0.8.0"),
    "trl": ("1.16.0", "1.14.2"),
    "openrlhf": ("0.11.2", "0.10.4"),
    "areal": ("1.0.4",),
    "slime": ("624b824a898ab0ec1fcb4d373004c7f3852bf515",),
    "prime-rl": ("559b44772e471d1538537b8805cc77f3824a5e64",),
}
PACKAGES = {"verl": "verl", "trl": "trl", "openrlhf": "openrlhf", "areal": "areal"}
VENDORED = {"slime", "prime-rl"}

# The pure-Python packages each framework's config and loss modules import that the project's
# venv lacks (torch, transformers, numpy are the venv's own). Installed --no-deps beside it.
DEPS: dict[str, tuple[str, ...]] = {
    "verl": ("omegaconf==2.3.0", "hydra-core==1.3.2", "antlr4-python3-runtime==4.9.3", "tensordict==0.10.0",
             "pyvers==0.1.0", "codetiming==1.4.0", "accelerate==1.10.1", "orjson==3.13.0", "datasets==4.0.0",
             "dill==0.3.8", "multiprocess==0.70.16", "xxhash==3.5.0"),
    "trl": ("accelerate==1.10.1", "datasets==4.0.0", "dill==0.3.8", "multiprocess==0.70.16",
            "xxhash==3.5.0"),
    "openrlhf": (),
    # AReaL pins these two dev releases itself (its METADATA); `import areal` reaches its infra modules.
    "areal": ("omegaconf==2.4.0.dev2", "hydra-core==1.4.0.dev1", "colorlog==6.12.0", "tenacity==9.2.1",
              "flask==3.1.3", "werkzeug==3.1.9", "blinker==1.9.0", "itsdangerous==2.2.0", "torchdata==0.11.0",
              "aiofiles==25.1.0", "orjson==3.13.0", "tabulate==0.10.0", "datasets==4.0.0", "dill==0.3.8",
              "multiprocess==0.70.16", "xxhash==3.5.0"),
    "slime": (),
    "prime-rl": ("prime-pydantic-config==0.4.3",),
}


def pairs() -> list[tuple[str, str]]:
    """Every (framework, version) under test, for pytest.mark.parametrize."""
    return [(name, version) for name, versions in RELEASES.items() for version in versions]


def _pip_target(target: Path, requirements: tuple[str, ...]) -> None:
    """Install `requirements` --no-deps into `target`, once: a marker names what is there, so a
    changed list reinstalls and an interrupted install is redone."""
    marker = target / ".installed"
    wanted = "\n".join(requirements)
    if marker.exists() and marker.read_text() == wanted:
        return
    target.mkdir(parents=True, exist_ok=True)
    if requirements:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--no-compile", "--upgrade", "--target", str(target), *requirements],
                       check=True, stdout=subprocess.DEVNULL)
    marker.write_text(wanted)


def install(framework: str, version: str) -> list[Path]:
    """The folders to put first on sys.path for `framework==version`: the release, then its deps."""
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".lock", "w") as lock:  # two pytest processes must not half-install one release
        fcntl.flock(lock, fcntl.LOCK_EX)
        deps = ROOT / f"deps-{framework}"
        _pip_target(deps, DEPS[framework])
        if framework in VENDORED:
            return [deps]
        release = ROOT / f"{framework}-{version}"
        _pip_target(release, (f"{PACKAGES[framework]}=={version}",))
    return [release, deps]


class ReleaseRefused(Exception):
    """The release raised on what we gave it: its own error, as it would show the user."""


def run(framework: str, version: str, driver: str, payload: dict[str, Any], timeout: float = 300) -> Any:
    """Run tests/release_drivers/DRIVER.py against `framework==version` with `payload` on stdin;
    its answer (the last stdout line, JSON), or ReleaseRefused with the release's error."""
    path = os.pathsep.join(str(p) for p in [*install(framework, version), DRIVERS])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONNOUSERSITE": "1", "MISMATCH_RELEASE": f"{framework}=={version}"}
    done = subprocess.run([sys.executable, str(DRIVERS / f"{driver}.py")], input=json.dumps(payload),
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=str(DRIVERS))
    lines = done.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if answer is None:
        raise RuntimeError(f"{driver} on {framework}=={version} gave no answer (exit {done.returncode}):\n"
                           f"{done.stderr[-4000:]}")
    if "refused" in answer:
        raise ReleaseRefused(answer["refused"])
    return answer["result"]


def run_drivers(framework: str, version: str, asked: dict[str, list[dict[str, Any]]],
                timeout: float = 900) -> dict[str, list[dict[str, Any]]]:
    """Many drivers' payloads against one release in one subprocess (its imports paid once):
    {driver: [answer, ...]}, each answer {"result": ...} or {"refused": "..."}."""
    return run(framework, version, "_many", asked, timeout=timeout)


def run_batch(framework: str, version: str, driver: str, payloads: list[dict[str, Any]],
              timeout: float = 600) -> list[dict[str, Any]]:
    """`run` on many payloads in one subprocess: each answer {"result": ...} or {"refused": "..."}."""
    return run(framework, version, driver, {"batch": payloads}, timeout=timeout)


if __name__ == "__main__":  # .ci/setup: every release the tests load, installed ahead of them
    for name, version in pairs():
        install(name, version)
        print(f"installed {name}=={version} under {ROOT}")
