"""Importers: a small file in each framework's documented field names round-trips through format v1."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from mismatch.errors import MismatchError
from mismatch.rollouts.importers import ImportFormatError, import_file
from mismatch.rollouts import Rollout, load_rollouts

# A two-turn agentic sample: prompt, model turn, tool output (mask 0), model turn.
PROMPT = [1, 3, 208, 40, 41, 2, 208, 5, 208]
RESPONSE = [8, 50, 51, 9, 2, 6, 208, 77, 2, 208, 5, 208, 60, 61, 2]
MASK = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
LOGPROBS = [-0.5, -0.25, -0.125, -1.0, -0.01, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0, -0.75, -0.05]


def _jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _imported(format_name: str, path: Path, tmp_path: Path, **kwargs: Any) -> list[Rollout]:
    out = tmp_path / "out.jsonl"
    count = import_file(format_name, path, out, **kwargs)
    rollouts = load_rollouts(out)
    assert count == len(rollouts)
    return rollouts


def _back(rollout: Rollout, branch: str = "main") -> tuple[list[int], list[int], list[int], list[float]]:
    """The framework view again: (prompt, response, mask, log-probs on mask-1 tokens)."""
    segments = rollout.branch(branch).segments
    prompt = segments[0].tokens.tolist()
    response, mask, logprobs = [], [], []
    for segment in segments[1:]:
        response += segment.tokens.tolist()
        mask += [int(segment.trainable)] * len(segment.tokens)
        if segment.trainable and segment.logprobs is not None:
            logprobs += segment.logprobs.tolist()
    return prompt, response, mask, logprobs


def _trained_logprobs() -> list[float]:
    return [lp for lp, m in zip(LOGPROBS, MASK) if m]


def test_verl_agent_loop_outputs_round_trip(tmp_path: Path) -> None:
    records = [{"prompt_ids": PROMPT, "response_ids": RESPONSE, "response_mask": MASK,
                "response_logprobs": LOGPROBS, "reward_score": 1.0, "num_turns": 4,
                "metrics": {"generate_sequences": 0.1, "tool_calls": 0.0}, "extra_fields": {}},
               {"prompt_ids": PROMPT, "response_ids": RESPONSE[:5], "response_mask": MASK[:5],
                "response_logprobs": None, "num_turns": 2}]
    first, second = _imported("verl", _jsonl(tmp_path / "agent_loop.jsonl", records), tmp_path)
    assert _back(first) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
    assert [s.role for s in first.branch("main").segments] == ["user", "assistant", "tool", "assistant"]
    assert first.meta["reward"] == 1.0 and first.meta["source"] == {"format": "verl",
                                                                     "file": str(tmp_path / "agent_loop.jsonl"),
                                                                     "line": 1}
    assert second.id == "verl-2" and second.branch("main").segments[1].logprobs is None


def test_verl_postprocess_batch_drops_its_padding(tmp_path: Path) -> None:
    # `_postprocess` rows: prompts left-padded, responses right-padded, 0.0 log-probs on padding.
    pad_prompt, pad_response = 3, 4
    batch = {"prompts": [[0] * pad_prompt + PROMPT], "responses": [RESPONSE + [0] * pad_response],
             "response_mask": [MASK + [0] * pad_response],
             "attention_mask": [[0] * pad_prompt + [1] * len(PROMPT) + [1] * len(RESPONSE) + [0] * pad_response],
             "rollout_log_probs": [LOGPROBS + [0.0] * pad_response]}
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(batch))
    [rollout] = _imported("verl", path, tmp_path)
    assert rollout.id == "verl-0-0" and _back(rollout) == (PROMPT, RESPONSE, MASK, _trained_logprobs())


def _routing(num_rows: int) -> list[list[list[int]]]:
    """vLLM-like routed experts: 2 MoE layers, top-2 of 8, one row per fed position."""
    return [[[i % 8, (i + 3) % 8], [(i + 1) % 8, (i + 5) % 8]] for i in range(num_rows)]


def _routing_back(rollout: Rollout) -> list[Any]:
    rows: list[Any] = []
    for segment in rollout.branch("main").segments:
        stored = segment.routed_experts
        rows += [None] * len(segment.tokens) if stored is None else \
            [None if row[0, 0] < 0 else row.tolist() for row in stored]
    return rows


def test_verl_routed_experts_are_carried_to_each_segment(tmp_path: Path) -> None:
    """R3 dumps: vLLM's routed experts over prompt + response (the last token never fed: no row)
    land on each token's segment; verl's zero rows (padding, the unfed last token) become null."""
    total = len(PROMPT) + len(RESPONSE)
    expected = [[sorted(layer) for layer in row] for row in _routing(total - 1)] + [None]
    record = {"prompt_ids": PROMPT, "response_ids": RESPONSE, "response_mask": MASK,
              "response_logprobs": LOGPROBS, "routed_experts": _routing(total - 1)}
    [loop] = _imported("verl", _jsonl(tmp_path / "agent_loop.jsonl", [record]), tmp_path)
    assert _routing_back(loop) == expected
    pad_prompt, pad_response = 3, 4
    zeros = [[0, 0], [0, 0]]
    batch = {"prompts": [[0] * pad_prompt + PROMPT], "responses": [RESPONSE + [0] * pad_response],
             "response_mask": [MASK + [0] * pad_response],
             "attention_mask": [[0] * pad_prompt + [1] * total + [0] * pad_response],
             "rollout_log_probs": [LOGPROBS + [0.0] * pad_response],
             "routed_experts": [[zeros] * pad_prompt + _routing(total - 1) + [zeros] * (1 + pad_response)]}
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(batch))
    [padded] = _imported("verl", path, tmp_path)
    assert _routing_back(padded) == expected
    record["routed_experts"] = _routing(total + 1)
    with pytest.raises(ImportFormatError, match=r"routed_experts: must be an array of at most 24 \[layers\]\[top-k\] "
                                                r"rows \(one per token\), got 25"):
        import_file("verl", _jsonl(tmp_path / "long.jsonl", [record]), tmp_path / "o.jsonl")
    record["routed_experts"] = [[[1, 2], [3, 4]]] * 10 + [[[1, 2], [3, 3]]] * (total - 11)
    with pytest.raises(MismatchError, match=r"agent_loop2.jsonl:1: rollout 'verl-1': branches\[0\]\.segments\[1\]\."
                                            r"routed_experts: token 1 layer 1: expert 3 appears twice in one top-k"):
        import_file("verl", _jsonl(tmp_path / "agent_loop2.jsonl", [record]), tmp_path / "o.jsonl")


def test_prime_rl_rollouts_bin_round_trips(tmp_path: Path) -> None:
    # TrainingBatch(examples, temperature, seq_len, step), array_like: fields in declaration order;
    # the second example omits its default advantage (omit_defaults).
    examples = [[PROMPT, [0] * len(PROMPT), RESPONSE, MASK, LOGPROBS, 0.5],
                [PROMPT, [0] * len(PROMPT), RESPONSE[:5], MASK[:5], LOGPROBS[:5]]]
    path = tmp_path / "rollouts.bin"
    path.write_bytes(msgspec.msgpack.encode([examples, 0.7, 4096, 12]))  # as prime-rl writes it
    first, second = _imported("prime-rl", path, tmp_path)
    assert _back(first) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
    assert first.meta["sampler"] == {"engine": "prime-rl", "temperature": 0.7}
    assert first.meta["step"] == 12 and first.meta["advantage"] == 0.5 and "advantage" not in second.meta
    assert (first.id, second.id) == ("prime-rl-0-0", "prime-rl-0-1")


def test_prime_rl_json_examples_use_the_same_names(tmp_path: Path) -> None:
    example = {"prompt_ids": PROMPT, "prompt_mask": [0] * len(PROMPT), "completion_ids": RESPONSE,
               "completion_mask": MASK, "completion_logprobs": LOGPROBS, "advantage": -1.0}
    [rollout] = _imported("prime-rl", _jsonl(tmp_path / "examples.jsonl", [example]), tmp_path)
    assert _back(rollout) == (PROMPT, RESPONSE, MASK, _trained_logprobs()) and "sampler" not in rollout.meta


# prime-rl's structs as PrimeIntellect-ai/prime-rl@559b44772e47 declares them
# (src/prime_rl/transports/rollouts/types.py:15-19 and 74-98, fields in declaration order).
class _RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str


class _MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: _RoutedExperts | None = None
    mm_kwargs: dict | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


def _packed(samples: list[tuple[list[int], list[int], list[float]]], padding: int,
            routing: bool) -> _MicroBatch:
    """Samples packed as trainer/batch.py prepare_sample + _materialize_bin + pad_micro_batch do:
    concatenated, position ids from 0 per sample, padding (id 1, env "") appended to the last one;
    routed experts zero-padded per sample (orchestrator/trajectories.py _encode_routed_experts)."""
    ids, mask, logprobs, positions, rows = [], [], [], [], []
    for tokens, sample_mask, sample_logprobs in samples:
        ids += tokens
        mask += [bool(m) for m in sample_mask]
        logprobs += sample_logprobs
        positions += list(range(len(tokens)))
        rows += _routing(len(tokens) - 1) + [[[0, 0], [0, 0]]]
    lengths = [len(tokens) for tokens, _, _ in samples]
    lengths[-1] += padding
    routed = None
    if routing:
        array = np.array(rows + [[[0, 0], [0, 0]]] * padding, dtype=np.uint8)  # vLLM ids as prime-rl compacts them
        routed = _RoutedExperts(data=array.tobytes(), shape=list(array.shape), dtype=str(array.dtype))
    n = len(ids) + padding
    return _MicroBatch(input_ids=ids + [1] * padding, loss_mask=mask + [False] * padding,
                       advantages=[0.5 if m else 0.0 for m in mask] + [0.0] * padding,
                       inference_logprobs=logprobs + [0.0] * padding, position_ids=positions + list(range(padding)),
                       sequence_lengths=list(lengths), temperatures=[0.7] * n,
                       env_names=["gsm8k"] * len(ids) + [""] * padding, seq_lens=list(lengths), routed_experts=routed)


def test_prime_rl_micro_batch_files_split_samples_and_carry_routing(tmp_path: Path) -> None:
    """A filesystem-transport rank file: one msgpack list of MicroBatch, samples packed, padded."""
    full = (PROMPT + RESPONSE, [0] * len(PROMPT) + MASK, [0.0] * len(PROMPT) + LOGPROBS)
    short = (PROMPT + RESPONSE[:5], [0] * len(PROMPT) + MASK[:5], [0.0] * len(PROMPT) + LOGPROBS[:5])
    path = tmp_path / "step_3" / "rank_0.bin"
    path.parent.mkdir()
    path.write_bytes(msgspec.msgpack.Encoder().encode([_packed([full, short], 3, routing=True),
                                                       _packed([short], 0, routing=False)]))
    first, second, third = _imported("prime-rl", path, tmp_path)
    assert [r.id for r in (first, second, third)] == ["prime-rl-0-0-0", "prime-rl-0-0-1", "prime-rl-0-1-0"]
    assert _back(first) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
    assert _back(second)[:3] == (PROMPT, RESPONSE[:5], MASK[:5])  # the padding is not a token of it
    assert first.meta["sampler"] == {"engine": "prime-rl", "temperature": 0.7} and first.meta["advantage"] == 0.5
    expected = [[sorted(layer) for layer in row] for row in _routing(len(PROMPT) + len(RESPONSE) - 1)] + [None]
    assert _routing_back(first) == expected
    assert _routing_back(second) == [[sorted(layer) for layer in row]
                                     for row in _routing(len(PROMPT) + 4)] + [None]
    assert all(s.routed_experts is None for s in third.branch("main").segments)
    broken = _packed([full], 0, routing=True)
    broken.routed_experts.shape[0] -= 1
    path.write_bytes(msgspec.msgpack.Encoder().encode([broken]))
    with pytest.raises(ImportFormatError, match=r"rank_0.bin\[0\]: \[0\]\.routed_experts: shape \[23, 2, 2\] and 96 "
                                                r"bytes of uint8 do not make \[24 tokens, layers, top-k\]$"):
        import_file("prime-rl", path, tmp_path / "o.jsonl")


def _slime_sample(tokens: list[int], response_length: int, **fields: Any) -> dict[str, Any]:
    """Sample.to_dict() (THUDM/slime@624b824a898a slime/utils/types.py:93-130 fields, :222-227):
    its __dict__ with status as its value and the nested infos as dicts."""
    return {"group_index": 0, "index": 0, "rollout_id": None, "prompt": "2+3?", "tokens": tokens,
            "multimodal_inputs": None, "multimodal_train_inputs": None, "multimodal_train_input_id": None,
            "apply_chat_template_kwargs": {}, "response": "5", "response_length": response_length,
            "label": "5", "reward": 1.0, "loss_mask": None, "weight_versions": ["3"], "rollout_log_probs": None,
            "rollout_top_p_token_ids": None, "rollout_top_p_token_offsets": None, "rollout_routed_experts": None,
            "remove_sample": False, "teacher_log_probs": None, "status": "completed", "metadata": {},
            "generate_function_path": None, "custom_rm_path": None, "train_metadata": None, "session_id": None,
            "non_generation_time": 0.0, "spec_info": {}, "prefix_cache_info": {}, **fields}


def test_slime_debug_rollout_data_round_trips_with_moe_layers_only(tmp_path: Path) -> None:
    """save_debug_rollout_data's torch.save({"rollout_id", "samples"}); SGLang's routed experts
    cover every hidden layer, the dense one (layer 0 here) all zeros (types.py:352-396)."""
    torch = pytest.importorskip("torch")
    tokens = PROMPT + RESPONSE
    captured = [[[0, 0], *row] for row in _routing(len(tokens) - 1)]  # [tokens - 1, 3 layers, top-2]
    samples = [_slime_sample(tokens, len(RESPONSE), loss_mask=MASK, rollout_log_probs=LOGPROBS,
                             rollout_routed_experts=torch.tensor(captured, dtype=torch.int32)),
               _slime_sample(PROMPT + RESPONSE[:5], 5, index=1, rollout_log_probs=LOGPROBS[:5]),
               _slime_sample(PROMPT + RESPONSE[:5], 5, index=2, rollout_log_probs=LOGPROBS[:5], remove_sample=True)]
    path = tmp_path / "rollout_data" / "3.pt"
    path.parent.mkdir()
    torch.save({"rollout_id": 3, "samples": samples}, path)
    first, second, removed = _imported("slime", path, tmp_path, allow_pickle=True)
    assert _back(first) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
    assert [s.role for s in first.branch("main").segments] == ["user", "assistant", "tool", "assistant"]
    assert _routing_back(first) == [[sorted(layer) for layer in row] for row in _routing(len(tokens) - 1)] + [None]
    assert first.meta["step"] == 3 and first.meta["reward"] == 1.0 and first.meta["status"] == "completed"
    assert _back(second) == (PROMPT, RESPONSE[:5], [1] * 5, LOGPROBS[:5])  # loss_mask None: all trained
    assert _back(removed)[2] == [0] * 5 and removed.branch("main").segments[1].logprobs.tolist() == LOGPROBS[:5]
    bad = _jsonl(tmp_path / "samples.jsonl", [_slime_sample(PROMPT, len(PROMPT) + 1)])
    with pytest.raises(ImportFormatError, match=r"samples.jsonl:1: response_length: must be an integer from 0 to the "
                                                r"9 tokens, got 10$"):
        import_file("slime", bad, tmp_path / "o.jsonl")


def test_skyrl_generator_output_round_trips(tmp_path: Path) -> None:
    output = {"prompt_token_ids": [PROMPT, PROMPT, PROMPT], "response_ids": [RESPONSE, RESPONSE[:5], RESPONSE[:5]],
              "rewards": [1.0, 0.0, 0.5], "loss_masks": [MASK, MASK[:5], MASK[:5]],
              "stop_reasons": ["stop", "length", "stop"], "rollout_metrics": {"mean_turns": 2},
              "rollout_logprobs": [LOGPROBS, LOGPROBS[:5], LOGPROBS[:5]],
              "trajectory_ids": [{"instance_id": "q7", "repetition_id": 0}, {"instance_id": "q7", "repetition_id": 1},
                                 {"instance_id": "q7", "repetition_id": 1}],
              "is_last_step": [True, False, True]}
    path = tmp_path / "generator_output.json"
    path.write_text(json.dumps(output))
    rollouts = _imported("skyrl", path, tmp_path)
    # TrajectoryID.to_string(); step-wise repeats of one trajectory get numbered.
    assert [r.id for r in rollouts] == ["q7_0", "q7_1-step0", "q7_1-step1"]
    assert _back(rollouts[0]) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
    assert rollouts[1].meta["stop_reason"] == "length" and rollouts[1].meta["reward"] == 0.0


def _step(prompt: list[int], completion: list[int], *, logprobs: list[float] | None = None,
          messages: tuple[list, list] | None = None) -> dict[str, Any]:
    prompt_messages, completion_messages = messages or ([], [])
    return {"prompt": prompt_messages, "completion": completion_messages, "response": None, "reward": None,
            "advantage": None, "is_truncated": False, "trajectory_id": "t0", "extras": {},
            "tokens": {"prompt_ids": prompt, "prompt_mask": [0] * len(prompt), "completion_ids": completion,
                       "completion_mask": [1] * len(completion),
                       "completion_logprobs": logprobs or [-0.5] * len(completion),
                       "overlong_prompt": False, "is_truncated": False}}


def test_verifiers_steps_merge_while_the_prompt_extends_and_fork_when_it_breaks(tmp_path: Path) -> None:
    first, tool, second = RESPONSE[:5], RESPONSE[5:12], RESPONSE[12:]
    compacted = PROMPT[:4] + [99, 98]  # a summary replaces the history after token 4
    steps = [_step(PROMPT, first, logprobs=LOGPROBS[:5]),
             _step(PROMPT + first + tool, second, logprobs=LOGPROBS[12:]),
             _step(compacted, [70, 2])]
    record = {"example_id": 3, "task": "calc", "reward": 1.0, "trajectory": steps}
    [rollout] = _imported("verifiers", _jsonl(tmp_path / "results.jsonl", [record]), tmp_path)
    assert _back(rollout) == (PROMPT, RESPONSE, MASK, _trained_logprobs())  # steps 1-2: one sample
    fork = rollout.branch("step-1")
    assert (fork.parent, fork.fork_at, fork.kind) == ("main", 4, "subagent")
    assert [s.tokens.tolist() for s in fork.segments] == [[99, 98], [70, 2]]
    assert rollout.meta["example_id"] == 3 and rollout.messages is None  # two branches: no one chat


def test_verifiers_single_branch_rollouts_carry_their_chat(tmp_path: Path) -> None:
    chat = ([{"role": "user", "content": "2+3?"}], [{"role": "assistant", "content": "5"}])
    record = {"state": {"trajectory": [_step(PROMPT, RESPONSE[:5], messages=chat)]}}
    [rollout] = _imported("verifiers", _jsonl(tmp_path / "states.jsonl", [record]), tmp_path)
    assert rollout.messages == [*chat[0], *chat[1]]


def test_pickles_are_refused_unless_allowed(tmp_path: Path) -> None:
    path = tmp_path / "outputs.pkl"
    path.write_bytes(pickle.dumps([{"prompt_ids": PROMPT, "response_ids": RESPONSE, "response_mask": MASK}]))
    out = tmp_path / "out.jsonl"
    with pytest.raises(MismatchError) as refused:
        import_file("verl", path, out)
    assert str(refused.value) == (f"{path}: .pkl files are pickles and unpickling runs code from the file; "
                                  "export JSON Lines or Parquet instead, or pass --allow-pickle if you trust it")
    assert not out.exists()
    [rollout] = _imported("verl", path, tmp_path, allow_pickle=True)
    assert _back(rollout)[:3] == (PROMPT, RESPONSE, MASK)


def test_bad_records_name_file_record_and_field(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt_ids": PROMPT, "response_ids": RESPONSE}])
    out = tmp_path / "out.jsonl"
    with pytest.raises(ImportFormatError, match=rf"^{path}:1: response_mask: missing required field$"):
        import_file("verl", path, out)
    short = _jsonl(tmp_path / "short.jsonl", [{"prompt_ids": PROMPT, "response_ids": RESPONSE,
                                               "response_mask": MASK[:-1]}])
    with pytest.raises(ImportFormatError, match=rf"^{short}:1: response_mask: has 14 entries for 15 response_ids$"):
        import_file("verl", short, out)
    positive = _jsonl(tmp_path / "positive.jsonl", [{"prompt_ids": PROMPT, "response_ids": [5], "response_mask": [1],
                                                     "response_logprobs": [0.5]}])
    with pytest.raises(MismatchError, match=r"positive.jsonl:1: rollout 'verl-1': .*logprobs: logprob at index 0 "
                                            r"is 0.5 > 0"):
        import_file("verl", positive, out)
    with pytest.raises(MismatchError, match="unknown import format 'openrlhf' \\(known: verl, prime-rl, skyrl, verifiers, slime\\)"):
        import_file("openrlhf", path, out)
    assert not out.exists()


def test_unreadable_msgpack_is_one_error_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    cases = {"truncated": b"\x92\x01", "extension": b"\xd4\x01\x00",
             "deep": b"\x91" * 100 + b"\x00"}
    reasons = {"truncated": "Input data was truncated", "extension": "extension type 1 is not supported",
               "deep": "nested deeper than 64 levels"}
    for name, data in cases.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        with pytest.raises(MismatchError) as error:
            import_file("prime-rl", path, out)
        assert str(error.value) == f"{path}: not a readable MessagePack file: {reasons[name]}"
        assert not out.exists()

