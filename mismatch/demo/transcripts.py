"""The tiny model's training conversations: toy-agent transcripts (calculator calls, follow-ups,
summaries, a delegated helper) and the bundled prose as Q&A, in OpenAI-style message lists.

What `tinymodel` renders with its chat template and trains on; seeded, so the same seed gives
the same conversations.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_SYSTEM_PROMPTS = (
    "You are a helpful assistant. Use the calculator tool for arithmetic.",
    "You are a careful agent with two tools: calculator and delegate. Answer briefly.",
    "You are a math agent. Call the calculator, then give the answer in one sentence.",
)
_OPS = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}
_OP_FUNCTIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
_ASKS = ("What is {e}?", "Compute {e}.", "Please calculate {e}.", "Can you work out {e} for me?",
         "How much is {e}?", "What is {w}?", "I need {e}, please.")
_ASKS_BY_OP = {"+": "Add {a} and {b}.", "-": "Subtract {b} from {a}.",
               "*": "Multiply {a} by {b}.", "/": "Divide {a} by {b}."}
_THOUGHTS = ("", "", "Let me use the calculator.", "I will compute this with the calculator.",
             "I need the calculator for this.")
_ANSWERS = ("The answer is {r}.", "{e} = {r}.", "It is {r}.", "The result is {r}.")
_FOLLOW_UPS = {"+": "And what is that plus {c}?", "-": "Now subtract {c} from that.",
               "*": "Now multiply that by {c}.", "/": "Can you divide that by {c}?"}
_FACT_ASKS = ("Tell me something about {t}.", "Do you know a fact about {t}?",
              "Share a tip about {t}.", "What should I know about {t}?")
_DELEGATE_TASKS = {
    "weather": ("Find out what the weather will be like tomorrow.", "Check the weather report."),
    "cooking": ("Find a simple cooking tip for dinner tonight.", "Look up how to cook rice."),
    "travel": ("Plan a short trip to the city.", "Find out when the train leaves."),
    "gardening": ("Find out how to look after a small garden.", "Check what the tomatoes need."),
}


def chat_conversations(seed: int, num_tool_conversations: int = 320) -> list[list[dict[str, Any]]]:
    """Message lists (OpenAI style) behind tinymodel.chat_corpus, shuffled; every prose line used once."""
    rng = random.Random(seed)
    kinds = (_single, _two_step, _follow_up, _with_summary, _delegate)
    weights = (4, 2, 2, 2, 1)
    conversations = [rng.choices(kinds, weights)[0](rng) for _ in range(num_tool_conversations)]
    conversations += [_fact(topic, line, rng) for topic, line in prose()]
    rng.shuffle(conversations)
    return conversations


def _expression(rng: random.Random) -> tuple[int, str, int]:
    op = rng.choice("+-*/")
    if op == "+":
        return rng.randint(0, 99), op, rng.randint(0, 99)
    if op == "-":
        a = rng.randint(0, 99)
        return a, op, rng.randint(0, a)
    if op == "*":
        return rng.randint(2, 20), op, rng.randint(2, 20)
    b = rng.randint(2, 12)  # exact division keeps every result an integer
    return b * rng.randint(1, 12), op, b


def _apply(a: int, op: str, b: int) -> int:
    return _OP_FUNCTIONS[op](a, b)


def _operand(rng: random.Random, op: str, value: int) -> int:
    """A second operand that keeps `value op c` an integer and small."""
    if op == "/":
        divisors = [d for d in range(2, 10) if value % d == 0]
        return rng.choice(divisors) if divisors else 1
    return rng.randint(2, 9) if op == "*" else rng.randint(1, 50)


def _call(name: str, **arguments: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _calc_turns(rng: random.Random, expression: str,
                thought: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """Assistant calls the calculator, the tool answers; returns the messages and the result."""
    a, op, b = expression.split(" ")
    result = _apply(int(a), op, int(b))
    thought = rng.choice(_THOUGHTS) if thought is None else thought
    call = _call("calculator", expression=expression)
    return [{"role": "assistant", "content": thought, "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(result)}], result


def _ask(rng: random.Random, a: int, op: str, b: int) -> str:
    if rng.random() < 0.25:
        return _ASKS_BY_OP[op].format(a=a, b=b)
    return rng.choice(_ASKS).format(e=f"{a} {op} {b}", w=f"{a} {_OPS[op]} {b}")


def _answer(rng: random.Random, expression: str, result: int) -> dict[str, Any]:
    return {"role": "assistant", "content": rng.choice(_ANSWERS).format(e=expression, r=result)}


def _system(rng: random.Random) -> list[dict[str, Any]]:
    return [{"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)}]


def _single(rng: random.Random) -> list[dict[str, Any]]:
    a, op, b = _expression(rng)
    expression = f"{a} {op} {b}"
    turns, result = _calc_turns(rng, expression)
    return [*_system(rng), {"role": "user", "content": _ask(rng, a, op, b)}, *turns,
            _answer(rng, expression, result)]


def _two_step(rng: random.Random) -> list[dict[str, Any]]:
    a, op, b = _expression(rng)
    first = f"{a} {op} {b}"
    first_turns, r1 = _calc_turns(rng, first)
    op2 = rng.choice("+-*")
    c = _operand(rng, op2, r1)
    second = f"{r1} {op2} {c}"
    second_turns, r2 = _calc_turns(rng, second, thought=f"Now I apply {_OPS[op2]} {c} to {r1}.")
    if rng.random() < 0.5:
        ask = f"What is ({a} {op} {b}) {op2} {c}?"
    else:
        ask = f"Take {a} {_OPS[op]} {b}, then {_OPS[op2]} {c}."
    return [*_system(rng), {"role": "user", "content": ask}, *first_turns, *second_turns,
            {"role": "assistant", "content": f"The answer is {r2}."}]


def _follow_up(rng: random.Random) -> list[dict[str, Any]]:
    messages = _single(rng)
    r1 = int(messages[-2]["content"])
    op2 = rng.choice("+-*/")
    c = _operand(rng, op2, r1)
    if op2 == "/" and c == 1:
        op2, c = "+", rng.randint(1, 50)
    second = f"{r1} {op2} {c}"
    turns, r2 = _calc_turns(rng, second)
    return [*messages, {"role": "user", "content": _FOLLOW_UPS[op2].format(c=c)}, *turns,
            _answer(rng, second, r2)]


def _with_summary(rng: random.Random) -> list[dict[str, Any]]:
    messages = _single(rng) if rng.random() < 0.6 else _follow_up(rng)
    calls = [m["tool_calls"][0]["function"]["arguments"]["expression"]
             for m in messages if m.get("tool_calls")]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    summary = (f"Summary: the user asked for {' and then '.join(calls)}; "
               f"the calculator returned {' and '.join(results)}.")
    messages += [{"role": "user", "content": "Summarize the conversation so far."},
                 {"role": "summary", "content": summary}]
    if rng.random() < 0.5:  # the agent keeps going after compaction
        messages += _single(rng)[1:]
    return messages


def _delegate(rng: random.Random) -> list[dict[str, Any]]:
    topic = rng.choice(sorted(_DELEGATE_TASKS))
    task = rng.choice(_DELEGATE_TASKS[topic])
    report = rng.choice([line for t, line in prose() if t == topic])
    thought = rng.choice(("", "I will hand this to a helper.", "A helper agent can do this."))
    return [*_system(rng), {"role": "user", "content": task},
            {"role": "assistant", "content": thought, "tool_calls": [_call("delegate", task=task)]},
            {"role": "tool", "name": "delegate", "content": f"Report: {report}"},
            {"role": "assistant", "content": f"The helper found this: {report}"}]


def _fact(topic: str, line: str, rng: random.Random) -> list[dict[str, Any]]:
    system = _system(rng) if rng.random() < 0.5 else []
    return [*system, {"role": "user", "content": rng.choice(_FACT_ASKS).format(t=topic)},
            {"role": "assistant", "content": line}]


def prose() -> Iterator[tuple[str, str]]:
    """(topic, sentence) pairs from the bundled corpus.txt, whose `# topic` lines head sections."""
    topic = "general"
    for line in Path(__file__).with_name("corpus.txt").read_text().splitlines():
        line = line.strip()
        if line.startswith("# "):
            topic = line[2:]
        elif line:
            yield topic, line
