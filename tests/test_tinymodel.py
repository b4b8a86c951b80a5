"""The tiny offline checkpoint: loadable by the Auto classes, peaky, reproducible, atomic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from mismatch.demo import tinymodel, transcripts
from mismatch.errors import CheckpointError
from mismatch.demo.tinymodel import (BUILD_FILE, SPECIAL_TOKENS, TinyCheckpoint, build_tiny_checkpoint,
                                chat_corpus, ensure_tiny_checkpoint, render_chat)
from mismatch.demo.transcripts import chat_conversations

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is 17 + 25?"}


def _fail_with(error: BaseException):
    def fail(*args, **kwargs):
        raise error
    return fail


def _call(arguments: dict | str) -> dict:
    return {"role": "assistant", "content": "Let me use the calculator.",
            "tool_calls": [{"type": "function",
                            "function": {"name": "calculator", "arguments": arguments}}]}


@pytest.fixture(scope="session")
def tiny(tiny_checkpoint: Path) -> TinyCheckpoint:
    # conftest caches the default recipe (about 35 s to build); this reads its facts back.
    return ensure_tiny_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="session")
def tokenizer(tiny: TinyCheckpoint):
    return AutoTokenizer.from_pretrained(tiny.path, local_files_only=True)


def test_default_build_is_peaky_and_complete(tiny: TinyCheckpoint) -> None:
    facts = json.loads((tiny.path / BUILD_FILE).read_text())
    assert (facts["seed"], facts["steps"], facts["arch"]) == (0, 300, "llama")
    assert tiny.steps == 300
    assert tiny.final_loss < 1.5, tiny.final_loss
    assert facts["first_loss"] > 6.0  # it really trained, from about ln(1024) = 6.93
    assert tiny.final_loss == facts["final_loss"]
    names = sorted(p.name for p in tiny.path.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))], names


def test_loads_with_auto_classes(tiny: TinyCheckpoint, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny.path, local_files_only=True)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert config.vocab_size == len(tokenizer) == tiny.vocab_size == 1024
    assert config.hidden_size // config.num_attention_heads == 32  # vLLM CPU's smallest head_dim
    assert (config.num_hidden_layers, config.num_key_value_heads) == (2, 2)
    assert sum(p.numel() for p in model.parameters()) == tiny.num_params
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    assert model.generation_config.eos_token_id == config.eos_token_id == end_id
    assert tokenizer.eos_token == "<|end|>" and tokenizer.bos_token == "<|bos|>"
    assert tokenizer.pad_token == "<|pad|>"


def test_model_is_peaky_on_unseen_conversations(tiny: TinyCheckpoint, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny.path, local_files_only=True)
    texts = chat_corpus(seed=123)[:10]  # other numbers than the training seed's
    total_nll, num_tokens = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids_T = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
            logp_TV = torch.log_softmax(model(input_ids=ids_T[None]).logits[0, :-1], dim=-1)
            total_nll -= logp_TV.gather(-1, ids_T[1:, None]).sum().item()
            num_tokens += len(ids_T) - 1
    assert total_nll / num_tokens < 1.5


def test_chat_template_renders_tool_call(tokenizer) -> None:
    tool = {"role": "tool", "content": "42"}
    summary = {"role": "summary", "content": "Summary: 17 + 25 = 42."}
    text = render_chat(tokenizer, [SYSTEM, USER, _call({"expression": "17 + 25"}), tool, summary])
    assert text == (
        "<|bos|><|system|>\nYou are a helpful assistant.<|end|>\n"
        "<|user|>\nWhat is 17 + 25?<|end|>\n"
        '<|assistant|>\nLet me use the calculator.<tool_call>{"name": "calculator", '
        '"arguments": {"expression": "17 + 25"}}</tool_call><|end|>\n'
        "<|tool|>\n42<|end|>\n"
        "<|summary|>\nSummary: 17 + 25 = 42.<|end|>\n")
    as_string = render_chat(tokenizer, [SYSTEM, USER, _call(json.dumps({"expression": "17 + 25"})),
                                        tool, summary])
    assert as_string == text
    assert render_chat(tokenizer, [USER], add_generation_prompt=True).endswith(
        "<|end|>\n<|assistant|>\n")


def test_chat_template_rejects_unknown_role(tokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="^Unknown chat role: critic$"):
        render_chat(tokenizer, [{"role": "critic", "content": "hm"}])


def test_special_tokens_are_single_ids(tokenizer) -> None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id], token
    text = render_chat(tokenizer, [SYSTEM, USER, _call({"expression": "1 + 1"})])
    encoded = tokenizer.encode(text, add_special_tokens=False)
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert encoded.count(token_id) == text.count(token), token


def test_corpus_round_trips(tokenizer) -> None:
    for text in chat_corpus(seed=0)[:50]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_corpus_covers_the_agent_behaviours() -> None:
    conversations = chat_conversations(seed=0)
    assert chat_corpus(seed=0) == chat_corpus(seed=0) != chat_corpus(seed=1)
    roles = {m["role"] for c in conversations for m in c}
    assert roles == {"system", "user", "assistant", "tool", "summary"}
    tools = {call["function"]["name"] for c in conversations for m in c
             for call in m.get("tool_calls", [])}
    assert tools == {"calculator", "delegate"}
    assert any(sum("tool_calls" in m for m in c) == 2 for c in conversations)
    corpus = "\n".join(chat_corpus(seed=0))
    for topic, line in transcripts.prose():
        assert line in corpus, line


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    threads_before = torch.get_num_threads()
    first = build_tiny_checkpoint(tmp_path / "a", seed=7, steps=5)
    # Building must not move the caller's RNG or leave deterministic mode switched.
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.are_deterministic_algorithms_enabled() == deterministic_before
    assert torch.get_num_threads() == threads_before
    second = build_tiny_checkpoint(tmp_path / "b", seed=7, steps=5)
    other = build_tiny_checkpoint(tmp_path / "c", seed=8, steps=5)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first.path / name).read_bytes() == (second.path / name).read_bytes(), name
    assert first.final_loss == second.final_loss
    assert (first.path / "model.safetensors").read_bytes() != \
        (other.path / "model.safetensors").read_bytes()


@pytest.mark.parametrize("stage, error", [("_train", KeyboardInterrupt), ("_publish", OSError)])
def test_interrupted_build_leaves_no_final_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               stage: str, error: type[BaseException]) -> None:
    # _train fails before any file is written, _publish after every file is written.
    monkeypatch.setattr(tinymodel, stage, _fail_with(error("interrupted")))
    with pytest.raises(error, match="interrupted"):
        build_tiny_checkpoint(tmp_path / "checkpoint", steps=2)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_rebuild_keeps_the_old_checkpoint(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    old = build_tiny_checkpoint(tmp_path / "checkpoint", steps=2)
    old_bytes = (old.path / "model.safetensors").read_bytes()
    monkeypatch.setattr(tinymodel, "_publish", _fail_with(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        ensure_tiny_checkpoint(tmp_path / "checkpoint", steps=3)
    assert (old.path / "model.safetensors").read_bytes() == old_bytes
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]
    assert ensure_tiny_checkpoint(tmp_path / "checkpoint", steps=2) == old


def test_ensure_reuses_a_matching_build_only(tiny: TinyCheckpoint,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tinymodel, "build_tiny_checkpoint", _fail_with(AssertionError("rebuilt")))
    assert ensure_tiny_checkpoint(tiny.path) == tiny
    with pytest.raises(AssertionError, match="rebuilt"):
        ensure_tiny_checkpoint(tiny.path, steps=299)


def test_refuses_to_overwrite_a_foreign_dir(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError) as info:
        build_tiny_checkpoint(tmp_path, steps=1)
    assert str(info.value) == (
        f"{tmp_path}: exists and is not a tiny checkpoint; refusing to overwrite")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^arch must be one of \['llama', 'qwen2'\], got 'gpt2'$"):
        build_tiny_checkpoint(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="^steps must be >= 1, got 0$"):
        build_tiny_checkpoint(tmp_path / "x", steps=0)


def test_qwen2_arch_builds_and_loads(tmp_path: Path) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path / "qwen2", steps=2, arch="qwen2")
    model = AutoModelForCausalLM.from_pretrained(checkpoint.path, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == checkpoint.num_params


def test_make_checkpoint_script_offline(tmp_path: Path) -> None:
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path}
    out = tmp_path / "ckpt"
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "make_checkpoint.py"), str(out), "--steps", "2"],
        env=env, capture_output=True, text=True, check=True, timeout=120)
    assert f"path:       {out}\n" in result.stdout
    assert "params:     656,000 (vocab 1024)" in result.stdout
    assert json.loads((out / BUILD_FILE).read_text())["steps"] == 2
