"""A small agent harness that samples real multi-turn rollouts from a checkpoint (format v1 out).

It runs the model in a loop with a calculator tool, a delegated subagent and a compaction summary,
sampling in bf16 through the `hf-decode` path and recording each sampled token's log-prob (raw at
temperature 1, temperature-processed otherwise), as a rollout worker does. The main branch's chat
is also kept as OpenAI-style `messages` that re-render to its very token ids through the chat
template; `HarnessConfig.faults` injects known harness bugs for the drift and alignment checks.
`examples/make_rollouts.py` and `mismatch demo` use it.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable, Iterator
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
# The whole of a model turn that the chat template can produce from (content, tool_calls).
TEMPLATE_TURN = re.compile(r"(?P<content>.*?)(?P<calls>(?:<tool_call>.*?</tool_call>)*)", re.S)

# Harness bugs `HarnessConfig.faults` can inject, each into one place of one rollout:
# rewrite_tool_args: the stored `messages` re-serialize one tool call's arguments as compact JSON
#   (the first call of the first rollout that has one), while the tokens keep what was sampled;
# shift_logprobs: the last rollout stores every model segment's log-probs one position early
#   (stored[i] is the log-prob of token i+1; the last token keeps its own).
FAULTS = ("rewrite_tool_args", "shift_logprobs")


@dataclass(kw_only=True, slots=True, frozen=True)
class HarnessConfig:
    num_rollouts: int = 12
    seed: int = 0
    engine: str = "hf-decode"  # or "vllm": sample with vLLM itself
    dtype: str = "bfloat16"
    attn: str = "auto"
    temperature: float = 1.0
    # Truncated sampling (vLLM's order: min-p, top-k, top-p); the log-probs stored are then the
    # processed ones (vLLM's processed_logprobs), and `sampling_mask` stores each token's kept ids.
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    sampling_mask: bool = False
    vllm_logprobs: str = "raw_logprobs"  # the vLLM sampler's logprobs_mode (processed_logprobs: after truncation)
    max_turns: int = 4
    max_turn_tokens: int = 48
    faults: tuple[str, ...] = ()  # names from FAULTS
    device: str = "cpu"  # the hf-decode sampler's (benchmarks/gpu samples on cuda); the draws stay on the CPU

    def __post_init__(self) -> None:
        from mismatch.errors import MismatchError

        unknown = [name for name in self.faults if name not in FAULTS]
        if unknown:
            raise MismatchError(f"HarnessConfig.faults: unknown fault {unknown[0]!r} "
                                f"(known: {', '.join(FAULTS)})")

    @property
    def sampling(self) -> Any:
        from mismatch.streams import Sampling

        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


@dataclass(kw_only=True, slots=True)
class _Stream:
    """A branch being sampled: all its tokens, those the sampler has not seen yet, the segments."""

    state: Any  # the turn sampler's own per-stream state (a KV cache, or nothing)
    tokens: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    # What the template puts after the last sampled turn (`\n`, or `<|end|>\n` when the model ran
    # out of tokens): it opens the next prompt, so the stream is exactly the rendered chat.
    close: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None  # kept for the main branch only


class HFDecodeSampler:
    """Samples through the `hf-decode` path: each new prompt run prefilled, tokens decoded one by one.

    It runs the very ops of the hf-decode replay (feed a chunk, score the last row alone), so
    replaying `hf-decode` with the same dtype reproduces its log-probs bit for bit.
    """

    engine = "hf-decode"

    def __init__(self, checkpoint: str | Path, config: HarnessConfig) -> None:
        import torch

        from mismatch.checkpoint import checkpoint_info, load_model

        self.config = config
        self.model = load_model(checkpoint_info(checkpoint), dtype=config.dtype, attn=config.attn,
                                device=config.device)
        self.lm_head = self.model.get_output_embeddings()
        self.generator = torch.Generator().manual_seed(config.seed)

    def new_state(self) -> dict[str, Any]:
        from mismatch.engines.hf_decode import DecodeSession

        return {"session": DecodeSession(self.model, self.config.device), "pending": []}

    def sample(self, state: dict[str, Any], unsent: list[int], all_tokens: list[int],
               stop_id: int) -> tuple[list[int], list[float], list[list[int]] | None]:
        import torch

        from mismatch.engines.processing import processed_logprobs

        sampling = self.config.sampling
        # The last sampled token was never fed: it goes in front of the new prompt run.
        pending = state["pending"] + unsent
        sampled: list[int] = []
        logprobs: list[float] = []
        kept: list[list[int]] = []
        while len(sampled) < self.config.max_turn_tokens:
            hidden_CD = state["session"].feed(np.asarray(pending))
            with torch.inference_mode():
                if sampling.truncates:
                    logp_V = processed_logprobs(self.lm_head(hidden_CD[-1:]), sampling)[0]
                else:
                    logits_V = self.lm_head(hidden_CD[-1:]).float()[0] / self.config.temperature
                    logp_V = torch.log_softmax(logits_V, dim=-1)
            # The CPU generator draws on any device: one seed, the same draws from the same probabilities.
            token = int(torch.multinomial(logp_V.exp().cpu(), 1, generator=self.generator))
            sampled.append(token)
            logprobs.append(float(logp_V[token]))
            if self.config.sampling_mask:
                kept.append(torch.isfinite(logp_V).nonzero().flatten().tolist())
            pending = [token]
            if token == stop_id:
                break
        state["pending"] = pending
        return sampled, logprobs, kept if self.config.sampling_mask else None


class VLLMSampler:
    """Samples with vLLM itself: each turn is one `generate` on the branch's whole token prompt.

    The stored log-probs are vLLM's sampled-token log-probs (`logprobs=0`, raw mode), as a
    vLLM rollout worker records them.
    """

    engine = "vllm"

    def __init__(self, checkpoint: str | Path, config: HarnessConfig) -> None:
        from mismatch.engines.vllm import shared_llm

        self.config = config
        self.llm = shared_llm(str(checkpoint), dtype=config.dtype, seed=config.seed, logprobs_mode=config.vllm_logprobs,
                              **({"return_sampling_mask": True} if config.sampling_mask else {}))
        self.num_calls = 0

    def new_state(self) -> None:
        return None

    def sample(self, state: None, unsent: list[int], all_tokens: list[int],
               stop_id: int) -> tuple[list[int], list[float], list[list[int]] | None]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # A per-call seed keeps the rollouts reproducible whatever vLLM batches together.
        self.num_calls += 1
        params = SamplingParams(temperature=self.config.temperature, top_p=self.config.top_p,
                                top_k=max(self.config.top_k, 0), min_p=self.config.min_p,
                                max_tokens=self.config.max_turn_tokens, stop_token_ids=[stop_id],
                                logprobs=0, seed=self.config.seed * 1_000_003 + self.num_calls)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(all_tokens))], params,
                                use_tqdm=False)[0].outputs[0]
        tokens = list(out.token_ids)
        logprobs = [float(entry[token].logprob) for token, entry in zip(tokens, out.logprobs)]
        assert len(logprobs) == len(tokens), "vLLM returned no log-prob for a sampled token"
        # vLLM's SamplingMask (vllm/outputs.py): token_ids, one kept-id list per sampled token.
        mask = getattr(out, "sampling_mask", None)
        return tokens, logprobs, [list(ids) for ids in mask.token_ids] if self.config.sampling_mask and mask else None


SAMPLERS = {"hf-decode": HFDecodeSampler, "vllm": VLLMSampler}


class ToyAgent:
    def __init__(self, checkpoint: str | Path, config: HarnessConfig) -> None:
        from mismatch.checkpoint import checkpoint_info, load_tokenizer

        self.config = config
        self.info = checkpoint_info(checkpoint)
        self.tokenizer = load_tokenizer(checkpoint)
        self.sampler = SAMPLERS[config.engine](checkpoint, config)
        self.end_id = self.tokenizer.convert_tokens_to_ids("<|end|>")
        self.bos_id = self.tokenizer.convert_tokens_to_ids("<|bos|>")
        self._rewrites_left = 1 if "rewrite_tool_args" in config.faults else 0

    # -- rendering -------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _message_ids(self, role: str, content: str) -> list[int]:
        return self._encode(f"<|{role}|>\n{content}<|end|>\n")

    def _assistant_message(self, role: str, body: str) -> dict[str, Any]:
        """The OpenAI-style message a careful harness stores for a sampled turn's text.

        Tool calls are parsed out with their arguments kept verbatim (a JSON string), so the
        template renders the very text that was sampled; a turn the template cannot produce
        from (content, tool_calls) keeps its raw text as content.
        """
        parsed = TEMPLATE_TURN.fullmatch(body)
        calls = [] if parsed is None else [_parse_call(text) for text in
                                           re.findall(r"<tool_call>(.*?)</tool_call>", parsed["calls"], re.S)]
        if parsed is None or None in calls or "<tool_call>" in parsed["content"]:
            return {"role": role, "content": body}
        message: dict[str, Any] = {"role": role, "content": parsed["content"]}
        if calls:
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                      "function": {"name": name, "arguments": arguments}}
                                     for i, (name, arguments) in enumerate(calls)]
        return message

    # -- sampling --------------------------------------------------------------------------
    def _new_stream(self, context: list[int], *, close: list[int] = (),
                    messages: list[dict[str, Any]] | None = None) -> _Stream:
        return _Stream(state=self.sampler.new_state(), tokens=list(context), unsent=list(context),
                       close=list(close), messages=messages)

    def _prompt(self, stream: _Stream, role: str, content: str, *, bos: bool = False) -> None:
        ids = stream.close + ([self.bos_id] if bos else []) + self._message_ids(role, content)
        stream.close = []
        stream.unsent += ids
        stream.tokens += ids
        stream.segments.append({"role": role, "tokens": ids})
        if stream.messages is not None:
            stream.messages.append({"role": role, "content": content})

    def _sample(self, stream: _Stream, role: str) -> str:
        """Sample one model turn after its header; returns its text (special tokens kept)."""
        header = self._encode(f"<|{role}|>\n")
        stream.unsent += header
        stream.tokens += header
        stream.segments[-1]["tokens"] += header  # the header belongs to the prompt, not the turn
        sampled, logprobs, kept = self.sampler.sample(stream.state, stream.unsent, stream.tokens, self.end_id)
        stream.unsent = []
        stream.tokens += sampled
        stream.segments.append({"role": role, "tokens": sampled, "logprobs": logprobs,
                                **({"sampling_mask": csr(kept)} if kept is not None else {})})
        # Keep special tokens: <tool_call> is one, and the harness must see it to run the tool.
        text = self.tokenizer.decode(sampled, skip_special_tokens=False)
        finished = sampled[-1] == self.end_id
        stream.close = self._encode("\n" if finished else "<|end|>\n")
        if stream.messages is not None:
            body = text[: -len("<|end|>")] if finished else text
            stream.messages.append(self._assistant_message(role, body))
        return text

    # -- the agent loop --------------------------------------------------------------------
    def _run_loop(self, stream: _Stream, rng: random.Random, turns: int) -> str:
        """Assistant turns with calculator calls until a turn makes no call; returns the last text."""
        text = ""
        for _ in range(turns):
            text = self._sample(stream, "assistant")
            call = TOOL_CALL.search(text)
            if call is None:
                break
            self._prompt(stream, "tool", run_tool(call.group(1)))
        return text

    def rollout(self, index: int) -> dict[str, Any]:
        rng = random.Random(self.config.seed * 100_003 + index)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        question = rng.choice(QUESTIONS).format(a=a, b=b)
        main = self._new_stream([], messages=[])
        self._prompt(main, "system", rng.choice(SYSTEM_PROMPTS), bos=True)
        self._prompt(main, "user", question)
        branches = []
        scenario = ("plain", "subagent", "summary")[index % 3]
        if scenario == "subagent":
            self._sample(main, "assistant")
            fork_at = len(main.tokens)
            sub = self._new_stream(main.tokens, close=main.close)
            self._prompt(sub, "user", f"Task: compute {a} + {b}.")
            answer = self._run_loop(sub, rng, turns=2)
            branches.append(_branch(f"sub-{index}", "subagent", "main", fork_at, sub))
            answer = SPECIAL.sub("", answer).strip() or "(no answer)"
            self._prompt(main, "tool", answer)
        self._run_loop(main, rng, turns=self.config.max_turns)
        if scenario == "summary":
            fork_at = len(main.tokens)
            summary = self._new_stream(main.tokens, close=main.close)
            self._prompt(summary, "user", SUMMARY_REQUEST)
            self._sample(summary, "summary")
            branches.append(_branch("compact-1", "summary", "main", fork_at, summary))
        branches.insert(0, _branch("main", "main", None, None, main))
        meta = self._meta(scenario)
        faults = self._inject_faults(index, main, branches)
        if faults:
            meta["injected_faults"] = faults  # ground truth for tests; no check reads it
        return {"id": f"r-{index}", "meta": meta, "branches": branches, "messages": main.messages}

    def _inject_faults(self, index: int, main: _Stream, branches: list[dict[str, Any]]) -> list[str]:
        faults = []
        if self._rewrites_left and _rewrite_first_tool_args(main.messages):
            self._rewrites_left -= 1
            faults.append("rewrite_tool_args")
        if "shift_logprobs" in self.config.faults and index == self.config.num_rollouts - 1:
            for segment in (seg for branch in branches for seg in branch["segments"]):
                if "logprobs" in segment:
                    segment["logprobs"] = segment["logprobs"][1:] + segment["logprobs"][-1:]
            faults.append("shift_logprobs")
        return faults

    def _meta(self, scenario: str) -> dict[str, Any]:
        # The hf-decode sampler stores log_softmax(logits / T), truncated: processed unless T = 1
        # and no truncation. vLLM returns what its engine's logprobs_mode says (raw by default).
        processed = ((self.config.engine == "hf-decode" and not self.config.sampling.is_identity)
                     or (self.config.engine == "vllm" and self.config.vllm_logprobs == "processed_logprobs"))
        return {"checkpoint": str(self.info.path), "scenario": scenario, "harness": "mismatch.demo.toy_agent",
                "sampler": {"engine": self.config.engine, "dtype": self.config.dtype,
                            **({"attn": self.config.attn} if self.config.engine == "hf-decode" else {}),
                            "temperature": self.config.temperature, "top_p": self.config.top_p,
                            "top_k": self.config.top_k, "min_p": self.config.min_p,
                            "logprobs": "processed" if processed else "raw", "seed": self.config.seed}}

    def rollouts(self) -> Iterator[dict[str, Any]]:
        for index in range(self.config.num_rollouts):
            yield self.rollout(index)


def csr(kept: list[list[int]]) -> dict[str, list[int]]:
    """Per-token kept ids as format v1's `sampling_mask` (CSR, as vLLM's SamplingMaskLists)."""
    return {"offsets": np.concatenate([[0], np.cumsum([len(ids) for ids in kept])]).astype(int).tolist(),
            "token_ids": [i for ids in kept for i in ids]}


def _branch(branch_id: str, kind: str, parent: str | None, fork_at: int | None,
            stream: _Stream) -> dict[str, Any]:
    return {"id": branch_id, "kind": kind, "parent": parent, "fork_at": fork_at,
            "segments": stream.segments}


def _parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a call the template would render as `text`, else None."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    prefix = '{"name": ' + json.dumps(call["name"]) + ', "arguments": '
    if not (text.startswith(prefix) and text.endswith("}")):
        return None
    arguments = text[len(prefix):-1]
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return call["name"], arguments


def _rewrite_first_tool_args(messages: list[dict[str, Any]]) -> bool:
    """The rewrite_tool_args fault: compact-JSON the first call whose arguments then change."""
    for message in messages:
        for call in message.get("tool_calls", ()):
            arguments = call["function"]["arguments"]
            compact = json.dumps(json.loads(arguments), separators=(",", ":"))
            if compact != arguments:
                call["function"]["arguments"] = compact
                return True
    return False


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


def write_rollouts(checkpoint: str | Path, out: str | Path, config: HarnessConfig,
                   progress: Callable[[int], None] | None = None) -> int:
    """Sample `config.num_rollouts` rollouts to a JSONL file (atomically); returns the count.
    `progress(1)` after each rollout."""
    from mismatch.results import atomic_write_text

    agent = ToyAgent(checkpoint, config)
    lines = []
    for rollout in agent.rollouts():
        lines.append(json.dumps(rollout, separators=(",", ":")))
        if progress is not None:
            progress(1)
    atomic_write_text(Path(out), "\n".join(lines) + "\n")
    return len(lines)
