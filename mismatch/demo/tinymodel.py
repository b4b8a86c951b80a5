"""A real tiny chat checkpoint (byte-level BPE + 2-layer Llama), trained offline in seconds.

Tests, benchmarks and the demo replay rollouts through it: no hub, same seed → same bytes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedModel,
                          PreTrainedTokenizerFast, Qwen2Config)
from transformers.utils import logging as hf_logging

from mismatch.demo.transcripts import chat_conversations
from mismatch.errors import CheckpointError

# Bump when the corpus, tokenizer or training recipe changes, so cached checkpoints rebuild.
BUILD_FORMAT = 1
BUILD_FILE = "mismatch_build.json"

BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
EXTRA_SPECIAL_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|summary|>",
                        "<tool_call>", "</tool_call>")
SPECIAL_TOKENS = (PAD, BOS, EOS) + EXTRA_SPECIAL_TOKENS  # ids 0..9 in this order
VOCAB_SIZE = 1024  # total, special tokens included

SEQ_LEN = 256
# 8 rather than 16: a faster build, the same held-out loss (benchmarks/RESULTS.md).
BATCH_SIZE = 8
PEAK_LR = 3e-3
MIN_LR_FRACTION = 0.1
MAX_WARMUP_STEPS = 20
LOSS_WINDOW = 20  # final_loss is the mean over this many last steps
# One thread: the bytes then do not depend on the core count, and OpenMP threads spin-waiting
# beside a busy process slow each step to a crawl.
TRAIN_THREADS = 1

ModelConfig = LlamaConfig | Qwen2Config
_CONFIGS: dict[str, type[ModelConfig]] = {"llama": LlamaConfig, "qwen2": Qwen2Config}

# Rendered by transformers' own sandboxed Jinja (trim_blocks, lstrip_blocks), so every literal
# newline lives in a '\n' string literal. Arguments: a JSON string is inserted verbatim and a dict
# goes through tojson, which matches json.dumps defaults, so both spellings render the same.
CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- for message in messages -%}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool', 'summary'] -%}
    {{- raise_exception('Unknown chat role: ' + message.role) -}}
  {%- endif -%}
  {{- '<|' + message.role + '|>\n' -}}
  {%- if message.content is string -%}
    {{- message.content -}}
  {%- elif message.content is defined and message.content is not none -%}
    {{- raise_exception('Message content must be a string') -}}
  {%- endif -%}
  {%- if message.tool_calls is defined and message.tool_calls -%}
    {%- for call in message.tool_calls -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}
      {{- '<tool_call>{"name": ' + (fn.name | tojson) + ', "arguments": ' + args -}}
      {{- '}</tool_call>' -}}
    {%- endfor -%}
  {%- endif -%}
  {{- '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|>\n' -}}
{%- endif -%}"""


@dataclass(frozen=True, slots=True)
class TinyCheckpoint:
    path: Path
    final_loss: float
    vocab_size: int
    num_params: int
    steps: int


# --- public API -------------------------------------------------------------------------------

def build_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, steps: int = 300,
                          arch: str = "llama", progress: Callable[[int], None] | None = None) -> TinyCheckpoint:
    """Train tokenizer and model from scratch and publish them at out_dir in one rename;
    `progress(1)` after each training step."""
    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Same filesystem as out_dir, so the final rename is atomic; a crash leaves only a dot-dir.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        facts = _build_into(tmp_dir, seed=seed, steps=steps, arch=arch, progress=progress)
        facts["build_seconds"] = round(time.perf_counter() - started, 3)
        (tmp_dir / BUILD_FILE).write_text(json.dumps(facts, indent=2) + "\n")
        # mkdtemp and safetensors leave owner-only modes; a shared cache must be readable.
        os.chmod(tmp_dir, 0o755)
        for path in tmp_dir.iterdir():
            os.chmod(path, 0o644)
        _publish(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return _checkpoint_from_facts(out_dir, facts)


def ensure_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, steps: int = 300,
                           arch: str = "llama", progress: Callable[[int], None] | None = None) -> TinyCheckpoint:
    """Return the checkpoint cached at out_dir if it was built with this recipe, else build it."""
    out_dir = Path(out_dir)
    facts = _read_facts(out_dir)
    wanted = {"format": BUILD_FORMAT, "seed": seed, "steps": steps, "arch": arch}
    if facts is not None and all(facts.get(k) == v for k, v in wanted.items()):
        return _checkpoint_from_facts(out_dir, facts)
    return build_tiny_checkpoint(out_dir, seed=seed, steps=steps, arch=arch, progress=progress)


def render_chat(tokenizer: PreTrainedTokenizerFast, messages: Sequence[dict[str, Any]],
                add_generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str)
    return text


def chat_corpus(seed: int) -> list[str]:
    """The training text: toy-agent transcripts plus the bundled prose as Q&A, chat-rendered."""
    renderer = _template_tokenizer()
    return [render_chat(renderer, messages) for messages in chat_conversations(seed)]


# --- tokenizer --------------------------------------------------------------------------------

def _wrap_tokenizer(raw: Tokenizer) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        extra_special_tokens=list(EXTRA_SPECIAL_TOKENS),
        # Byte-level BPE must round-trip exactly; the cleanup would eat spaces before punctuation.
        clean_up_tokenization_spaces=False, model_max_length=2048)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_level(model: models.BPE) -> Tokenizer:
    raw = Tokenizer(model)
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return raw


def _template_tokenizer() -> PreTrainedTokenizerFast:
    """A merge-less byte tokenizer carrying our template: renders the corpus before BPE exists."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab |= {ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)}
    raw = _byte_level(models.BPE(vocab=vocab, merges=[]))
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    return _wrap_tokenizer(raw)


def _train_tokenizer(texts: Sequence[str]) -> PreTrainedTokenizerFast:
    raw = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # The trainer does not split out special tokens itself; left in, they would eat merges.
    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    raw.train_from_iterator((piece for text in texts for piece in special.split(text)), trainer)
    assert raw.get_vocab_size() == VOCAB_SIZE, raw.get_vocab_size()
    return _wrap_tokenizer(raw)


# --- model and training -----------------------------------------------------------------------

def _config(arch: str, tokenizer: PreTrainedTokenizerFast) -> ModelConfig:
    # head_dim 32: the smallest vLLM's CPU attention accepts.
    config = _CONFIGS[arch](
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=384, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config.dtype = torch.float32
    return config


def _lr_at(step: int, steps: int) -> float:
    warmup = max(1, min(MAX_WARMUP_STEPS, steps // 10))
    if step < warmup:
        return PEAK_LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return PEAK_LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def _train(model: PreTrainedModel, token_ids: torch.Tensor, *, seed: int,
           steps: int, progress: Callable[[int], None] | None = None) -> list[float]:
    """AdamW on random 256-token windows of the packed corpus; returns the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    # No weight decay: we want a peaky, near-memorising model, like a policy late in RL.
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    offsets_T = torch.arange(SEQ_LEN + 1)
    losses = []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps)
        starts_B = torch.randint(0, len(token_ids) - SEQ_LEN, (BATCH_SIZE,), generator=generator)
        window_BT = token_ids[starts_B[:, None] + offsets_T]
        logits_BTV = model(input_ids=window_BT[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits_BTV.flatten(0, 1), window_BT[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress(1)
    model.eval()
    return losses


def _build_into(directory: Path, *, seed: int, steps: int, arch: str,
                progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    texts = chat_corpus(seed)
    tokenizer = _train_tokenizer(texts)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    token_ids = torch.tensor([t for ids in encoded for t in ids], dtype=torch.long)
    assert len(token_ids) > SEQ_LEN + 1, len(token_ids)

    with _pinned_torch(seed):
        model = AutoModelForCausalLM.from_config(_config(arch, tokenizer), dtype=torch.float32)
        losses = _train(model, token_ids, seed=seed, steps=steps, progress=progress)

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    # transformers 5 draws a "Writing model shards" bar even for one shard; hide it, then restore.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory)  # safetensors is the only format transformers 5 writes
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(directory)
    tail = losses[-LOSS_WINDOW:]
    return {
        "format": BUILD_FORMAT, "seed": seed, "steps": steps, "arch": arch,
        "final_loss": sum(tail) / len(tail), "first_loss": losses[0],
        "vocab_size": len(tokenizer), "num_params": sum(p.numel() for p in model.parameters()),
        "seq_len": SEQ_LEN, "batch_size": BATCH_SIZE, "peak_lr": PEAK_LR,
        "num_texts": len(texts), "num_tokens": len(token_ids),
        # Bitwise reproducibility holds for a fixed torch build and CPU instruction set.
        "torch": torch.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__, "num_threads": TRAIN_THREADS,
    }


@contextlib.contextmanager
def _pinned_torch(seed: int) -> Iterator[None]:
    """Seeded RNG, deterministic kernels and one thread; the caller's torch state comes back."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    num_threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(TRAIN_THREADS)
        try:
            yield
        finally:
            torch.set_num_threads(num_threads)
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


# --- publishing and the cache -----------------------------------------------------------------

def _check_replaceable(out_dir: Path) -> None:
    # We replace an empty dir or an earlier build of ours, never someone else's files.
    if out_dir.exists() and not (out_dir.is_dir() and
                                 (not any(out_dir.iterdir()) or (out_dir / BUILD_FILE).is_file())):
        raise CheckpointError(
            f"{out_dir}: exists and is not a tiny checkpoint; refusing to overwrite")


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        tmp_dir.rename(out_dir)
        return
    _check_replaceable(out_dir)
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    out_dir.rename(old / "checkpoint")
    tmp_dir.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _read_facts(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / BUILD_FILE
    if not path.is_file():
        return None
    try:
        facts = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(facts, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return facts


def _checkpoint_from_facts(out_dir: Path, facts: dict[str, Any]) -> TinyCheckpoint:
    try:
        return TinyCheckpoint(path=out_dir, final_loss=float(facts["final_loss"]),
                              vocab_size=int(facts["vocab_size"]),
                              num_params=int(facts["num_params"]), steps=int(facts["steps"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{out_dir / BUILD_FILE}: missing or bad field {e}") from None
