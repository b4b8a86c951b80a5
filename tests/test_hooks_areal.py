"""AReaL's dump hook (mismatch/hooks/areal.py) around the released workflows (areal 1.0.4): the release's
RLVRWorkflow and MultiTurnWorkflow run their `arun_episode` through the wrapper on the tiny checkpoint, on
CPU, in one subprocess (tests/release_drivers/areal_hook.py), then the dump, read back as format v1, is held
to the trajectory tensors the release's workflow returned.

- rlvr: two episodes, at engine versions 3 and 5, the second interrupted by a weight update to version 6
  after two tokens (as RemoteInfEngine.agenerate resumes one): appended with meta.step 3, then 5.
- multi_turn: a retry, so the release's feedback prompt sits between two sampled answers (loss_mask 0).
- resolved: the wrapper named by its import path with kwargs, resolved by the release's own
  RemoteInfEngine._resolve_workflow with group_size 2 (AReaL's GroupedRolloutWorkflow around it).
- interactions: the release's InteractionWithTokenLogpReward (its `to_tensor_dict`), one without tokens.
- an evaluation episode, and a dump whose writes fail: nothing written, the episode untouched.

Not run on CPU: AReaL's remote SGLang/vLLM servers (GPU servers reached over HTTP by RemoteInfEngine). The
driver's engine implements the release's InferenceEngine.agenerate(ModelRequest) -> ModelResponse with
transformers' generate in their place; the hook's meta.sampler for the release's RemoteSGLangEngine and
RemotevLLMEngine is read from those classes, built but not connected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import releases

from mismatch.rollouts import load_rollouts

VERSION = "1.0.4"
SAMPLER = {"engine": "hf-decode", "logprobs": "processed"}  # what the driver's engine returns


@pytest.fixture(scope="module")
def answers(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Path]]:
    root = tmp_path_factory.mktemp("areal-hook")
    cases = {
        "rlvr": {"gconfig": {"temperature": 0.7}, "meta": {"sampler": SAMPLER},
                 "episodes": [{"version": 3}, {"version": 5, "interrupt": {"after": 2, "version": 6}}]},
        "multi_turn": {"gconfig": {"temperature": 0.7}, "episodes": [{"version": 1, "data": {"retry": True}}]},
        "resolved": {"gconfig": {"temperature": 0.9}, "episodes": [{"version": 2}]},
        "interactions": {"episodes": [{"version": 4}, {"version": 4, "is_eval": True}]},
        "failing": {"workflow": "rlvr", "close_dump_first": True, "episodes": [{"version": 4}]},
    }
    payloads = [{"workflow": name, "checkpoint": str(tiny_checkpoint), "dump": str(root / f"{name}.jsonl"),
                 "seed": 0, **case} for name, case in cases.items()]
    results = releases.run_batch("areal", VERSION, "areal_hook", [*payloads, {"engines": True}], timeout=300)
    assert all("result" in r for r in results), results
    out = {name: (r["result"], Path(p["dump"])) for name, p, r in zip(cases, payloads, results)}
    out["engines"] = (results[-1]["result"], root)
    return out


def _row(tensors: dict[str, Any], i: int = 0) -> dict[str, list[Any]]:
    """Row i of a trajectory dict, cut to its attention_mask (AReaL pads on the right)."""
    length = sum(tensors["attention_mask"][i])
    return {name: tensors[name][i][:length] for name in ("input_ids", "loss_mask", "logprobs", "versions")}


def _assert_rollout_is_row(rollout: Any, row: dict[str, list[Any]], *, off_role: str = "user") -> None:
    """The rollout's tokens are the row's input_ids; its assistant segments the loss_mask 1 runs with the row's
    log-probs; the prompt and every mask-0 run after it non-trainable, with no log-probs."""
    (branch,) = rollout.branches
    segments = list(branch.segments)
    assert [t for s in segments for t in s.tokens.tolist()] == row["input_ids"]
    assert segments[0].role == "user" and set(row["loss_mask"][:len(segments[0].tokens)]) == {0}
    start = 0
    for segment in segments:
        stop = start + len(segment.tokens)
        if segment.role == "assistant":
            assert segment.trainable and row["loss_mask"][start:stop] == [1] * (stop - start)
            assert segment.logprobs.tolist() == row["logprobs"][start:stop]  # float32 values, exactly
        else:
            assert segment.role in ("user", off_role) and not segment.trainable and segment.logprobs is None
            assert row["loss_mask"][start:stop] == [0] * (stop - start)
        start = stop


def _lines(dump: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in dump.read_text().splitlines()]


def test_rlvr_episodes_are_appended_with_the_version_that_sampled_them(answers):
    answer, dump = answers["rlvr"]
    rollouts, lines = load_rollouts(dump), _lines(dump)
    assert answer["written"] == len(rollouts) == 2 and answer["refused"] == answer["failed"] == 0
    for episode, rollout in zip(answer["episodes"], rollouts):
        assert episode["same"]  # the wrapper handed AReaL the release's own trajectory object
        _assert_rollout_is_row(rollout, _row(episode["returned"]))
    first, second = (_row(e["returned"]) for e in answer["episodes"])
    assert set(first["versions"][first["loss_mask"].index(1):]) == {3}
    # interrupted after two tokens: those keep version 5, the resumed ones carry 6
    assert second["versions"][second["loss_mask"].index(1):] == [5, 5] + [6] * (sum(second["loss_mask"]) - 2)
    assert [line["meta"]["step"] for line in lines] == [3, 5]
    assert [line["meta"]["areal"]["versions"] for line in lines] == [[3, 3], [5, 6]]
    assert [line["meta"]["areal"]["task_id"] for line in lines] == [0, 1]
    assert lines[0]["meta"]["areal"]["reward"] == answer["episodes"][0]["returned"]["rewards"][0]
    assert len({r.id for r in rollouts}) == 2 and lines[0]["meta"]["source"] == {"format": "areal",
                                                                              "hook": "mismatch.hooks"}
    # the engine named by the user's meta, the sampling from RLVRWorkflow's gconfig (AReaL's default top_k)
    assert lines[0]["meta"]["sampler"] == {**SAMPLER, "temperature": 0.7, "top_p": 1.0, "top_k": 100000000}
    assert answer["is_rollout_workflow"] and answer["wrapper"] == "MismatchDumpWorkflow"


def test_multi_turn_feedback_is_a_user_segment_between_the_sampled_answers(answers):
    answer, dump = answers["multi_turn"]
    (episode,) = answer["episodes"]
    (rollout,) = load_rollouts(dump)
    row = _row(episode["returned"])
    _assert_rollout_is_row(rollout, row)
    assert [(s.role, s.trainable) for s in rollout.branches[0].segments] == [
        ("user", False), ("assistant", True), ("user", False), ("assistant", True)]
    assert _lines(dump)[0]["meta"]["step"] == 1 and episode["same"]


def test_the_wrapper_resolves_from_its_import_path_under_areals_grouping(answers):
    answer, dump = answers["resolved"]
    # AReaL's trainer takes it for a RolloutWorkflow, not an agent that needs its OpenAI proxy
    assert answer["needs_proxy"] is False and answer["is_rollout_workflow"]
    assert answer["wrapper"] == "GroupedRolloutWorkflow"
    (episode,) = answer["episodes"]
    rollouts = load_rollouts(dump)
    assert answer["written"] == len(rollouts) == 2 == len(episode["inner"])
    for i, rollout in enumerate(rollouts):  # the release's concatenation, row by row
        _assert_rollout_is_row(rollout, _row(episode["returned"], i))
    assert [line["meta"]["sampler"] for line in _lines(dump)] == [
        {"engine": "areal:TinyEngine", "temperature": 0.9, "top_p": 1.0, "top_k": 100000000}] * 2


def test_interactions_are_written_through_their_own_tensor_dicts_and_eval_is_not(answers):
    answer, dump = answers["interactions"]
    (rollout,) = load_rollouts(dump)
    first, _ = answer["episodes"]
    _assert_rollout_is_row(rollout, _row(first["returned"]["chat-1"]))
    line = _lines(dump)[0]
    assert line["meta"]["areal"]["interaction"] == "chat-1" and line["meta"]["areal"]["reward"] == 0.5
    # the external-API interaction has no token ids; the eval episode (is_eval) is not written at all
    assert answer["written"] == 1 and answer["skip_reasons"] == {"an interaction without token ids (external API)": 1}


def test_a_failing_dump_leaves_the_episode_to_areal(answers):
    answer, dump = answers["failing"]
    (episode,) = answer["episodes"]
    # the write the file refuses is the dump's to count (StepDump.num_lost), never an error in the episode
    assert answer["failed"] == 0 and answer["lost"] == 1 and answer["first_loss"].startswith("EBADF")
    assert episode["same"] and sum(_row(episode["returned"])["loss_mask"]) > 0
    assert answer["written"] == 0 and dump.read_text() == ""


def test_sampler_meta_of_areals_remote_engines(answers):
    engines, _ = answers["engines"]
    for name in ("sglang", "vllm"):
        assert engines[name]["inner"] == engines[name]["wrapper"]  # RemoteInfEngine or its public wrapper
    sglang, vllm = engines["sglang"]["inner"], engines["vllm"]["inner"]
    # SGLang's log-probs are temperature-scaled only: top-p/top-k kept out of what a processed replay applies
    assert {k: sglang[k] for k in ("engine", "logprobs", "temperature", "not_in_logprobs")} == {
        "engine": "sglang", "logprobs": "processed", "temperature": 0.6,
        "not_in_logprobs": {"top_p": 0.9, "top_k": 100000000}}
    assert {k: vllm[k] for k in ("engine", "logprobs", "temperature", "top_p", "top_k")} == {
        "engine": "vllm", "logprobs": "raw", "temperature": 0.6, "top_p": 0.9, "top_k": 100000000}


def test_the_audit_of_the_dump_replays_the_samplers_log_probs(answers, tiny_checkpoint, tmp_path):
    from mismatch.cli import main

    answer, dump = answers["rlvr"]
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(dump), "--train", "hf", "--infer", "sampler",
                 "--out", str(tmp_path / "audit")]) == 0
    summary = json.loads((tmp_path / "audit" / "summary.json").read_text())
    sampled = sum(sum(_row(e["returned"])["loss_mask"]) for e in answer["episodes"])
    pairs = summary["pairs"]
    assert pairs["train/sampler"]["n_tokens"] == sampled == 16  # both episodes ran to max_new_tokens
    # the dump declares processed log-probs at the gconfig's temperature: the trainer's pass under that
    # temperature gives the engine's numbers (float32 both), the plain pass does not (T = 0.7)
    assert pairs["train_processed/sampler"]["log_ratio_abs_max"] < 1e-4
    assert pairs["train/sampler"]["log_ratio_abs_max"] > 0.1


def test_importing_the_hook_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, mismatch.hooks.areal\n"
            "print(sorted(m for m in ('areal', 'torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
