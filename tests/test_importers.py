"""Importers: a small file in each framework's documented field names round-trips through format v1."""

from __future__ import annotations

import json
import os
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



# --- per-step dump directories, and the frameworks' own writers -------------------------------------

VERL_DUMP = Path(__file__).resolve().parent / "data" / "importers" / "verl_dump.py"
VERL_RELEASE = "0.9.1"


def _sample_dict(response: list[int], mask: list[int], logprobs: list[float], reward: float) -> dict[str, Any]:
    """One agent-loop sample for verl_dump.py: vLLM-like routing over every fed position, and a
    trainer recompute (old_log_probs) a little off the sampler's."""
    return {"prompt_ids": PROMPT, "response_ids": response, "response_mask": mask, "response_logprobs": logprobs,
            "routed_experts": _routing(len(PROMPT) + len(response) - 1), "reward_score": reward, "num_turns": 4,
            "old_log_probs": [lp - 0.25 for lp in logprobs]}


@pytest.fixture(scope="module")
def verl_dumps(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """verl 0.9.1's own agent-loop postprocess, DataProto.save_to_disk, AgentLoopOutput.as_dict and
    rollout_data_dir writer, run in a subprocess (tests/data/importers/verl_dump.py says which parts
    cannot run on CPU); the DataProto pickles are imported there too (unpickling needs verl)."""
    import subprocess
    import sys

    import releases

    try:
        folders = releases.install("verl", VERL_RELEASE)
    except Exception as exc:  # noqa: BLE001 - only a failed install skips
        pytest.skip(f"verl {VERL_RELEASE} could not be installed: {exc}")
    out = tmp_path_factory.mktemp("verl")
    steps = {"3": [_sample_dict(RESPONSE, MASK, LOGPROBS, 1.0),
                   _sample_dict(RESPONSE[:5], MASK[:5], LOGPROBS[:5], 0.0)],
             "4": [_sample_dict(RESPONSE[:5], MASK[:5], LOGPROBS[:5], 0.5)]}
    payload = {"tokenizer": str(tiny_checkpoint), "out": str(out), "prompt_length": 12, "response_length": 20,
               "steps": steps}
    path = os.pathsep.join(str(p) for p in [*folders, releases.DRIVERS])
    done = subprocess.run([sys.executable, str(VERL_DUMP)], input=json.dumps(payload), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path, "PYTHONNOUSERSITE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, json.loads(done.stdout.strip().splitlines()[-1])["batch"]


def _unpadded(columns: dict[str, Any], i: int) -> dict[str, list]:
    """Sample i of a verl batch without its padding, by the batch's own attention_mask."""
    num_prompt = len(columns["prompts"][i])
    attention = columns["attention_mask"][i]
    kept = [j for j, on in enumerate(attention[num_prompt:]) if on]
    routed = [row for row, on in zip(columns["routed_experts"][i], attention) if on]
    return {"prompt": [t for t, on in zip(columns["prompts"][i], attention) if on],
            "response": [columns["responses"][i][j] for j in kept],
            "mask": [columns["response_mask"][i][j] for j in kept],
            "sampler": [columns["rollout_log_probs"][i][j] for j in kept],
            "trainer": [columns["old_log_probs"][i][j] for j in kept],
            "routed": [None if not any(any(layer) for layer in row) else [sorted(layer) for layer in row]
                       for row in routed]}


def _trained(rollout: Rollout, stream: str | None) -> list[float]:
    """Log-probs on trained tokens: the sampler's (None) or an extra_logprobs stream."""
    values: list[float] = []
    for segment in rollout.branch("main").segments[1:]:
        if segment.trainable:
            values += (segment.logprobs if stream is None else segment.extra_logprobs[stream]).tolist()
    return values


def test_verl_release_batches_import_per_step_with_trainer_logprobs(verl_dumps: tuple[Path, dict[str, Any]],
                                                                     tmp_path: Path) -> None:
    out, batches = verl_dumps
    rollouts = load_rollouts(out / "batches.jsonl")
    # One file per step ({step}.pkl): ids prefixed with the file's name, meta.step from it.
    assert [(r.id, r.meta["step"]) for r in rollouts] == [("3/verl-0-0", 3), ("3/verl-0-1", 3), ("4/verl-0-0", 4)]
    for rollout, (step, i) in zip(rollouts, [("3", 0), ("3", 1), ("4", 0)]):
        expected = _unpadded(batches[step], i)
        prompt, response, mask, _ = _back(rollout)
        assert (prompt, response, mask) == (expected["prompt"], expected["response"], expected["mask"])
        on = [j for j, m in enumerate(expected["mask"]) if m]
        assert _trained(rollout, None) == [expected["sampler"][j] for j in on]
        assert _trained(rollout, "trainer_old") == [expected["trainer"][j] for j in on]
        assert _routing_back(rollout) == expected["routed"]
    assert _back(rollouts[0])[:3] == (PROMPT, RESPONSE, MASK) and rollouts[0].meta["reward"] == 1.0


def test_verl_as_dict_pickles_and_the_text_only_rollout_data_dir(verl_dumps: tuple[Path, dict[str, Any]],
                                                                 tmp_path: Path) -> None:
    out, _ = verl_dumps
    # AgentLoopOutput.as_dict() torch.save'd under step_N/: the step folder names the step.
    rollouts = _imported("verl", out / "as_dict", tmp_path, allow_pickle=True)
    assert [(r.id, r.meta["step"]) for r in rollouts] == [("step_3/0/verl-0", 3), ("step_3/1/verl-0", 3),
                                                          ("step_4/0/verl-0", 4)]
    # as_dict() stores the log-probs as float32 tensors (agent_loop.py:127).
    assert _back(rollouts[0]) == (PROMPT, RESPONSE, MASK, np.float32(_trained_logprobs()).tolist())
    assert _routing_back(rollouts[0]) == [[sorted(layer) for layer in row]
                                          for row in _routing(len(PROMPT) + len(RESPONSE) - 1)] + [None]
    # trainer.rollout_data_dir ({global_steps}.jsonl) holds decoded text only.
    with pytest.raises(ImportFormatError, match=r"rollout_data/3.jsonl:1: this is verl's trainer.rollout_data_dir "
                                                r"dump \(decoded text, no token ids\)"):
        import_file("verl", out / "rollout_data", tmp_path / "o.jsonl")


PRIME_RL_SOURCE = Path(__file__).resolve().parent / "data" / "frameworks" / "prime_rl"
PRIME_RL_DUMP = Path(__file__).resolve().parent / "data" / "importers" / "prime_rl_dump.py"


def test_prime_rl_step_directories_from_its_own_packer(tmp_path: Path) -> None:
    """A run's `rollouts/step_N/rank_R.bin` written by prime-rl's own prepare_batch (vendored at
    559b4477, tests/data/importers/prime_rl_dump.py) imports as one file: each sample once, its
    step from its folder, prepare_batch's dummy micro batches (loss_mask all false) left out."""
    import subprocess
    import sys

    tokens = PROMPT + RESPONSE
    routed = _routing(len(tokens) - 1)
    sample = {"token_ids": tokens, "mask": [0] * len(PROMPT) + MASK, "logprobs": [0.0] * len(PROMPT) + LOGPROBS,
              "temperature": 0.7, "env_name": "gsm8k", "advantage": 0.5, "routed_experts": routed}
    short = {**sample, "token_ids": PROMPT + RESPONSE[:5], "mask": [0] * len(PROMPT) + MASK[:5],
             "logprobs": [0.0] * len(PROMPT) + LOGPROBS[:5], "advantage": -0.5, "routed_experts": None}
    payload = {"out": str(tmp_path), "seq_len": 32, "num_train_workers": 2, "pad_to_multiple_of": 8,
               "steps": {"7": [sample, {**sample, "advantage": -1.0}, sample], "8": [short]}}
    done = subprocess.run([sys.executable, str(PRIME_RL_DUMP)], input=json.dumps(payload), capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(PRIME_RL_SOURCE)}, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"ranks": {"7": 2, "8": 2}}
    rollouts = _imported("prime-rl", tmp_path / "rollouts", tmp_path)
    assert sorted((r.meta["step"], r.meta["advantage"]) for r in rollouts) == [(7, -1.0), (7, 0.5), (7, 0.5), (8, -0.5)]
    assert all(r.id.startswith(f"step_{r.meta['step']}/rank_") for r in rollouts)
    for rollout in rollouts:
        full = rollout.meta["step"] == 7
        assert _back(rollout) == (PROMPT, RESPONSE if full else RESPONSE[:5], MASK if full else MASK[:5],
                                  [lp for lp, m in zip(LOGPROBS, MASK) if m] if full else LOGPROBS[:5])
        assert rollout.meta["sampler"] == {"engine": "prime-rl", "temperature": 0.7}
        expected = [[sorted(layer) for layer in row] for row in routed] + [None] if full else [None] * 14
        assert _routing_back(rollout) == expected


SLIME_SOURCE = Path(__file__).resolve().parent / "data" / "importers" / "slime"
SLIME_DUMP = Path(__file__).resolve().parent / "data" / "importers" / "slime_dump.py"


def test_slime_rollout_data_directory_from_its_own_writer(tmp_path: Path) -> None:
    """`--save-debug-rollout-data {dir}/rollout_data/{rollout_id}.pt` written by slime's own Sample
    and save_debug_rollout_data (vendored at 624b824a, tests/data/importers/slime_dump.py): each
    file's rollout_id is its samples' meta.step; SGLang's dense layer 0 (all zeros) is dropped."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    turns = [{"tokens": RESPONSE[:5], "log_probs": LOGPROBS[:5], "trainable": True},
             {"tokens": RESPONSE[5:12], "log_probs": None, "trainable": False},
             {"tokens": RESPONSE[12:], "log_probs": LOGPROBS[12:], "trainable": True}]
    routed = [[[0, 0], *row] for row in _routing(len(PROMPT) + len(RESPONSE) - 1)]
    agentic = {"prompt_tokens": PROMPT, "turns": turns, "routed_experts": routed, "remove_sample": False}
    single = {"prompt_tokens": PROMPT, "turns": turns[:1], "routed_experts": None, "remove_sample": True}
    payload = {"template": str(tmp_path / "rollout_data" / "{rollout_id}.pt"), "num_layers": 3, "topk": 2,
               "rollouts": {"5": [agentic, single], "6": [agentic]}}
    done = subprocess.run([sys.executable, str(SLIME_DUMP)], input=json.dumps(payload), capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(SLIME_SOURCE)}, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    rollouts = _imported("slime", tmp_path / "rollout_data", tmp_path, allow_pickle=True)
    assert [(r.id, r.meta["step"]) for r in rollouts] == [("5/slime-0-0", 5), ("5/slime-0-1", 5), ("6/slime-0-0", 6)]
    for rollout in (rollouts[0], rollouts[2]):
        assert _back(rollout) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
        assert [s.role for s in rollout.branch("main").segments] == ["user", "assistant", "tool", "assistant"]
        assert _routing_back(rollout) == [[sorted(layer) for layer in row]
                                          for row in _routing(len(PROMPT) + len(RESPONSE) - 1)] + [None]
        assert rollout.meta["status"] == "completed" and rollout.meta["reward"] == 1.0
    removed = rollouts[1].branch("main").segments[1]
    assert not removed.trainable and removed.logprobs.tolist() == LOGPROBS[:5]


TOKEN_EXPORTS = Path(__file__).resolve().parent / "data" / "importers" / "prime_rl" / "token_exports"


def test_prime_rl_token_export_carries_sampler_and_trainer_logprobs(tmp_path: Path) -> None:
    """`token_exports/step_N/rank_R.jsonl` (trainer.enable_token_export; fixture and its sources in
    tests/data/importers/prime_rl/README.md): inference_logprobs are the sampler's, trainer_logprobs
    land in extra_logprobs["trainer"]; the STABLE marker is not a dump file."""
    rollouts = _imported("prime-rl", TOKEN_EXPORTS, tmp_path)
    assert [(r.id, r.meta["step"], r.meta["advantage"]) for r in rollouts] == [
        ("step_2/rank_0/prime-rl-1", 2, 0.5), ("step_2/rank_0/prime-rl-2", 2, -0.5)]
    full, short = rollouts
    assert _back(full) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
    assert _trained(full, "trainer") == [lp - 0.0625 for lp in _trained_logprobs()]
    assert _back(short) == (PROMPT, RESPONSE[:5], MASK[:5], LOGPROBS[:5]) and full.meta["env"] == "gsm8k"
    record = json.loads((TOKEN_EXPORTS / "step_2" / "rank_0.jsonl").read_text().splitlines()[0])
    record["trainer_logprobs"][len(PROMPT)] = None
    with pytest.raises(ImportFormatError, match=r"bad.jsonl:1: trainer_logprobs: is null \(non-finite\) at "
                                                r"sampled token 9$"):
        import_file("prime-rl", _jsonl(tmp_path / "bad.jsonl", [record]), tmp_path / "o.jsonl")


VERIFIERS_TRACES = Path(__file__).resolve().parent / "data" / "importers" / "verifiers" / "rollouts"


def test_verifiers_v1_traces_per_step_become_trees(tmp_path: Path) -> None:
    """prime-rl's `rollouts/step_N/train/all/traces.jsonl` of verifiers v1 Episodes (fixture and
    sources in tests/data/importers/verifiers/README.md): one rollout per trace, root-to-leaf paths
    as branches, the assistant nodes' scaffold joined to the prompt run before it."""
    [rollout] = _imported("verifiers", VERIFIERS_TRACES, tmp_path)
    assert rollout.id == "step_4/train/all/traces/3f2a9c"
    assert rollout.meta["step"] == 4 and rollout.meta["reward"] == 1.0 and rollout.meta["episode"] == "ep-7"
    assert _back(rollout) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
    assert [s.role for s in rollout.branch("main").segments] == ["user", "assistant", "tool", "assistant"]
    fork = rollout.branch("branch-1")
    assert (fork.parent, fork.fork_at, fork.kind) == ("main", len(PROMPT) + 9, "subagent")
    assert [(s.role, s.tokens.tolist()) for s in fork.segments] == [("tool", RESPONSE[9:12]), ("assistant", [70, 2])]
    assert fork.segments[1].logprobs.tolist() == [-0.3, -0.1]


def test_skyrl_rollout_expert_indices_become_routed_experts(tmp_path: Path) -> None:
    """GeneratorOutput as SkyRL's generate() returns it (NovaSky-AI/SkyRL@a9564572
    skyrl/train/generators/skyrl_gym_generator.py:941-981): rollout_expert_indices one NumPy
    [tokens, layers, top-k] array per trajectory over prompt + response, stopping short of the last
    (never fed) token; pickled per step as `global_step_N_...`. skyrl 0.3.0 declared the same
    column as nested lists (skyrl/train/generators/base.py:49 in its wheel): that reads the same."""
    routed = _routing(len(PROMPT) + len(RESPONSE) - 1)
    output = {"prompt_token_ids": [PROMPT, PROMPT], "response_ids": [RESPONSE, RESPONSE[:5]], "rewards": [1.0, 0.0],
              "loss_masks": [MASK, MASK[:5]], "stop_reasons": ["stop", "stop"], "rollout_metrics": {},
              "rollout_logprobs": [LOGPROBS, LOGPROBS[:5]],
              "trajectory_ids": [{"instance_id": "q7", "repetition_id": 0}, {"instance_id": "q7", "repetition_id": 1}],
              "trajectory_generation_times": [0.5, 0.25], "trajectory_time_splits": None,
              "rollout_expert_indices": [np.array(routed, dtype=np.uint8),
                                         np.array(_routing(len(PROMPT) + 4), dtype=np.uint8)],
              "is_last_step": None, "env_metrics": [{}, {}]}
    folder = tmp_path / "dumped"
    folder.mkdir()
    (folder / "global_step_2_generator_output.pkl").write_bytes(pickle.dumps(output))
    listed = {**output, "rollout_expert_indices": [a.tolist() for a in output["rollout_expert_indices"]]}
    (folder / "global_step_3_generator_output.json").write_text(json.dumps(listed))
    rollouts = _imported("skyrl", folder, tmp_path, allow_pickle=True)
    assert [(r.id, r.meta["step"]) for r in rollouts] == [
        ("global_step_2_generator_output/q7_0", 2), ("global_step_2_generator_output/q7_1", 2),
        ("global_step_3_generator_output/q7_0", 3), ("global_step_3_generator_output/q7_1", 3)]
    for full, short in (rollouts[:2], rollouts[2:]):
        assert _back(full) == (PROMPT, RESPONSE, MASK, _trained_logprobs())
        assert _routing_back(full) == [[sorted(layer) for layer in row] for row in routed] + [None]
        assert _routing_back(short) == [[sorted(layer) for layer in row] for row in _routing(len(PROMPT) + 4)] + [None]


def test_step_names_and_an_empty_directory(tmp_path: Path) -> None:
    from mismatch.rollouts.importers.steps import file_step, step_of

    names = [("12",), ("step_3", "rank_0"), ("step_3", "0"), ("global_step_7_training_input",),
             ("rollout_data", "eval_5"), ("rank_0",)]
    assert [step_of(parts) for parts in names] == [12, 3, 3, 7, None, None]
    # A single file: its stem, or a folder that says `step_N` (a bare-number folder may be anything).
    files = ["run/12.jsonl", "rollouts/step_3/rank_0.bin", "2024/dump.jsonl"]
    assert [file_step(Path(p)) for p in files] == [12, 3, None]
    empty = tmp_path / "empty"
    (empty / ".hidden.jsonl").parent.mkdir()
    (empty / ".hidden.jsonl").write_text("{}\n")
    with pytest.raises(MismatchError, match=r"empty: no dump files in this directory \(known suffixes: \.bin, "):
        import_file("verl", empty, tmp_path / "o.jsonl")


def _episode_with(tmp_path: Path, change: Any) -> Path:
    """The fixture's Episode with `change(episode)` applied to it, as one traces.jsonl line."""
    episode = json.loads((VERIFIERS_TRACES / "step_4" / "train" / "all" / "traces.jsonl").read_text().splitlines()[0])
    change(episode)
    return _jsonl(tmp_path / "traces.jsonl", [episode])


@pytest.mark.parametrize("change, says", [
    (lambda e: e["traces"][0]["nodes"][1].__setitem__("token_ids", [1, "2"]),
     "traces[0].nodes[1].token_ids[1]: Expected `int`, got `str`"),
    (lambda e: e["traces"][0]["nodes"][0].pop("message"), "traces[0].nodes[0]: Object missing required field `message`"),
    (lambda e: e["traces"][0]["rewards"].__setitem__("correct", {"score": "high"}),
     "traces[0].rewards[...].score: Expected `float | null`, got `str`"),
    (lambda e: e["run"]["work"].__setitem__("step", "4"), "run.work.step: Expected `int | null`, got `str`"),
    (lambda e: e["traces"][0]["nodes"][1].__setitem__("parent", 5), "traces[0].nodes[1].parent: must be an earlier "
                                                                    "node's index, got 5"),
])
def test_a_verifiers_trace_of_another_shape_is_one_error_naming_its_field(tmp_path: Path, change: Any,
                                                                          says: str) -> None:
    path = _episode_with(tmp_path, change)
    with pytest.raises(ImportFormatError) as error:
        import_file("verifiers", path, tmp_path / "out.jsonl")
    assert str(error.value) == f"{path}:1: {says}"
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("record, says", [
    ({"rollout_id": 3, "samples": [_slime_sample(PROMPT + RESPONSE, len(RESPONSE)),
                                   _slime_sample(PROMPT + [True], 1)]}, "samples[1].tokens[9]: Expected `int`, got `bool`"),
    ({"rollout_id": 3, "samples": [_slime_sample(PROMPT + RESPONSE, len(RESPONSE), rollout_log_probs="x")]},
     "samples[0].rollout_log_probs: Expected `array | null`, got `str`"),
    ({"rollout_id": 3, "samples": {"0": {}}}, "samples: Expected `array`, got `object`"),
    ({"tokens": PROMPT}, "Object missing required field `response_length`"),
])
def test_a_slime_sample_of_another_shape_is_one_error_naming_its_field(tmp_path: Path, record: Any, says: str) -> None:
    path = _jsonl(tmp_path / "samples.jsonl", [record])
    with pytest.raises(ImportFormatError) as error:
        import_file("slime", path, tmp_path / "out.jsonl")
    assert str(error.value) == f"{path}:1: {says}"


@pytest.mark.parametrize("change", [
    lambda e: e["traces"][0].__setitem__("agent", None),
    lambda e: e["traces"][0].__setitem__("rewards", None),
    lambda e: e.__setitem__("run", None),
    lambda e: e["run"].__setitem__("work", None),
])
def test_a_verifiers_null_group_reads_as_the_group_left_out(tmp_path: Path, change: Any) -> None:
    """A null agent, rewards, run or work is read as that key left out (the reader took them `or {}`),
    not refused: the import equals the one of the Episode without the key."""
    def dropped(episode: dict[str, Any]) -> None:
        change(episode)
        for holder in (episode, episode.get("run") or {}, *episode["traces"]):
            for key in [key for key, value in holder.items() if value is None and key in ("agent", "rewards", "run", "work")]:
                del holder[key]

    (tmp_path / "null").mkdir()
    (tmp_path / "absent").mkdir()
    null, absent = _episode_with(tmp_path / "null", change), _episode_with(tmp_path / "absent", dropped)
    import_file("verifiers", null, tmp_path / "null.jsonl")
    import_file("verifiers", absent, tmp_path / "absent.jsonl")
    assert _without_source_file(tmp_path / "null.jsonl") == _without_source_file(tmp_path / "absent.jsonl")


def test_a_slime_sample_with_remove_sample_null_is_trained_as_with_false(tmp_path: Path) -> None:
    written = []
    for value in (None, False):
        path = _jsonl(tmp_path / f"{value}.jsonl", [_slime_sample(PROMPT + RESPONSE, len(RESPONSE), remove_sample=value)])
        import_file("slime", path, tmp_path / f"{value}.out.jsonl")
        written.append(_without_source_file(tmp_path / f"{value}.out.jsonl"))
    assert written[0] == written[1]
    assert all(s.get("trainable") is not False for b in written[0][0]["branches"] for s in b["segments"])


def _without_source_file(path: Path) -> list[dict[str, Any]]:
    """The imported rollouts with meta.source.file dropped (the inputs compared lie in two files)."""
    rollouts = [json.loads(line) for line in path.read_text().splitlines()]
    for rollout in rollouts:
        del rollout["meta"]["source"]["file"]
    return rollouts
