"""Shared fixtures: one tiny trained checkpoint and one set of sampled rollouts per machine.

Both are cached under .cache/tests (or $MISMATCH_TEST_CACHE) because building them takes tens of
seconds; the builders are deterministic, so a cache hit is the same bytes as a rebuild.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

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
    from mismatch import tinymodel
    from mismatch.tinymodel import ensure_tiny_checkpoint

    # Keyed by the builder's source and corpus so a changed builder never serves a stale cache.
    builder = Path(tinymodel.__file__)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(
        [builder, *builder.parent.joinpath("data").glob("*.txt")]))).hexdigest()[:12]
    return ensure_tiny_checkpoint(CACHE / f"tiny-llama-seed0-{digest}").path


@pytest.fixture(scope="session")
def sampled_rollouts(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rollouts sampled by the toy agent (bf16 hf-decode sampler) from the tiny checkpoint."""
    from mismatch.toy_agent import HarnessConfig, write_rollouts

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
