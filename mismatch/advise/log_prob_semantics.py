"""The causes that say what the stored log-probs mean against what the trainer computes: shifted
against their tokens, at another temperature than the trainer scales by, or processed where the
trainer's are raw. They lead the diagnosis: every other gap is measured through them."""

from __future__ import annotations

import math

from msgspec import UNSET

from mismatch.results.summary_model import CauseWhere, Summary, present
from mismatch.advise.cause import Cause
from mismatch.advise.readers import kl_words, listed


def alignment_shift(summary: Summary) -> Cause | None:
    alignment = present(summary.alignment)
    shift = (alignment.shift or 0) if alignment is not None else 0
    if alignment is None or not shift:
        return None
    fits = ", ".join(f"shift {k}: mean |log-ratio| {v:.3g}" for k, v in (alignment.shift_fit or {}).items()
                     if isinstance(v, (int, float)))
    by_rollout = alignment.shift_by_rollout or {}
    return Cause(kind="alignment_shift", pair="train/sampler", fix="fix_alignment",
                 title=f"the stored log-probs are shifted by {shift:+d} against their tokens",
                 evidence=(f"the stored log-probs fit the replay best shifted by {shift:+d} ({fits})",
                           *([f"rollouts shifted: {listed(list(by_rollout))}"] if by_rollout else [])),
                 rules_out=("every other gap is measured on misaligned pairs: nothing else can be judged "
                            "until they line up",),
                 where=CauseWhere(shift=shift, rollouts=list(by_rollout)[:10]))


def trainer_temperature(summary: Summary, level: dict[str, str]) -> Cause | None:
    """The trainer divides its logits by a temperature (hf temperature=T, as verl's actor does)
    other than the one the stored log-probs carry: meta.sampler's temperature when it declares
    processed log-probs, 1 when it declares raw ones (undeclared: not judged)."""
    from mismatch.engines import TORCH_KINDS

    train = summary.engine("train")
    # a torch trainer's spec options (temperature=T); other engines scale nothing
    trainer_t = (train.options or {}).get("temperature") if train.kind in TORCH_KINDS else None
    declared = summary.declared
    semantics = declared.logprobs
    # A trainer at temperature 1 computes raw log-probs: processed stored ones are `processed`'s cause.
    if not isinstance(trainer_t, (int, float)) or trainer_t == 1.0 or semantics not in ("raw", "processed"):
        return None
    stored_t = float(declared.temperature or 1.0) if semantics == "processed" else 1.0
    if math.isclose(float(trainer_t), stored_t, rel_tol=1e-6):
        return None
    settings = (train.from_config.settings or []) if train.from_config else []
    keys = [s.key for s in settings if str(s.option or "").startswith("temperature=")]
    evidence = [f"the trainer divides its logits by temperature {trainer_t:g} (--train {present(train.spec)}"
                + (f"; the config's {keys[0]}" if keys else "") + ")",
                f"meta.sampler declares {semantics} log-probs at temperature "
                f"{declared.temperature if declared.temperature is not UNSET else 1.0}: "
                f"the stored log-probs are at temperature {stored_t:g}"]
    like = "train_processed/sampler"
    rules_out = ([f"the trainer at the sampler's processing ({like}) is {level[like]} (kl_k3 "
                  f"{summary.pairs[like].kl_k3:.3g}): the gap is the temperature, not the numerics"]
                 if like in level else [])
    return Cause(kind="trainer_temperature", pair="train/sampler", fix="match_temperature",
                 title=f"the trainer scales its logits by temperature {trainer_t:g}, the stored log-probs are at "
                       f"temperature {stored_t:g}",
                 evidence=tuple(evidence), rules_out=tuple(rules_out),
                 where=CauseWhere(trainer_temperature=float(trainer_t), stored_temperature=stored_t,
                                  config_key=keys[0] if keys else None))


def processed(summary: Summary, level: dict[str, str]) -> Cause | None:
    alignment = present(summary.alignment)
    if alignment is None or alignment.logprob_semantics != "processed":
        return None
    temperature = alignment.estimated_temperature
    declared = alignment.declaration
    evidence = [f"the stored log-probs are sharper or flatter than the raw ones in a way only processing gives "
                f"(estimated temperature {temperature:.3g})" if isinstance(temperature, (int, float))
                else "the stored log-probs are processed (temperature / top-p), not raw"]
    if declared.logprobs == "processed":
        evidence.append(f"meta.sampler declares logprobs=processed (temperature {present(declared.temperature)})")
    like = "train_processed/sampler"
    rules_out = []
    if like in level:
        rules_out.append(f"the like-for-like gap (the trainer with the sampler's processing, {like}) is "
                         f"{level[like]} (kl_k3 {kl_words(summary, like)}) where the raw train/sampler one is "
                         f"{level.get('train/sampler', 'unknown')} (kl_k3 {kl_words(summary, 'train/sampler')}): "
                         "the gap is the processing, not the numerics")
    return Cause(kind="processed_logprobs", pair="train/sampler", fix="raw_logprobs",
                 title="the sampler stored processed log-probs (after temperature / top-p) and the trainer raw ones",
                 evidence=tuple(evidence), rules_out=tuple(rules_out),
                 where=CauseWhere(estimated_temperature=present(temperature),
                                  like_for_like=like if like in level else None, like_for_like_level=level.get(like)))
