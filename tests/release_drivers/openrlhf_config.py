"""OpenRLHF: parse a shell snippet of `train_ppo_ray` flags with the release's own argparse parser and its
own post-parse validation, and report the effective arguments the trainer reads for the vLLM/actor
importance-sampling correction, dtype, and how old log-probs come about.

Payload: {"flags": "<shell text: flags, ' \\\\\\n' continuations, # comment lines>"}.
Answer: {"args": {dotted.name: value}, "policy_loss": {PolicyLoss attribute: value, as the actor would build
it}, "printed": [lines the release printed while validating]}.

How: openrlhf/cli/train_ppo_ray.py builds its parser, parses, hierarchizes (openrlhf/utils/config.py) and
validates (thresholds, estimator / packing / async checks) all inside `if __name__ == "__main__":`, then
calls train(args). The module is run as __main__ (runpy.run_module, the release's own code unchanged) with
    sys.argv = ["train_ppo_ray.py", --actor.model_name_or_path actor, --reward.model_name_or_path reward,
                *shlex.split(flags)]
The two model paths are only there because the default --algo.advantage.estimator gae makes the
validation derive the critic from --reward.model_name_or_path (None.split otherwise); they come first,
so the snippet's own values win. train(args) begins with `if not ray.is_initialized():`; the stand-in
ray.is_initialized takes `args` from its caller's frame (train) and raises a sentinel, so nothing of
train() runs. argparse errors (unrecognized arguments, invalid choice, wrong nargs) come back as a
refusal with argparse's own message (ArgumentParser.error raises instead of printing and exiting);
the validation's AssertionError / ValueError come back as refusals as they are.

Stand-ins (_driver.stand_in): packages the CLI imports at module level (through openrlhf.trainer.*,
openrlhf.models.*, openrlhf.utils.*) that parsing and validation never call:
  ray, ray.util.placement_group, ray.util.scheduling_strategies   Ray runtime (compiled; train(), the
        @ray.remote actor classes in trainer/ray/*.py, ppo_trainer*.py). ray.remote is replaced by a
        pass-through decorator, because `@ray.remote(num_gpus=1)` calls it at import time.
  deepspeed, deepspeed.runtime.zero.partition_parameters         training engine (models/model.py,
        models/utils.py, utils/deepspeed/*)
  vllm, vllm.inputs, vllm.utils    inference engine (trainer/ray/vllm_engine.py, samples_generator.py);
        stood in even where a vllm is installed, so no engine code is imported
  flash_attn.bert_padding, flash_attn.utils.distributed   CUDA kernels (models/ring_attn_utils.py)
  peft, peft.tuners.lora           LoRA (models/actor.py, models/model.py, utils/deepspeed/deepspeed.py)
  torchdata.stateful_dataloader    (utils/deepspeed/deepspeed.py)
  pylatexenc                       math-answer grading (utils/math_utils.py via openrlhf/utils/__init__)
Each stand-in gets a ModuleSpec, because transformers' availability probes call importlib.util.find_spec
on flash_attn / peft / deepspeed and find_spec raises on a module whose __spec__ is None; with no
__version__ and no __file__ transformers then reports them as not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import io
import runpy
import shlex
import sys
from typing import Any

from _driver import main, stand_in

STAND_INS = (
    "ray", "ray.util.placement_group", "ray.util.scheduling_strategies",
    "deepspeed", "deepspeed.runtime.zero.partition_parameters",
    "vllm", "vllm.inputs", "vllm.utils",
    "flash_attn.bert_padding", "flash_attn.utils.distributed",
    "peft", "peft.tuners.lora",
    "torchdata.stateful_dataloader",
    "pylatexenc",
)

# Given first, so that the snippet's own values win (argparse keeps the last).
REQUIRED = ["--actor.model_name_or_path", "actor", "--reward.model_name_or_path", "reward"]

# The effective arguments reported besides every algo.advantage.is_correction_* (whatever the release
# names them). Missing in a release -> left out of the answer.
FIELDS = (
    # vLLM engine settings train() passes to create_vllm_engines (trainer/ray/vllm_engine.py); its dtype is
    # hard-coded "bfloat16" there, and logprobs_mode "processed_logprobs" is set only when the correction is on
    "vllm.num_engines", "vllm.tensor_parallel_size", "vllm.enable_prefix_caching", "vllm.enforce_eager",
    "vllm.gpu_memory_utilization", "vllm.enable_sleep", "vllm.sync_backend", "vllm.sync_with_ray",
    "train.full_determinism_enable", "train.seed", "rollout.temperature", "rollout.top_p",
    # actor (DeepSpeed) dtype and kernels
    "ds.param_dtype", "ds.attn_implementation", "ds.experts_implementation", "ds.use_liger_kernel",
    "ds.packing_samples", "ds.zero_stage", "ds.tensor_parallel_size", "ds.ring_attn_size",
    # the policy loss the IS weight multiplies
    "actor.policy_loss_type", "actor.loss_agg_mode", "actor.eps_clip", "actor.eps_clip_low_high",
    "actor.dual_clip", "algo.advantage.estimator", "algo.kl.use_loss", "algo.kl.init_coef",
    # old log-probs: always recomputed by the actor in make_experience; how stale they are vs the trained
    # policy depends on these (epochs and mini-batches per rollout, async / partial rollout)
    "train.max_epochs", "rollout.batch_size", "rollout.n_samples_per_prompt", "train.batch_size",
    "train.micro_batch_size", "rollout.micro_batch_size", "train.dynamic_batch_enable",
    "train.async_enable", "train.async_queue_size", "train.partial_rollout_enable",
    "train.colocate_all", "train.colocate_actor_ref",
)


class ArgparseError(Exception):
    """argparse refused the command line; the message is what argparse would print after 'error:'."""


class _ReachedTrain(BaseException):  # BaseException: no `except Exception` in the release can eat it
    def __init__(self, args: Any) -> None:
        super().__init__("train(args) reached")
        self.namespace = args  # not .args: BaseException.args is its own tuple


def _is_initialized() -> bool:
    caller = sys._getframe(1)
    if caller.f_code.co_name != "train" or "args" not in caller.f_locals:
        raise RuntimeError("ray.is_initialized is a stand-in; it was called from outside train(args)")
    raise _ReachedTrain(caller.f_locals["args"])


def _remote(*args: Any, **kwargs: Any) -> Any:
    """ray.remote as an import-time pass-through: @ray.remote and @ray.remote(num_gpus=1) leave the class."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda cls: cls


def _error(self: argparse.ArgumentParser, message: str) -> None:
    raise ArgparseError(f"{self.prog}: error: {message}")


def _setup() -> None:
    stand_in(*STAND_INS)
    for name, module in list(sys.modules.items()):
        if type(module).__name__ == "_Absent" and getattr(module, "__spec__", None) is None:
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    ray = sys.modules["ray"]
    ray.remote = _remote
    ray.is_initialized = _is_initialized
    argparse.ArgumentParser.error = _error


_setup()  # at import, before anything imports openrlhf (openrlhf_metrics imports this module first)


def split_flags(text: str) -> list[str]:
    """The snippet as the shell would split it: backslash-newline joins lines, # starts a comment."""
    return shlex.split(text.replace("\\\n", " "), comments=True)


def parse(argv: list[str]) -> tuple[Any, list[str]]:
    """The release's own parse + validation of `argv` (without the program name): the hierarchized args
    train() would receive, and what the release printed meanwhile."""
    printed = io.StringIO()
    old_argv = sys.argv
    sys.argv = ["train_ppo_ray.py", *REQUIRED, *argv]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=False)
    except _ReachedTrain as reached:
        return reached.namespace, [line for line in printed.getvalue().splitlines() if line.strip()]
    finally:
        sys.argv = old_argv
    raise RuntimeError("openrlhf.cli.train_ppo_ray finished without calling train(args)")


def policy_loss(args: Any) -> Any:
    """The PolicyLoss the actor builds from `args`: the release's own ActorPPOTrainer.__init__
    (trainer/ray/ppo_actor.py, `self.actor_loss_fn = PolicyLoss(...)`), so its mapping of the CLI names onto
    PolicyLoss and PolicyLoss's own checks (loss.py __init__) run. __init__ is called on an instance made
    with object.__new__, strategy = SimpleNamespace(args=args), no model / optimizer / vLLM engines
    (vllm_engines=None skips the weight-sync group). Its two later lines need CUDA and a process group:
    NaiveReplayBuffer (torch.cuda.current_device()) and torch_dist_barrier_and_cuda_sync(); for this call
    they are replaced in ppo_actor's namespace by no-ops (nothing is stored in or synchronised over them)."""
    from types import SimpleNamespace

    from openrlhf.trainer.ray import ppo_actor

    saved = ppo_actor.NaiveReplayBuffer, ppo_actor.torch_dist_barrier_and_cuda_sync
    ppo_actor.NaiveReplayBuffer = lambda *a, **k: None
    ppo_actor.torch_dist_barrier_and_cuda_sync = lambda: None
    try:
        trainer = object.__new__(ppo_actor.ActorPPOTrainer)
        trainer.__init__(SimpleNamespace(args=args), actor=None, ema_model=None, actor_optim=None,
                         actor_scheduler=None, vllm_engines=None)
    finally:
        ppo_actor.NaiveReplayBuffer, ppo_actor.torch_dist_barrier_and_cuda_sync = saved
    return trainer.actor_loss_fn


def loss_settings(loss: Any) -> dict[str, Any]:
    """A PolicyLoss's own settings (its plain attributes), by the names PolicyLoss gives them."""
    return {k: _jsonable(v) for k, v in sorted(vars(loss).items()) if not k.startswith("_") and k != "training"}


def lookup(args: Any, dotted: str) -> tuple[bool, Any]:
    node = args
    for part in dotted.split("."):
        if not hasattr(node, part):
            return False, None
        node = getattr(node, part)
    return True, node


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    args, printed = parse(split_flags(payload["flags"]))
    out: dict[str, Any] = {}
    for name in sorted(vars(args.algo.advantage)):
        if name.startswith("is_correction"):
            out[f"algo.advantage.{name}"] = _jsonable(getattr(args.algo.advantage, name))
    for dotted in FIELDS:
        present, value = lookup(args, dotted)
        if present:
            out[dotted] = _jsonable(value)
    # The actor would refuse at start-up what PolicyLoss.__init__ refuses (e.g. 0.11.2's clip with seq level
    # or a divergence gate, a divergence gate with a lower bound): built here too, so it is refused now.
    return {"args": out, "policy_loss": loss_settings(policy_loss(args)), "printed": printed}


if __name__ == "__main__":
    main(handle)
