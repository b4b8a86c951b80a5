"""Render drift: stored token ids against the re-rendered `messages`, on hand-built chats and on
toy-agent rollouts whose harness rewrote one tool call's arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch.checkpoint import load_tokenizer
from mismatch.rollouts.drift import describe_span, drift_file, find_drift, render_ids
from mismatch.errors import MismatchError, RolloutError
from mismatch.rollouts import Rollout, check_rollout, load_rollouts
from mismatch.demo.toy_agent import HarnessConfig, write_rollouts


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    return load_tokenizer(tiny_checkpoint)


@pytest.fixture(scope="module")
def faulty_rollouts(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("drift") / "rollouts.jsonl"
    write_rollouts(tiny_checkpoint, path, HarnessConfig(num_rollouts=2, max_turns=2,
                                                        faults=("rewrite_tool_args",)))
    return path


def _call(arguments: str) -> dict:
    return {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}


def _chat(answer: str = "The answer is 5.", arguments: str = '{"expression": "2 + 3"}') -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "", "tool_calls": [_call(arguments)]},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": answer}]


def _rollout(tokenizer, sampled: list[dict], stored_messages: list[dict]) -> Rollout:
    """A main branch whose tokens are `sampled` rendered (as the harness streamed them), carrying
    `stored_messages` as its messages."""
    probe, _ = check_rollout({"id": "probe", "branches": [{"id": "main", "segments": [
        {"role": "user", "tokens": [1]}]}], "messages": sampled}, file="t", line=1, vocab_size=None)
    ids, owner = render_ids(tokenizer, probe)
    ids, owner = ids[:-1], owner[:-1]  # generation stopped at the last <|end|>: no separator after it
    segments = []
    for index, message in enumerate(sampled):
        tokens = [t for t, o in zip(ids, owner) if o == index]
        segment = {"role": message["role"], "tokens": tokens}
        if message["role"] == "assistant":
            segment["logprobs"] = [-0.1] * len(tokens)
        segments.append(segment)
    rollout, errors = check_rollout({"id": "r-hand", "branches": [{"id": "main", "segments": segments}],
                                     "messages": stored_messages}, file="t", line=1, vocab_size=None)
    assert not errors, errors
    return rollout


def test_messages_that_match_the_tokens_drift_nowhere(tokenizer) -> None:
    drift = find_drift([_rollout(tokenizer, _chat(), _chat())], tokenizer)
    assert drift["spans"] == [] and drift["num_rollouts_checked"] == 1


def test_a_python_rewritten_false_is_named_with_its_turn(tokenizer) -> None:
    sampled = _chat(arguments='{"expression": "2 + 3", "exact": false}')
    stored = _chat(arguments='{"expression": "2 + 3", "exact": False}')  # a harness str(dict) round-trip
    [span] = find_drift([_rollout(tokenizer, sampled, stored)], tokenizer)["spans"]
    assert (span["rollout"], span["turn"], span["role"], span["message"]) == ("r-hand", 0, "assistant", 2)
    assert span["kind"] == "case" and span["in_tool_call"]
    assert "false" in span["stored"] and "False" in span["rendered"]
    assert span["trainable_tokens"] == len(span["stored_ids"]) > 0


def test_a_dropped_think_block_counts_its_trainable_tokens(tokenizer) -> None:
    sampled = _chat(answer="<think>2 plus 3 is 5.</think>The answer is 5.")
    [span] = find_drift([_rollout(tokenizer, sampled, _chat())], tokenizer)["spans"]
    assert span["turn"] == 1 and span["kind"] == "think_dropped" and not span["in_tool_call"]
    assert span["stored"] == "<think>2 plus 3 is 5.</think>" and span["rendered"] == ""
    assert span["trainable_tokens"] == len(tokenizer.encode(span["stored"], add_special_tokens=False))


def test_reformatted_tool_call_json_is_whitespace_drift(tokenizer) -> None:
    stored = _chat(arguments=json.dumps({"expression": "2 + 3"}, separators=(",", ":")))
    [span] = find_drift([_rollout(tokenizer, _chat(), stored)], tokenizer)["spans"]
    assert span["kind"] == "whitespace" and span["in_tool_call"] and span["turn"] == 0
    assert '"expression": "2 + 3"' in span["stored_context"]
    assert '"expression":"2 + 3"' in span["rendered_context"]


def test_a_non_canonical_sampled_split_is_retokenized_drift(tokenizer) -> None:
    rollout = _rollout(tokenizer, _chat(answer="It is 60."), _chat(answer="It is 60."))
    merged = tokenizer.encode(" 60", add_special_tokens=False)
    split = tokenizer.encode(" 6", add_special_tokens=False) + tokenizer.encode("0", add_special_tokens=False)
    assert len(merged) == 1 and len(split) == 2  # BPE merges what the model may sample apart
    segments = []
    for segment in rollout.branch("main").segments:
        tokens = segment.tokens.tolist()
        at = next((i for i in range(len(tokens)) if tokens[i:i + 1] == merged), None)
        if segment.role == "assistant" and at is not None:
            tokens[at:at + 1] = split
        segments.append({"role": segment.role, "tokens": tokens,
                         **({"logprobs": [-0.1] * len(tokens)} if segment.role == "assistant" else {})})
    sampled, errors = check_rollout({"id": "r-split", "branches": [{"id": "main", "segments": segments}],
                                     "messages": rollout.messages}, file="t", line=1, vocab_size=None)
    assert not errors
    drift = find_drift([sampled], tokenizer)
    [span] = drift["spans"]
    assert (span["kind"], span["stored"], span["rendered"], span["turn"]) == ("retokenized", " 60", " 60", 1)
    assert span["stored_ids"] == split and span["rendered_ids"] == merged and span["trainable_tokens"] == 2
    assert drift["spans_by_kind"] == {"retokenized": 1}


def test_messages_the_template_cannot_render_name_the_rollout(tokenizer) -> None:
    bad = [*_chat()[:-1], {"role": "robot", "content": "beep"}]
    with pytest.raises(RolloutError, match=r"^t:1: rollout 'r-hand': messages: chat template cannot "
                                           r"render them: .*Unknown chat role: robot"):
        find_drift([_rollout(tokenizer, _chat(), bad)], tokenizer)


def test_toy_agent_messages_rerender_to_the_stored_tokens_except_the_injected_rewrite(
        tiny_checkpoint, faulty_rollouts) -> None:
    rollouts = load_rollouts(faulty_rollouts)
    faulty = [r for r in rollouts if "rewrite_tool_args" in r.meta.get("injected_faults", [])]
    assert len(faulty) == 1, "the fault must land in exactly one rollout"
    rollout = faulty[0]
    # The rewritten call: its turn is the number of model turns before its message.
    index = next(i for i, m in enumerate(rollout.messages) for call in m.get("tool_calls", ())
                 if '":"' in call["function"]["arguments"])
    turn = sum(m["role"] == "assistant" for m in rollout.messages[:index])

    drift = drift_file(tiny_checkpoint, faulty_rollouts)
    assert drift["num_rollouts_checked"] == 2 and drift["num_rollouts_drifted"] == 1
    assert drift["spans_by_kind"] == {"whitespace": 1}
    [span] = drift["spans"]
    assert (span["rollout"], span["turn"], span["message"]) == (rollout.id, turn, index)
    assert span["kind"] == "whitespace" and span["in_tool_call"] and span["trainable_tokens"] >= 1
    assert '{"expression": "' in span["stored_context"] and '{"expression":"' in span["rendered_context"]
    assert describe_span(span).startswith(f"{rollout.id} turn {turn} (assistant, whitespace, ")
    # Every other message list is a faithful OpenAI-style record: arguments are JSON strings.
    for r in rollouts:
        for message in r.messages:
            for call in message.get("tool_calls", ()):
                assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_an_unknown_harness_fault_is_refused() -> None:
    with pytest.raises(MismatchError, match=r"^HarnessConfig.faults: unknown fault 'drop_think' "
                                            r"\(known: rewrite_tool_args, shift_logprobs\)$"):
        HarnessConfig(faults=("drop_think",))


def _recorded(drift: object) -> Rollout:
    """A two-branch recording as `mismatch record` writes one: main, and a fork whose prompt
    rewrote main's tokens 3..4 (meta.record.drift says so)."""
    rollout, errors = check_rollout({"id": "rec", "meta": {"record": {"proxy": "mismatch record", "drift": drift}},
                                     "branches": [
                                         {"id": "main", "segments": [{"role": "user", "tokens": [5, 6, 7]},
                                                                     {"role": "assistant", "tokens": [8, 9],
                                                                      "logprobs": [-0.5, -0.5]}]},
                                         {"id": "b1", "kind": "subagent", "parent": "main", "fork_at": 3,
                                          "segments": [{"role": "user", "tokens": [10, 11]}]}]},
                                    file="rec.jsonl", line=1, vocab_size=None)
    assert not errors, errors
    return rollout


ENTRY = {"request": 1, "turn": 0, "at_turn": 1, "branch": "main", "start": 3, "stored": [8, 9],
         "rendered_branch": "b1", "rendered_start": 3, "rendered": [10, 11]}


def test_a_recorded_drift_entry_is_read_as_its_span(tokenizer) -> None:
    [span] = find_drift([_recorded([ENTRY])], tokenizer)["spans"]
    assert (span["source"], span["branch"], span["stored_start"], span["stored_ids"], span["rendered_ids"],
            span["request"], span["turn"], span["at_turn"], span["role"]) == \
        ("recorded", "main", 3, [8, 9], [10, 11], 1, 0, 1, "assistant")


@pytest.mark.parametrize("drift, says", [
    (3, "meta.record.drift: Expected `array`, got `int`"),
    ([3], "meta.record.drift[0]: Expected `object`, got `int`"),
    ([{**ENTRY, "start": "3"}], "meta.record.drift[0].start: Expected `int`, got `str`"),
    ([{key: value for key, value in ENTRY.items() if key != "stored"}],
     "meta.record.drift[0]: Object missing required field `stored`"),
    ([ENTRY, {**ENTRY, "rendered": [10, True]}], "meta.record.drift[1].rendered[1]: Expected `int`, got `bool`"),
    ([{**ENTRY, "branch": "nope"}], "meta.record.drift[0]: branch 'nope' is not a branch of this rollout"),
    ([{**ENTRY, "rendered_start": -1}], "meta.record.drift[0]: rendered_start must be a token offset, got -1"),
    ([{**ENTRY, "start": 2}], "meta.record.drift[0]: stored tokens are not at 2 of branch 'main''s path"),
])
def test_a_malformed_recorded_drift_is_one_line_naming_its_entry_and_field(tokenizer, drift, says) -> None:
    with pytest.raises(RolloutError) as error:
        find_drift([_recorded(drift)], tokenizer)
    assert str(error.value) == f"rec.jsonl:1: rollout 'rec': {says}"
