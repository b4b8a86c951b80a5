"""A small agent harness that samples real multi-turn rollouts from a checkpoint (format v1 out).

It runs the model in a loop with a calculator tool, a delegated subagent and a compaction summary,
sampling in bf16 through the `hf-decode` path and recording each sampled token's raw log-prob,
as a rollout worker does. `examples/make_rollouts.py` and `mismatch demo` use it.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

QUESTIONS = (
    "What is {a} + {b}?", "Compute {a} * {b}.", "What is {a} - {b}?", "Please add {a} and {b}.",
    "How much is {a} times {b}?", "Calculate ({a} + {b}) * 2.",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant with a calculator tool.",
    "You are a careful agent. Use the calculator for arithmetic.",
)
SUMMARY_REQUEST = "Summarize the conversation so far."
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
SPECIAL = re.compile(r"<\|[a-z]+\|>|</?tool_call>")


@dataclass(kw_only=True, slots=True, frozen=True)
class HarnessConfig:
    num_rollouts: int = 12
    seed: int = 0
    dtype: str = "bfloat16"
    attn: str = "sdpa"
    temperature: float = 1.0
    max_turns: int = 4
    max_turn_tokens: int = 48


@dataclass(kw_only=True, slots=True)
class _Stream:
    """A branch being sampled: what the model has seen, what it has not been fed yet, the segments."""

    session: Any
    pending: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)


class ToyAgent:
    def __init__(self, checkpoint: str | Path, config: HarnessConfig) -> None:
        import torch

        from mismatch.checkpoint import checkpoint_info, load_model, load_tokenizer

        self.config = config
        self.info = checkpoint_info(checkpoint)
        self.tokenizer = load_tokenizer(checkpoint)
        self.model = load_model(self.info, dtype=config.dtype, attn=config.attn, device="cpu")
        self.lm_head = self.model.get_output_embeddings()
        self.end_id = self.tokenizer.convert_tokens_to_ids("<|end|>")
        self.generator = torch.Generator().manual_seed(config.seed)

    # -- rendering -------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _message_ids(self, role: str, content: str) -> list[int]:
        return self._encode(f"<|{role}|>\n{content}<|end|>\n")

    # -- sampling --------------------------------------------------------------------------
    def _new_stream(self, context: list[int]) -> _Stream:
        from mismatch.engines.hf_decode import DecodeSession

        return _Stream(session=DecodeSession(self.model, "cpu"), pending=list(context),
                       tokens=list(context))

    def _prompt(self, stream: _Stream, role: str, ids: list[int]) -> None:
        stream.pending += ids
        stream.tokens += ids
        stream.segments.append({"role": role, "tokens": list(ids)})

    def _sample(self, stream: _Stream, role: str) -> str:
        """Sample one model turn (header already in the prompt); returns its text."""
        import torch

        header = self._encode(f"<|{role}|>\n")
        stream.pending += header
        stream.tokens += header
        stream.segments[-1]["tokens"] += header  # the header belongs to the prompt, not the turn
        sampled: list[int] = []
        logprobs: list[float] = []
        while len(sampled) < self.config.max_turn_tokens:
            # Same ops as the hf-decode replay: feed the pending chunk, score the last row alone.
            hidden_CD = stream.session.feed(np.asarray(stream.pending))
            with torch.inference_mode():
                logits_V = self.lm_head(hidden_CD[-1:]).float()[0] / self.config.temperature
                logp_V = torch.log_softmax(logits_V, dim=-1)
            token = int(torch.multinomial(logp_V.exp(), 1, generator=self.generator))
            sampled.append(token)
            logprobs.append(float(logp_V[token]))
            stream.pending = [token]
            if token == self.end_id:
                break
        stream.tokens += sampled
        stream.segments.append({"role": role, "tokens": sampled, "logprobs": logprobs})
        # Keep special tokens: <tool_call> is one, and the harness must see it to run the tool.
        return self.tokenizer.decode(sampled, skip_special_tokens=False)

    # -- the agent loop --------------------------------------------------------------------
    def _run_loop(self, stream: _Stream, rng: random.Random, turns: int) -> str:
        """Assistant turns with calculator calls until a turn makes no call; returns the last text."""
        text = ""
        for _ in range(turns):
            text = self._sample(stream, "assistant")
            call = TOOL_CALL.search(text)
            if call is None:
                break
            self._prompt(stream, "tool", self._message_ids("tool", run_tool(call.group(1))))
        return text

    def rollout(self, index: int) -> dict[str, Any]:
        rng = random.Random(self.config.seed * 100_003 + index)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        question = rng.choice(QUESTIONS).format(a=a, b=b)
        main = self._new_stream([])
        self._prompt(main, "system", [self.tokenizer.convert_tokens_to_ids("<|bos|>")]
                     + self._message_ids("system", rng.choice(SYSTEM_PROMPTS)))
        self._prompt(main, "user", self._message_ids("user", question))
        branches = []
        scenario = ("plain", "subagent", "summary")[index % 3]
        if scenario == "subagent":
            self._sample(main, "assistant")
            fork_at = len(main.tokens)
            sub = self._new_stream(main.tokens)
            self._prompt(sub, "user", self._message_ids("user", f"Task: compute {a} + {b}."))
            answer = self._run_loop(sub, rng, turns=2)
            branches.append(_branch(f"sub-{index}", "subagent", "main", fork_at, sub))
            answer = SPECIAL.sub("", answer).strip() or "(no answer)"
            self._prompt(main, "tool", self._message_ids("tool", answer))
        self._run_loop(main, rng, turns=self.config.max_turns)
        if scenario == "summary":
            fork_at = len(main.tokens)
            summary = self._new_stream(main.tokens)
            self._prompt(summary, "user", self._message_ids("user", SUMMARY_REQUEST))
            self._sample(summary, "summary")
            branches.append(_branch("compact-1", "summary", "main", fork_at, summary))
        branches.insert(0, _branch("main", "main", None, None, main))
        return {"id": f"r-{index}", "meta": self._meta(scenario), "branches": branches}

    def _meta(self, scenario: str) -> dict[str, Any]:
        return {"checkpoint": str(self.info.path), "scenario": scenario, "harness": "mismatch.toy_agent",
                "sampler": {"engine": "hf-decode", "dtype": self.config.dtype, "attn": self.config.attn,
                            "temperature": self.config.temperature, "top_p": 1.0, "top_k": -1,
                            "logprobs": "raw", "seed": self.config.seed}}

    def rollouts(self) -> Iterator[dict[str, Any]]:
        for index in range(self.config.num_rollouts):
            yield self.rollout(index)


def _branch(branch_id: str, kind: str, parent: str | None, fork_at: int | None,
            stream: _Stream) -> dict[str, Any]:
    return {"id": branch_id, "kind": kind, "parent": parent, "fork_at": fork_at,
            "segments": stream.segments}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> float:
    """Arithmetic only (numbers, + - * /, parentheses): the model's text is never eval'd."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("unsupported expression")

    return walk(ast.parse(expression, mode="eval").body)


def run_tool(call_text: str) -> str:
    """The tool message for a model's tool call; a malformed call is answered, not raised."""
    try:
        call = json.loads(call_text)
        expression = call["arguments"]["expression"]
        value = calculate(str(expression))
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, RecursionError):
        return "error: could not evaluate the call"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def write_rollouts(checkpoint: str | Path, out: str | Path, config: HarnessConfig) -> int:
    """Sample `config.num_rollouts` rollouts to a JSONL file (atomically); returns the count."""
    from mismatch.results import atomic_write_text

    agent = ToyAgent(checkpoint, config)
    lines = [json.dumps(rollout, separators=(",", ":")) for rollout in agent.rollouts()]
    atomic_write_text(Path(out), "\n".join(lines) + "\n")
    return len(lines)
