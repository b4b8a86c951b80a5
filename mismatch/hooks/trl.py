"""TRL's dump hook: a GRPOTrainer mixin that writes each training batch's rollouts as format v1.

`class Trainer(MismatchDumpMixin, GRPOTrainer)` and `Trainer(..., mismatch_dump="rollouts.jsonl")`:
the mixin overrides `_generate_and_score_completions` (the method TRL users already override,
huggingface/trl#4159), lets TRL build its batch, and appends one rollout per sample of that dict to
the file (`dump.StepDump`), tagged meta.step = `self.state.global_step`. Read in the trl 1.16.0 wheel.

What goes where (trl 1.16.0 trl/trainer/grpo_trainer.py):
- `prompt_ids`, left-padded, kept where `prompt_mask` is 1 (:2440-2451) -> the user segment;
- `completion_ids`, right-padded, kept where `completion_mask` is 1 (:2452-2462) -> the response;
  `tool_mask` 0 (tool results inside it, :2479-2485) -> role "tool", 1 -> "assistant";
- `sampling_per_token_logps` (vLLM's, or a rollout_func's, :2463-2478) -> the segments' `logprobs`;
- `old_per_token_logps`, the trainer's own no-grad pass (:2636-2657; with vLLM IS always) ->
  `extra_logprobs["trainer_old"]`, so `mismatch audit CKPT --rollouts F --train stored:trainer_old
  --infer sampler` measures the gap TRL logs as `sampling/*` (:2860-2896) from TRL's own numbers.
  Both are temperature-scaled: vLLM's are `processed_logprobs` (generation/vllm_generation.py:361), the
  trainer's come from `add_fused_lm_head(temperature=...)` (:1068-1076).
A completion `mask_truncated_completions` zeroes (:2487-2495) keeps its tokens (up to its last
non-pad one: TRL masks only those whose last token is neither EOS nor pad) as an assistant segment
with `trainable: false` and no trainer stream: TRL scored it with its completion masked out of
attention. Its tool tokens cannot be told apart then (TRL zeroed its `tool_mask` too): with tools it keeps
no sampler log-probs either, since TRL's 0.0 placeholders for tool tokens would pass as sampled ones.

Processes: `_generate_and_score_completions` returns this process's own samples (its prompts; the
advantages sliced to them, :2812-2818), so each process writes its own file: `PATH` in a
one-process run, `STEM.rankR.SUFFIX` for process R of several (one writer per file, no locking
across nodes). Evaluation batches (`self.model.training` false) are not written. Ids carry a tag of
the run, the step, the rank and the call within the step, so a resumed run appends new ids.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mismatch.hooks.dump import DumpInputError, DumpSetupError, StepDump, sample_rollout

TRAINER_STREAM = "trainer_old"
logger = logging.getLogger(__name__)

# GRPOConfig's sampling fields, as the trainer keeps them (grpo_trainer.py:789-793) and passes them to
# vLLM (vllm_generation.py:616-628, :661-671) or to transformers' GenerationConfig (:1154-1173).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class MismatchDumpMixin:
    """Put first among the bases: `class Trainer(MismatchDumpMixin, GRPOTrainer)` (or before your own
    GRPOTrainer subclass, so what your override returns is what is written)."""

    def __init__(self, *args: Any, mismatch_dump: str | os.PathLike[str], **kwargs: Any) -> None:
        # GRPOTrainer(model, reward_funcs, args=None, ..., rollout_func=None): checked before the model
        # loads. No args is GRPOConfig's defaults, whose use_vllm is False.
        check_sampler_logprobs(kwargs.get("args", args[2] if len(args) > 2 else None), kwargs.get("rollout_func"))
        super().__init__(*args, **kwargs)
        num_processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        self.mismatch_dump = StepDump(rank_path(mismatch_dump, rank, num_processes), framework="trl",
                                      meta={"sampler": {**sampler_meta(self),
                                                        "framework_settings": {"trl": is_settings(self.args)}}})
        self._mismatch_run = uuid.uuid4().hex[:8]
        self._mismatch_calls: tuple[int, int] = (-1, 0)  # (global step, generation calls in it)

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self._mismatch_write(output)
        return output

    def _mismatch_write(self, output: Mapping[str, Any]) -> None:
        try:
            self._mismatch_write_batch(output)
        except Exception as error:  # the dump must never stop the training step it records
            self.mismatch_dump.refuse(f"{type(error).__name__}: {error}")
            logger.warning("mismatch: a batch was not written to %s (%s: %s)", self.mismatch_dump.path,
                           type(error).__name__, error)

    def _mismatch_write_batch(self, output: Mapping[str, Any]) -> None:
        step = int(self.state.global_step)
        # gradient_accumulation_steps > steps_per_generation generates more than once per step
        # (grpo_trainer.py:1536-1546): the call count keeps those ids apart.
        call = self._mismatch_calls[1] + 1 if self._mismatch_calls[0] == step else 0
        self._mismatch_calls = (step, call)
        rank = self.accelerator.process_index
        refused = self.mismatch_dump.num_refused
        if output.get("sampling_per_token_logps") is None:
            # A rollout_func that returns no log-probs: a dump without the sampler's stream would
            # audit the trainer against itself ("found: sampler").
            self.mismatch_dump.refuse(NO_LOGPROBS)
            logger.warning("mismatch: step %d not written to %s: %s", step, self.mismatch_dump.path, NO_LOGPROBS)
            return
        self.mismatch_dump.write(batch_rollouts(
            output, id_prefix=f"trl-{self._mismatch_run}-s{step}-r{rank}-c{call}",
            pad_token_id=self._tokenizer.pad_token_id, masks_truncated=bool(self.mask_truncated_completions),
            first_index=rank * len(output["prompt_ids"]), num_generations=self.num_generations,
            on_refused=self.mismatch_dump.refuse), step=step)
        if self.mismatch_dump.num_refused > refused:
            logger.warning("mismatch: %d rollout(s) of step %d left out of %s (%s)", self.mismatch_dump.num_refused
                           - refused, step, self.mismatch_dump.path, self.mismatch_dump.first_refusal)


NO_LOGPROBS = ("TRL's batch has no sampler log-probs (sampling_per_token_logps): set use_vllm=True in GRPOConfig "
               "(or return `logprobs` from your rollout_func)")


def check_sampler_logprobs(args: Any, rollout_func: Any) -> None:
    """Refuse, before the first step, a run whose sampler gives TRL no log-probs: transformers'
    generate returns none to TRL (grpo_trainer.py:1811, :1889), so its dump would hold no sampler
    stream and the audit would measure nothing the run trains on."""
    if rollout_func is None and not getattr(args, "use_vllm", False):
        raise DumpSetupError("mismatch dump: TRL's default generation (transformers, use_vllm=False) gives no "
                             "sampler log-probs to dump; set use_vllm=True in GRPOConfig (or give a rollout_func "
                             "that returns logprobs)")


def is_settings(args: Any) -> dict[str, Any]:
    """GRPOConfig's IS correction fields (frameworks/trl.py SETTINGS, grpo_config.py:925-960) as the run
    set them, kept in meta.sampler.framework_settings: `mismatch audit` computes TRL's logged sampling
    metrics at these, not at the defaults (frameworks/metrics.declared_settings)."""
    from mismatch.frameworks.trl import SETTINGS

    return {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}


def rank_path(path: str | os.PathLike[str], rank: int, num_processes: int) -> Path:
    """`path` for a one-process run, `STEM.rankR.SUFFIX` for process R of several."""
    path = Path(path)
    return path if num_processes <= 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def sampler_meta(trainer: Any) -> dict[str, Any]:
    """meta.sampler from the trainer's config: the engine, what its log-probs are, its sampling."""
    args = trainer.args
    sampling = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name) is not None}
    # generation_kwargs override the named fields in every backend (colocate: vllm_generation.py:672;
    # server: generation/vllm_client.py:443; transformers: grpo_trainer.py:1171-1172).
    sampling.update({k: v for k, v in (args.generation_kwargs or {}).items() if k in SAMPLING_FIELDS})
    if trainer.rollout_func is not None:
        # The user's function samples and returns the log-probs (grpo_trainer.py:2200-2217): what
        # they are is its own business.
        return {"engine": "rollout_func", **sampling}
    if not args.use_vllm:
        # transformers' generate (and its continuous batching) returns no log-probs to TRL
        # (grpo_trainer.py:1811, :1889); mismatch's engine for that sampler is hf-decode.
        return {"engine": "hf-decode", **sampling}
    engine = {"engine": "vllm", "vllm_mode": args.vllm_mode, "logprobs": "processed", **sampling}
    if args.vllm_mode == "server":
        # `trl vllm-serve` starts vLLM with --logprobs-mode processed_logprobs (scripts/vllm_serve.py,
        # build_command) and the trainer warns when a server runs another mode (grpo_trainer.py:1141-1153).
        return {**engine, "logprobs_from": "TRL's server requirement (the server is not asked)"}
    # Colocate: the trainer's own LLM(logprobs_mode="processed_logprobs") (vllm_generation.py:347-364),
    # with no dtype given: vLLM's model config holds the one it resolved.
    dtype = getattr(getattr(getattr(trainer.vllm_generation.llm, "llm_engine", None), "model_config", None),
                    "dtype", None)
    return {**engine, **({"dtype": str(dtype).removeprefix("torch.")} if dtype is not None else {})}


def batch_rollouts(output: Mapping[str, Any], *, id_prefix: str, pad_token_id: int, masks_truncated: bool,
                   first_index: int, num_generations: int,
                   on_refused: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One format v1 rollout per row of the dict `_generate_and_score_completions` returns; a row
    that cannot be one (DumpInputError) goes to `on_refused` (raised without it)."""
    rows = {name: _rows(output.get(name)) for name in
            ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask",
             "sampling_per_token_logps", "old_per_token_logps", "advantages")}
    rollouts = []
    for i, prompt_row in enumerate(rows["prompt_ids"]):
        row = {name: values[i] if values is not None else None for name, values in rows.items()}
        prompt = [token for token, kept in zip(prompt_row, row["prompt_mask"]) if kept]
        try:
            rollouts.append(_sample(row, prompt, f"{id_prefix}-{i}", pad_token_id=pad_token_id,
                                    masks_truncated=masks_truncated,
                                    meta={"trl": {"index": first_index + i, "group": (first_index + i) // num_generations,
                                                  "advantage": row["advantages"]}}))
        except DumpInputError as error:
            if on_refused is None:
                raise
            on_refused(str(error))
    return rollouts


def _sample(row: Mapping[str, Any], prompt: list[int], rollout_id: str, *, pad_token_id: int, masks_truncated: bool,
            meta: dict[str, Any]) -> dict[str, Any]:
    length = sum(row["completion_mask"])  # ones, then the right padding's zeros
    if masks_truncated and length == 0:
        return _masked_sample(row, prompt, rollout_id, pad_token_id=pad_token_id, meta=meta)
    mask = row["tool_mask"][:length] if row["tool_mask"] is not None else [1] * length
    trainer = row["old_per_token_logps"]
    return sample_rollout(rollout_id, prompt, row["completion_ids"][:length], mask,
                          _cut(row["sampling_per_token_logps"], length),
                          extra_logprobs={TRAINER_STREAM: trainer[:length]} if trainer is not None else None,
                          off_role="tool", meta=meta)


def _masked_sample(row: Mapping[str, Any], prompt: list[int], rollout_id: str, *, pad_token_id: int,
                   meta: dict[str, Any]) -> dict[str, Any]:
    """A completion mask_truncated_completions zeroed: its tokens, none trainable, no trainer stream."""
    length = _unpadded_length(row["completion_ids"], pad_token_id)
    # With tools, TRL's 0.0 placeholders for tool tokens (grpo_trainer.py:2154-2156) are no longer
    # marked by a tool_mask: no sampler log-probs then, rather than placeholders passing as sampled.
    sampler = row["sampling_per_token_logps"] if row["tool_mask"] is None else None
    return sample_rollout(rollout_id, prompt, row["completion_ids"][:length], [0] * length, _cut(sampler, length),
                          off_role="assistant", meta={"trl": {**meta["trl"], "masked": "mask_truncated_completions"}})


def _cut(values: list[float] | None, length: int) -> list[float] | None:
    return None if values is None else values[:length]


def _unpadded_length(ids: Sequence[int], pad_token_id: int) -> int:
    """The length of a right-padded row whose last token is not the pad (a truncated completion's)."""
    length = len(ids)
    while length and ids[length - 1] == pad_token_id:
        length -= 1
    return length


def _rows(tensor: Any) -> list[Any] | None:
    """A batch tensor as nested Python lists (float32 values stay exact as Python floats)."""
    return None if tensor is None else tensor.tolist()
