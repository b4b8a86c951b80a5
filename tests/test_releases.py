"""Every snippet mismatch writes, loaded into the released framework's own config code; every
metric it reports under a framework's name, against the release's own function on the same tokens.

The releases are installed from the package index (tests/releases.py); slime and prime-rl, which
publish none, are vendored at the commit read. Everything a release is asked is asked in one
subprocess (tests/release_drivers/_many.py), built and run once per release for all the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import pandas as pd
import pytest
import releases

from mismatch import frameworks
from mismatch.advise.corrections import DEFAULT_CORRECTIONS
from mismatch.advise.snippets import render_config
from mismatch.frameworks.protocol import Recommendation
from mismatch.frameworks.metrics import settings_used, table_framework_metrics
from mismatch.frameworks import parse_target

FIXES = [Recommendation(kind=kind, why="w") for kind in ("recompute_old_logprobs", "fp16", "batch_invariant",
                                                           "routing_replay")]


def _flags(text: str) -> str:
    """The shell part of a flags snippet (its comment lines are the user's to read, not to paste)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def _mis_yaml(text: str) -> str | None:
    """slime's mis.yaml, written as comments after the flags."""
    if "# --- mis.yaml ---" not in text:
        return None
    return "\n".join(line[2:] for line in text.split("# --- mis.yaml ---\n", 1)[1].splitlines())


# framework -> (config driver, the payload it takes for a rendered snippet)
LOADERS: dict[str, tuple[str, Callable[[str], dict[str, Any]]]] = {
    # R3 runs on verl's Megatron actor: a snippet that sets it is composed with that trainer config
    "verl": ("verl_config", lambda text: {"snippet": text, "config_name": "ppo_megatron_trainer"
                                          if "megatron:" in text else "ppo_trainer"}),
    "trl": ("trl_config", lambda text: {"snippet": text}),
    "areal": ("areal_config", lambda text: {"snippet": text}),
    "openrlhf": ("openrlhf_config", lambda text: {"flags": _flags(text)}),
    "slime": ("slime_config", lambda text: {"flags": _flags(text), "mis_yaml": _mis_yaml(text)}),
    "prime-rl": ("prime_rl_config", lambda text: {"toml": text}),
}


def load(framework: str, version: str, texts: list[str]) -> list[dict[str, Any]]:
    driver, payload = LOADERS[framework]
    return releases.run_batch(framework, version, driver, [payload(text) for text in texts])


def correction(mode: str, **params: float) -> Recommendation:
    return Recommendation(kind="correction", why="w", params={"mode": mode, **params})


# --- what the release made of a snippet, under the names `express` uses -----------------------------

def trl_settings(loaded: dict[str, Any]) -> dict[str, Any]:
    return {key: loaded[key] for key in frameworks.module("trl").SETTINGS}


def slime_settings(loaded: dict[str, Any]) -> dict[str, Any]:
    args, mis = loaded["args"], loaded.get("mis") or {}
    found = {"use_tis": args["use_tis"]}
    if mis:
        found |= {"custom_tis_function_path": args["custom_tis_function_path"],
                  **{key: mis[key] for key in ("tis_level", "tis_mode", "tis_upper_bound", "tis_lower_bound")}}
    else:
        found |= {"tis_clip": args["tis_clip"], "tis_clip_low": float(args["tis_clip_low"])}
        if args["custom_tis_function_path"] is not None:
            found["custom_tis_function_path"] = args["custom_tis_function_path"]
    return found


def prime_rl_settings(loaded: dict[str, Any]) -> dict[str, Any]:
    loss = loaded["trainer"]["loss"]
    return {key: loss[key] for key in ("type", "ipo_threshold", "dppo_mask_high", "dppo_mask_low") if key in loss}


def verl_settings(loaded: dict[str, Any]) -> dict[str, Any]:
    return dict(loaded["RolloutCorrectionConfig"])


def openrlhf_settings(loaded: dict[str, Any]) -> dict[str, Any]:
    return {key.removeprefix("algo.advantage."): value for key, value in loaded["args"].items()
            if key.startswith("algo.advantage.is_correction")}


def areal_settings(loaded: dict[str, Any]) -> dict[str, Any]:
    assert loaded["actor.use_decoupled_loss"] and loaded["actor.should_compute_prox_logp()"]
    found = dict(loaded["actor.rejection_sampling"] or {})
    if found.get("action") == "clamp" and found.get("lower") == 0.0:  # __post_init__ fills an unset one
        found["lower"] = None
    return found


SETTINGS_OF: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "trl": trl_settings, "slime": slime_settings, "prime-rl": prime_rl_settings, "verl": verl_settings,
    "openrlhf": openrlhf_settings, "areal": areal_settings,
}

# What each fix with a key turns on, read where the framework's workers read it.
FIXES_ON: dict[str, dict[str, Callable[[dict[str, Any]], bool]]] = {
    "verl": {"routing_replay": lambda r: r["router_replay.mode (worker)"] == "R3"
             and r["rollout.enable_rollout_routing_replay"] is True,
             "fp16": lambda r: r["rollout.dtype"] == "float16"
             and "float16" in (r.get("actor.megatron.dtype"), r.get("actor.fsdp_config.dtype"))},
    "trl": {"fp16": lambda r: r["fp16"] is True and r["bf16"] is False},
    "areal": {"fp16": lambda r: r["actor.dtype"] == "float16" and r["sglang.dtype"] == "float16"},
    "slime": {"routing_replay": lambda r: r["args"]["use_routing_replay"] is True,
              "fp16": lambda r: r["args"]["fp16"] is True and r["args"]["sglang_dtype"] == "float16",
              "batch_invariant": lambda r: r["args"]["sglang_enable_deterministic_inference"] is True},
    "prime-rl": {"routing_replay": lambda r: r["trainer"]["enable_router_replay"] is True
                 and r["inference"]["vllm.enable_return_routed_experts"] is True
                 and not r["inference"]["vllm.extra"]},
}


def subset(expected: dict[str, Any], found: dict[str, Any]) -> bool:
    return all(key in found and _same(found[key], value) for key, value in expected.items())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b


# --- framework-named metrics against the release's own code ---------------------------------------

def gap_table(seed: int = 5, num_rollouts: int = 12) -> pd.DataFrame:
    """One sequence per rollout (what every framework calls a sample), of varied lengths, with a
    heavy-tailed train/sampler gap: enough for masks and caps to bite."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 40, num_rollouts)
    rollout = np.repeat([f"r{i:02d}" for i in range(num_rollouts)], lengths)
    n = len(rollout)
    logp_sampler = np.log(rng.uniform(0.01, 1.0, n))
    gap = rng.standard_t(3, n) * 0.15
    return pd.DataFrame({"rollout": rollout, "branch": "main", "turn": 0, "trainable": True,
                         "logp_sampler": logp_sampler, "logp_train": np.minimum(logp_sampler + gap, 0.0)})


def sequences(table: pd.DataFrame) -> list[dict[str, list[float]]]:
    return [{"logp_train": group["logp_train"].tolist(), "logp_rollout": group["logp_sampler"].tolist()}
            for _, group in table.groupby("rollout", sort=True)]


def ours(table: pd.DataFrame, framework: str, version: str, settings: dict[str, Any]) -> dict[str, float]:
    target = parse_target(f"{framework}=={version}", detect=False)
    target = type(target)(framework=framework, release=target.release, settings=settings)
    chosen = {framework: settings_used([target])[framework]}
    return table_framework_metrics(table, [("train", "sampler")], chosen)["train/sampler"][framework]


# Keys the release itself computes in float32 whatever its inputs (a `.float()` of a boolean, then a
# plain mean): equal to float32's rounding. verl 0.9.1 rollout_corr_helper.py:711-712 (0.8.0 :709-710);
# OpenRLHF 0.11.2 openrlhf/models/loss.py:242-246 (train/is_filter_ratio).
FLOAT32 = {("verl", "sequence"): {"rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low"}}


def assert_equal_metrics(mine: dict[str, float], theirs: dict[str, float], context: str,
                         float32: set[str] = frozenset()) -> None:
    assert mine, context
    wrong = []
    for key, value in mine.items():
        if value is None:  # no token to log it over: the release logs nothing either
            assert theirs.get(key) is None, f"{context}: {key} ours None, the release's {theirs[key]!r}"
            continue
        assert key in theirs, f"{context}: {key} is not logged by the release (it logs {sorted(theirs)})"
        tolerance = 1e-6 if key in float32 else 1e-9
        if not math.isclose(value, theirs[key], rel_tol=tolerance, abs_tol=1e-12):
            wrong.append(f"{key} ours {value!r}, the release's {theirs[key]!r}")
    assert not wrong, f"{context}: " + "; ".join(wrong)


# Settings to compute the metrics at, per framework: the defaults, and each kind of mode.
TRL_SETTINGS = [
    {},
    {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.5},
    {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 2.0,
     "vllm_importance_sampling_clip_min": 0.5},
    {"vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_clip_max": 2.0,
     "vllm_importance_sampling_clip_min": 0.2},
    {"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 5.0},
]


VERL_SETTINGS = [
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "token", "rollout_is_threshold": 1.5},
    {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    {"rollout_is": "sequence", "rollout_is_threshold": 3.0},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.2_5.0"},
    {"rollout_is": None},
]
METRIC_SETTINGS = {"trl": TRL_SETTINGS, "verl": VERL_SETTINGS}
# Frameworks whose metrics driver also hands back the weights their loss applies: every mode they
# express is run through it (the weights are checked against the simulation too).
WEIGHTS = {"openrlhf": lambda settings: settings,
           "areal": lambda settings: {"use_decoupled_loss": True, "rejection_sampling": settings}}

# The snippets the previous release emitted, verbatim, that the releases refuse or silently ignore.
OLD_OPENRLHF = ("--algo.advantage.is_correction_enable \\\n--algo.advantage.is_correction_type tis \\\n"
                "--algo.advantage.is_correction_threshold 0.0 2.0")
OLD_VERL_R3 = ("actor_rollout_ref:\n  actor:\n    router_replay:\n      mode: R3  # Megatron actor; with the rollout "
               "flag below\n  rollout:\n    enable_rollout_routing_replay: true\n")


def misspelt(framework: str, version: str) -> str:
    text = render_config([correction("token_truncate", cap=2.0)], f"{framework}=={version}")
    return {"verl": text.replace("rollout_is_threshold", "rollout_is_treshold"),
            "trl": text.replace("vllm_importance_sampling_mode", "vllm_importance_sampling_mod"),
            "areal": text.replace("rejection_sampling:", "rejection_samplin:"),
            "openrlhf": text + " \\\n--algo.advantage.is_correction_levle token",
            "slime": text.replace("--tis-clip ", "--tis-clp "),
            "prime-rl": '[trainer.loss]\ntype = "ipo"\nipo_treshold = 0.1\n'}[framework]


def expressed(framework: str, version: str) -> list[tuple[Any, dict[str, Any] | None]]:
    """Every default simulated correction, with the release's settings for it (None: it cannot)."""
    release = parse_target(f"{framework}=={version}", detect=False).release
    module = frameworks.module(framework)
    return [(item, module.express(item.mode, item.params, release)) for item in DEFAULT_CORRECTIONS]


def snippets(framework: str, version: str) -> list[str]:
    return [render_config([correction(item.mode, **item.params), *FIXES], f"{framework}=={version}")
            for item, _ in expressed(framework, version)]


def routing_summary() -> dict[str, Any]:
    """An audit's summary where MoE routing flips carry most of train/infer's k3, beside a small gap."""
    caps = [{"mode": "token_truncate", "params": {"cap": cap}, "frac_tokens_affected": frac,
             "frac_rollouts_affected": frac, "weight_mean": 1.0, "weight_max": cap, "ess": ess, "level": "token"}
            for cap, frac, ess in ((1.5, 0.05, 0.95), (2.0, 0.008, 0.93), (3.0, 0.001, 0.91))]
    flips = {"frac_tokens_with_flip": 0.014, "with_flip": {"n_tokens": 9, "kl_k3": 0.0014 / 9, "k3_sum": 0.0014},
             "without_flip": {"n_tokens": 623, "kl_k3": 0.0008 / 623, "k3_sum": 0.0008}}
    return {"schema": "mismatch.summary/v1", "command": "audit", "counts": {"tokens": 900, "trainable_tokens": 632},
            "pairs": {"train/sampler": {"n_tokens": 1000, "kl_k3": 1e-4, "frac_outside_2": 0.0,
                                        "bitwise_equal_frac": 0.0, "ratio_q001": 0.97, "ratio_q999": 1.04}},
            # Two replays of one checkpoint: the flips are the routers' ties, not a fault (R3 is earned).
            "checkpoint": "ckpt", "engines": {"sampler": {"kind": "stored", "meta": {"dtype": "bfloat16"}},
                                              "train": {"kind": "hf", "dtype": "float32"},
                                              "infer": {"kind": "hf", "dtype": "bfloat16"}}, "corrections": caps,
            "routing": {"train/infer": flips}}


def routing_snippet(framework: str, version: str) -> str:
    """What `mismatch recommend DIR --for FRAMEWORK==VERSION` prints for that summary."""
    from mismatch.advise.advice import for_target
    from mismatch.results.summary_model import partial_summary

    advice = for_target(partial_summary(routing_summary()), parse_target(f"{framework}=={version}", detect=False))
    assert [r.kind for r in advice.recommendations] == ["routing_replay", "correction"]  # the cause first
    return advice.snippet


@cache
def answers(framework: str, version: str) -> dict[str, list[dict[str, Any]]]:
    """What the release made of everything the tests ask of it, in one subprocess."""
    driver, payload = LOADERS[framework]
    config = [payload(text) for text in snippets(framework, version)] + [payload(misspelt(framework, version))]
    if framework in ("verl", "openrlhf"):
        config.append(payload(routing_snippet(framework, version)))
    if framework == "openrlhf":
        config.append(payload(OLD_OPENRLHF))
    if framework == "verl":
        config += [payload(OLD_VERL_R3), {**payload(OLD_VERL_R3), "config_name": "ppo_megatron_trainer"}]
    asked = {driver: config}
    table_sequences = sequences(gap_table())
    if framework in METRIC_SETTINGS:
        asked[f"{framework}_metrics"] = [{"sequences": table_sequences, "settings": s}
                                         for s in METRIC_SETTINGS[framework]]
    if framework in WEIGHTS:
        asked[f"{framework}_metrics"] = [{"sequences": table_sequences, "settings": WEIGHTS[framework](s)}
                                         for _, s in expressed(framework, version) if s is not None]
    return releases.run_drivers(framework, version, asked)


@pytest.mark.parametrize(("framework", "version"), releases.pairs())
def test_every_snippet_loads_into_the_release_with_the_settings_it_says(framework: str, version: str) -> None:
    """Each simulated correction the release can express, with every fix beside it, is accepted by
    the release's own config code, which then holds exactly the settings `express` names, and each
    fix with a key is on where the framework's workers read it; a correction it cannot express is
    said so in the snippet and sets nothing."""
    target = parse_target(f"{framework}=={version}", detect=False)
    assert target.release.version == version and not target.note
    loaded = answers(framework, version)[LOADERS[framework][0]]
    count = 0
    for (item, expected), text, answer in zip(expressed(framework, version), snippets(framework, version), loaded):
        assert "refused" not in answer, f"{item.mode} {item.params}: {answer['refused']}\n{text}"
        assert max(len(line) for line in text.splitlines() if line.startswith("#")) <= 100, text
        if expected is None:
            assert f"{target.label} cannot express {item.mode}" in text, text
            continue
        count += 1
        found = SETTINGS_OF[framework](answer["result"])
        assert subset(expected, found), f"{item.mode} {item.params}: {expected} not in {found}\n{text}"
        for kind, on in FIXES_ON.get(framework, {}).items():
            assert on(answer["result"]), f"{kind} is not on where {framework} reads it:\n{text}\n{answer['result']}"
    assert count >= 3


@pytest.mark.parametrize(("framework", "version"), releases.pairs())
def test_a_misspelt_key_is_refused_by_the_release(framework: str, version: str) -> None:
    """The check above can fail: the release refuses what it does not know."""
    answer = answers(framework, version)[LOADERS[framework][0]][len(DEFAULT_CORRECTIONS)]
    assert "refused" in answer, answer


@pytest.mark.parametrize("version", releases.RELEASES["verl"])
def test_recommend_for_verl_on_a_routing_case_turns_r3_on_where_the_workers_read_it(version: str) -> None:
    answer = answers("verl", version)["verl_config"][len(DEFAULT_CORRECTIONS) + 1]
    assert "refused" not in answer, answer
    assert answer["result"]["router_replay.mode (worker)"] == "R3"
    assert answer["result"]["rollout.enable_rollout_routing_replay"] is True


@pytest.mark.parametrize("version", releases.RELEASES["openrlhf"])
def test_recommend_for_openrlhf_on_a_routing_case_loads_and_says_it_has_no_r3(version: str) -> None:
    text = routing_snippet("openrlhf", version)
    answer = answers("openrlhf", version)["openrlhf_config"][len(DEFAULT_CORRECTIONS) + 1]
    assert "refused" not in answer, answer
    assert "routing replay (R3): OpenRLHF has no such option" in text
    assert openrlhf_settings(answer["result"])["is_correction_threshold"] == [0.0, 2.0]


def test_the_previous_snippets_are_refused_or_ignored_by_the_releases() -> None:
    """What mismatch emitted before this release: OpenRLHF 0.11.2 refuses its flags; verl 0.9.1
    refuses the routing-replay key, and 0.8.0 loads it where no worker reads it (R3 stays off)."""
    refused = answers("openrlhf", "0.11.2")["openrlhf_config"][-1]
    assert "unrecognized arguments: --algo.advantage.is_correction_enable" in refused["refused"]
    fsdp, megatron = answers("verl", "0.9.1")["verl_config"][-2:]
    assert "router_replay" in fsdp["refused"] and "router_replay" in megatron["refused"]
    old = answers("verl", "0.8.0")["verl_config"][-1]["result"]
    assert old["actor.router_replay.mode"] == "R3" and old["router_replay.mode (worker)"] == "disabled"


@pytest.mark.parametrize(("framework", "version"), [(f, v) for f, v in releases.pairs() if f in METRIC_SETTINGS])
def test_framework_metrics_equal_the_release_at_the_users_settings(framework: str, version: str) -> None:
    """Each metric mismatch reports under the framework's name is the release's own function's on
    the same tokens, at each setting: the settings move it (a fixed default could not pass)."""
    table = gap_table()
    module = frameworks.module(framework)
    found = answers(framework, version)[f"{framework}_metrics"]
    for settings, answer in zip(METRIC_SETTINGS[framework], found):
        assert "result" in answer, answer
        level = settings.get("rollout_is") if framework == "verl" else None
        assert_equal_metrics(ours(table, framework, version, {**module.DEFAULTS, **settings}), answer["result"],
                             f"{framework} {version} {settings}", FLOAT32.get((framework, level), set()))
    key = {"trl": "sampling/importance_sampling_ratio/max", "verl": "rollout_corr/rollout_is_eff_sample_size"}[framework]
    values = [answer["result"].get(key) for answer in found]
    assert len({round(v, 9) for v in values if v is not None}) >= 4


@pytest.mark.parametrize(("framework", "version"), [(f, v) for f, v in releases.pairs() if f in WEIGHTS])
def test_the_release_applies_the_simulated_weights_and_logs_our_metrics(framework: str, version: str) -> None:
    """For each simulated correction the release can express, its own loss applies, token by token,
    the weights mismatch simulated, and logs our numbers at those settings. AReaL upcasts the
    log-ratio to float32 only (functional.py:231): equal to float32 there."""
    from mismatch.advise.corrections import Correction, correction_weights

    table = gap_table()
    ordered = table.sort_values("rollout", kind="stable")
    log_ratio = (ordered["logp_train"] - ordered["logp_sampler"]).to_numpy()
    cases = [(item, settings) for item, settings in expressed(framework, version) if settings is not None]
    tolerance = 1e-6 if framework == "areal" else 1e-9
    for (item, settings), answer in zip(cases, answers(framework, version)[f"{framework}_metrics"]):
        assert "result" in answer, answer
        weight, _ = correction_weights(log_ratio, Correction(mode=item.mode, params=item.params),
                                       seq=ordered["rollout"].to_numpy())
        np.testing.assert_allclose(answer["result"]["weights"], weight, rtol=tolerance, atol=1e-7,
                                   err_msg=f"{framework} {version} {item.mode} {item.params}")
        mine = ours(table, framework, version, settings)
        float32 = set(mine) if framework == "areal" else {"train/is_filter_ratio"}
        assert_equal_metrics(mine, answer["result"]["metrics"], f"{framework} {version} {settings}", float32)
