"""slime (no PyPI release): parse a flags snippet with slime's own argparse builder, vendored at the
commit in MISMATCH_RELEASE (tests/data/frameworks/slime/), and run a mis.yaml through slime's own
custom-config step and its MIS function (examples/train_infer_mismatch_helper/mis.py).

Payload: {"flags": "<shell text, ' \\\n' continuations and # comments allowed>", "mis_yaml": optional}.
slime's own parse_args() parses with parse_known_args (megatron ignore_unknown_args=True, sglang a
separate known-args parser), so a misspelt flag is silently dropped there; here an unknown flag is
refused with argparse's message, because a dropped flag is as bad as a refused one for a snippet.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from _driver import main, release, stand_in

VENDORED = Path(__file__).resolve().parents[1] / "data" / "frameworks" / "slime"
sys.path.insert(0, str(VENDORED))

# slime/utils/arguments.py imports these at module level; they are called only by parse_args() and
# slime_validate_args() (sglang's ServerArgs/RouterArgs, the external-engine probe, wandb logging).
import slime  # noqa: E402  (the vendored package, so the stand-ins below nest under it)
import slime.utils  # noqa: E402

stand_in("slime.backends.sglang_utils.arguments", "slime.backends.sglang_utils.external",
         "slime.observability.logging_utils")

from slime.utils import arguments as slime_arguments  # noqa: E402

# Flags that slime's parse_args() takes from other parsers: sglang's ServerArgs.add_cli_args (under
# slime's --sglang- prefix, slime/backends/sglang_utils/arguments.py:40-118) and Megatron-LM's
# parse_args. Neither can be imported here (sglang pulls triton/torchvision, Megatron-LM is not on
# PyPI), so only the few our snippets may emit are declared, as those parsers declare them:
# sglang 0.5.15.post1 (slime's docker/Dockerfile:1) srt/server_args.py:2508 (bool, store_true),
# :521-534 (dtype choices); Megatron-LM --fp16/--bf16 (store_true; slime forces bf16 = not fp16,
# slime/backends/megatron_utils/arguments.py:157).
FOREIGN_FLAGS: dict[str, dict[str, Any]] = {
    "--sglang-enable-deterministic-inference": {"action": "store_true"},
    "--sglang-dtype": {"type": str, "default": "auto",
                       "choices": ["auto", "half", "float16", "bfloat16", "float", "float32"]},
    "--fp16": {"action": "store_true"},
    "--bf16": {"action": "store_true"},
}

RELEVANT = ("use_tis", "tis_clip", "tis_clip_low", "custom_tis_function_path", "custom_config_path",
            "get_mismatch_metrics", "use_rollout_logprobs", "use_routing_replay", "use_rollout_routing_replay",
            "use_opsm", "opsm_delta", "sglang_enable_deterministic_inference", "sglang_dtype", "fp16", "bf16")
MIS_KEYS = ("use_tis", "use_rs", "tis_level", "rs_level", "tis_mode", "tis_lower_bound", "tis_upper_bound",
            "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize")


def parser() -> argparse.ArgumentParser:
    built = argparse.ArgumentParser(prog="slime", add_help=False, allow_abbrev=False, exit_on_error=False)
    built = slime_arguments.get_slime_extra_args_provider()(built)
    for flag, kwargs in FOREIGN_FLAGS.items():
        built.add_argument(flag, **kwargs)
    # A snippet is pasted into a full command line: slime's required flags (--rollout-batch-size)
    # are the user's to give, so they are not required of the snippet.
    for action in built._actions:
        action.required = False

    def error(message: str) -> None:  # argparse's own message, raised instead of printed + exit 2
        raise SlimeArgumentError(f"{built.prog}: error: {message}")

    built.error = error  # type: ignore[method-assign]
    return built


class SlimeArgumentError(Exception):
    """argparse refused the flags (unknown flag, bad value, bad choice): its message."""


def _load_function(path: str) -> Any:
    # slime/utils/misc.py:39-47 (load_function: a dotted module path, then the attribute); only the
    # vendored modules are importable here, so a path elsewhere in slime is checked by name.
    module_path, _, attr = path.rpartition(".")
    if module_path == "slime.backends.megatron_utils.loss":
        if attr not in ("vanilla_tis_function", "icepop_function"):
            raise AttributeError(f"module {module_path!r} has no attribute {attr!r}")
        return None
    import importlib
    return getattr(importlib.import_module(module_path), attr)


def _run_mis(args: argparse.Namespace) -> dict[str, Any]:
    """slime's own mis.compute_mis_weights on a two-sequence toy batch, as the loss would call it."""
    import torch
    from examples.train_infer_mismatch_helper import mis

    train = [torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-0.2, -3.0])]
    rollout = [torch.tensor([-1.1, -0.4, -2.5]), torch.tensor([-0.25, -2.0])]
    masks = [torch.ones(3), torch.ones(2)]
    weights, _, metrics = mis.compute_mis_weights(args, train_log_probs=train, rollout_log_probs=rollout,
                                                  loss_masks=masks)
    return {"weights": None if weights is None else [w.tolist() for w in weights],
            "metrics": sorted(f"mis_{key}" for key in metrics)}


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    framework, version = release()
    assert framework == "slime", framework
    argv = shlex.split(payload["flags"].replace("\\\n", " "), comments=True)
    args = parser().parse_args(argv)  # exit_on_error=False: ArgumentError for a bad value or flag
    if args.use_rollout_logprobs:  # slime_validate_args, arguments.py:1853-1854
        assert not args.use_tis, "use_rollout_logprobs and use_tis cannot be set at the same time."
    if args.get_mismatch_metrics:  # :1856-1859
        assert args.custom_tis_function_path is not None, \
            "custom_tis_function_path must be set when get_mismatch_metrics is set"
    if args.use_rollout_routing_replay:  # :2010-2011
        args.use_routing_replay = True
    result = {"argv": argv, "args": {name: getattr(args, name) for name in RELEVANT}}
    if args.custom_config_path is not None:
        if payload.get("mis_yaml") is None:
            raise ValueError("--custom-config-path given but no mis_yaml in the payload")
        import yaml
        data = yaml.safe_load(payload["mis_yaml"]) or {}  # :2013-2019: every key set on args, unchecked
        for key, value in data.items():
            setattr(args, key, value)
        result["mis"] = {key: getattr(args, key, "<unset>") for key in MIS_KEYS}
        result["mis_unknown_keys"] = sorted(set(data) - set(MIS_KEYS))
    if args.custom_tis_function_path is not None:
        function = _load_function(args.custom_tis_function_path)
        if function is not None and (args.use_tis or args.get_mismatch_metrics):
            result["mis_run"] = _run_mis(args)
    return result


REFUSALS = (SlimeArgumentError, argparse.ArgumentError, AssertionError, AttributeError, ImportError, ValueError,
                           TypeError, KeyError)

if __name__ == "__main__":
    main(handle, refusals=REFUSALS)
