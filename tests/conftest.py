"""Shared fixtures: one tiny trained checkpoint and one set of sampled rollouts per machine.

Both are cached under .cache/tests (or $MISMATCH_TEST_CACHE) because building them takes tens of
seconds; the builders are deterministic, so a cache hit is the same bytes as a rebuild.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MISMATCH_TEST_CACHE", REPO / ".cache" / "tests"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# vLLM on CPU (MACHINE.md): a small KV cache and an in-process engine core (3 s load, not 20 s).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    from mismatch.demo import tinymodel
    from mismatch.demo.tinymodel import ensure_tiny_checkpoint

    # Keyed by the builder's source and corpus so a changed builder never serves a stale cache.
    builder = Path(tinymodel.__file__)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(
        [builder, builder.with_name("transcripts.py"), *builder.parent.glob("*.txt")]))).hexdigest()[:12]
    return ensure_tiny_checkpoint(CACHE / f"tiny-llama-seed0-{digest}").path


@pytest.fixture(scope="session")
def architecture_checkpoint(tiny_checkpoint: Path):
    """A builder of tiny random-init checkpoints per architecture (mismatch.demo.architectures),
    cached like the trained one and keyed by the builder's source."""
    from mismatch.demo import architectures

    digest = hashlib.sha256(Path(architectures.__file__).read_bytes()).hexdigest()[:12]

    def build(name: str) -> Path:
        return architectures.build_architecture(name, CACHE / f"arch-{name}-{digest}", tokenizer_from=tiny_checkpoint)
    return build


@pytest.fixture(scope="session")
def sampled_rollouts(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rollouts sampled by the toy agent (bf16 hf-decode sampler) from the tiny checkpoint."""
    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

    path = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    write_rollouts(tiny_checkpoint, path, HarnessConfig(num_rollouts=6))
    return path


@pytest.fixture()
def demo_dir(tmp_path: Path, tiny_checkpoint: Path) -> Path:
    """A demo dir that already holds the cached checkpoint (so `mismatch demo` skips the build)."""
    root = tmp_path / "demo"
    shutil.copytree(tiny_checkpoint, root / "checkpoint")
    return root


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`).

    Two OpenMP threads on two shared cores spin-wait whenever another process is busy: many small
    ops took 0.4 s on one thread and 17 s on two beside a busy process (measured).
    """
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# The three pairs an audit measures, for the analysis tests.
PAIRS = [("train", "sampler"), ("train", "infer"), ("infer", "sampler")]


def agentic_frame(rng: np.random.Generator, *, rollouts: int, subagent_every: int, answer_max: int) -> pd.DataFrame:
    """The key columns of a token table in audit order (rollouts, branches, turns; a user prompt
    then an assistant answer per turn, only answers trainable); the caller adds log-prob columns."""
    rows = []
    for r in range(rollouts):
        for branch, kind in [("main", "main"), *([("sub-1", "subagent")] if r % subagent_every == 0 else [])]:
            pos = 0
            for turn in range(int(rng.integers(1, 5))):
                for role, length in (("user", int(rng.integers(2, 6))), ("assistant", int(rng.integers(3, answer_max)))):
                    for _ in range(length):
                        rows.append((f"r{r}", branch, kind, turn, pos, role, role == "assistant"))
                        pos += 1
    frame = pd.DataFrame(rows, columns=["rollout", "branch", "branch_kind", "turn", "pos", "role", "trainable"])
    for key in ("rollout", "branch", "branch_kind", "role"):
        frame[key] = frame[key].astype("category")
    return frame


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def running_vllm_server(command: list[str], port: int, log: Path, env: dict[str, str],
                        timeout: float = 180) -> Iterator[str]:
    """A real `vllm serve` (the API server module: `vllm serve` asks importlib.metadata for a
    "vllm" distribution, which vllm-cpu is not) started with `command`, its URL once /v1/models
    answers; stopped at the end. Its output goes to `log`, whose tail a failure shows."""
    import subprocess
    import time
    import urllib.request

    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm server exited with {process.returncode}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"vllm server not up after {timeout:g} s:\n{log_tail(log)}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
