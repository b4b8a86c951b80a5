"""OpenRLHF's dump hook (mismatch/hooks/openrlhf.py) on the released rollout path (openrlhf 0.11.2), in
a subprocess (tests/release_drivers/openrlhf_hook.py): the release's agent loader reads two agent
files written as the README says, its RolloutRayActor.generate_responses runs its Multi- and
SingleTurnAgentExecutor against a real vLLM AsyncLLM on CPU, its update_weight syncs new weights
into that engine between two steps, and the dump, read back as format v1, is held to the results
the executors handed OpenRLHF's trainer.

Not run on CPU (the driver's docstring says how each is replaced): Ray's actor placement, and the
NCCL weight broadcast from the trainer's rank 0 (the new weights come from a file instead, loaded
by vLLM into its model through the same collective_rpc the release calls).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import releases

from mismatch.rollouts import load_rollouts

VERSION = "0.11.2"
MAX_LENGTH = 64
SAMPLING = {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def run(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Path]]:
    folder = tmp_path_factory.mktemp("openrlhf")
    dumps = {"multi": folder / "multi.jsonl", "single": folder / "single.jsonl"}
    answer = releases.run("openrlhf", VERSION, "openrlhf_hook", {
        "checkpoint": str(tiny_checkpoint), "dumps": {kind: str(path) for kind, path in dumps.items()},
        "max_length": MAX_LENGTH, "samples": 2, "sampling": SAMPLING}, timeout=600)
    return answer, dumps


def _key(tokens: list[int]) -> tuple[int, ...]:
    return tuple(tokens[:MAX_LENGTH])


def _expected(answer: dict[str, Any], kind: str) -> dict[tuple[int, ...], list[tuple[int, dict[str, Any]]]]:
    """The executors' results by their (trained) tokens: [(step, result), ...]."""
    expected: dict[tuple[int, ...], list[tuple[int, dict[str, Any]]]] = {}
    for step in answer["steps"]:
        for result in step["outputs"][kind]:
            expected.setdefault(_key(result["observation_tokens"]), []).append((step["step"], result))
    return expected


def _tokens(rollout: Any) -> list[int]:
    (branch,) = rollout.branches
    return [t for segment in branch.segments for t in segment.tokens]


@pytest.mark.parametrize("kind", ["multi", "single"])
def test_dump_holds_the_executors_tokens_spans_and_vllm_log_probs(run, kind):
    answer, dumps = run
    rollouts = load_rollouts(dumps[kind])
    expected = _expected(answer, kind)
    assert len(rollouts) == sum(len(v) for v in expected.values()) == 2 * 2 * 2  # steps x prompts x samples
    assert Counter(_key(_tokens(r)) for r in rollouts) == Counter({k: len(v) for k, v in expected.items()})
    for rollout in rollouts:
        (branch,) = rollout.branches
        step, result = next(item for item in expected[_key(_tokens(rollout))] if item[0] == rollout.meta["step"])
        tokens, logprobs = result["observation_tokens"][:MAX_LENGTH], result["rollout_log_probs"]
        ranges = [(s, min(e, MAX_LENGTH)) for s, e in result["action_ranges"] if s < MAX_LENGTH]
        offset = 0
        spans = []
        for segment in branch.segments:
            span = (offset, offset + len(segment.tokens))
            assert list(segment.tokens) == tokens[span[0]:span[1]]
            if segment.role == "assistant":
                spans.append(span)
                assert segment.trainable
                assert list(segment.logprobs) == logprobs[span[0]:span[1]]  # exact: vLLM's floats
            else:
                assert not segment.trainable
                assert segment.role == ("user" if span[0] == 0 else "tool")
            offset = span[1]
        assert spans == ranges
        assert rollout.meta["openrlhf"]["truncated"] == result["truncated"]


def test_step_is_the_weight_version_and_sampler_is_declared(run):
    answer, dumps = run
    for kind in dumps:
        lines = [json.loads(line) for line in dumps[kind].read_text().splitlines()]
        # Appended as the run went: every step-0 sample before the sync, every step-1 one after.
        assert [line["meta"]["step"] for line in lines] == [0] * 4 + [1] * 4
        assert len({line["id"] for line in lines}) == len(lines)
        for line in lines:
            assert line["meta"]["sampler"] == {"engine": "vllm", "dtype": "bfloat16", "temperature": 0.8,
                                               "top_p": 1.0, "top_k": -1, "logprobs": "processed"}
            assert line["meta"]["source"] == {"format": "openrlhf", "hook": "mismatch.hooks"}
    # The sync really changed what the engine samples from: the same prompts, other log-probs.
    first, second = ([r["rollout_log_probs"][8:12] for r in step["outputs"]["single"]] for step in answer["steps"])
    assert first != second


def test_multi_turn_dump_has_feedback_and_a_truncated_tail(run):
    _, dumps = run
    roles = [[s.role for s in r.branches[0].segments] for r in load_rollouts(dumps["multi"])]
    assert any(r[:5] == ["user", "assistant", "tool", "assistant", "tool"] for r in roles)
    assert all(sum(len(s.tokens) for s in r.branches[0].segments) <= MAX_LENGTH
               for r in load_rollouts(dumps["multi"]))


def test_the_audit_of_the_first_steps_dump_replays_vllms_log_probs(run, tiny_checkpoint, tmp_path, capsys):
    """Step 0 sampled from the checkpoint's own weights (step 1 from the synced ones). Replayed as
    OpenRLHF's actor runs (logits / --rollout.temperature, ppo_actor.py:525), the trainer gives
    vLLM's bf16 numbers up to bf16's rounding, and the answer blames no log-prob semantics."""
    from mismatch.cli import main

    answer, dumps = run
    first = tmp_path / "step0.jsonl"
    first.write_text("".join(line + "\n" for line in dumps["single"].read_text().splitlines()
                             if json.loads(line)["meta"]["step"] == 0))
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(first), "--train",
                 f"hf:temperature={SAMPLING['temperature']}", "--infer", "sampler", "--out", str(tmp_path / "audit")]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "audit" / "summary.json").read_text())
    pair = summary["pairs"]["train/sampler"]
    sampled = sum(e - s for result in answer["steps"][0]["outputs"]["single"] for s, e in result["action_ranges"])
    assert pair["n_tokens"] == sampled
    assert pair["log_ratio_abs_mean"] < 0.05
    assert "processed" not in printed.split("answer:")[-1]
    assert "the declaration is wrong" not in printed  # the stored replay of the sampler is not an engine
