"""Plain-words verdicts for the three gaps of an audit (the triangle sampler / trainer / engine).

Each pair's metrics map to a level by stated thresholds on kl_k3 and the tail of the ratio
(levels.py), and the level to a sentence that says what the gap means for that pair. The sentence
guesses at no cause: the diagnosis names the one the evidence shows, and its title ends the pair's
sentence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from mismatch.advise.levels import gap_level
from mismatch.results.summary_model import EngineEntry, PairMetrics, Verdict

if TYPE_CHECKING:
    from mismatch.advise.diagnose import Diagnosis

MEANING = {
    "train/sampler": "what the RL ratio sees",
    "train/infer": "trainer vs engine, reproduced now",
    "infer/sampler": "replay fidelity",
}


def verdict(pair: str, metrics: PairMetrics, cause: str | None = None) -> Verdict:
    """The level, what this pair measures, and one plain sentence,
    ending with the diagnosed `cause` of this pair's gap when there is one."""
    level = gap_level(metrics)
    text = _TEXT.get(pair, _GENERIC)[level]
    if cause and level == "negligible":  # under the thresholds, yet with a cause: not "rounding"
        text = _GENERIC["negligible"]
    if level not in ("unknown", "exact"):
        text += (f" (kl_k3 {_number(metrics.kl_k3)}, ratio_q001–ratio_q999 {_number(metrics.ratio_q001)}–"
                 f"{_number(metrics.ratio_q999)}, frac_outside_2 {_share(metrics.frac_outside_2)})")
    if cause and level != "exact":
        text += f"; cause: {cause}"
    return Verdict(level=level, meaning=MEANING.get(pair, f"{pair} log-ratio"), text=text)


def _number(value: float | None) -> str:
    return f"{value:.3g}" if value is not None else "null"


def _share(value: float | None) -> str:
    return f"{value:.2%}" if value is not None else "null"


_TEXT: dict[str, dict[str, str]] = {
    "train/sampler": {
        "unknown": "no stored sampler log-probs on trainable tokens: the RL ratio cannot be judged",
        "exact": "the PPO ratio is exactly 1 on-policy: trainer and sampler agree bit for bit",
        "negligible": "the PPO ratio is 1 up to rounding: no correction needed",
        "small": "the PPO ratio drifts slightly from 1: capping each token's ratio (TIS, token_truncate) bounds it at little cost",
        "large": "the PPO ratio is far from 1 on-policy: correct it (TIS/MIS) or fix the source",
    },
    "train/infer": {
        "unknown": "no tokens to compare",
        "exact": "trainer and engine compute identical log-probs",
        "negligible": "trainer and engine agree up to rounding",
        "small": "trainer and engine differ slightly",
        "large": "trainer and engine disagree strongly",
    },
    "infer/sampler": {
        "unknown": "no stored sampler log-probs to compare the replay with",
        "exact": "replay is faithful: this engine config reproduces the stored log-probs bit for bit",
        "negligible": "replay is faithful up to rounding",
        "small": "replay differs slightly from the stored log-probs",
        "large": "the stored log-probs were not produced by this checkpoint and engine config",
    },
}


_GENERIC = {
    "unknown": "no tokens to compare",
    "exact": "identical log-probs",
    "negligible": "equal within the thresholds",
    "small": "a slight gap",
    "large": "a large gap",
}


def stored_verdict(pair: str, metrics: PairMetrics, source: str, name: str) -> Verdict:
    """A pair one of whose sides is a stored stream replayed as an engine (`--infer sampler`,
    `stored:NAME`): nothing was replayed on that side, so the pair claims no fidelity and no
    reproduction; its numbers are the stored stream's own."""
    level = gap_level(metrics)
    if name == "sampler" and pair.endswith("/sampler"):
        text = f"{source} is the sampler's stored stream itself (stored, not replayed): this pair compares it with itself"
    else:
        text = (f"{source} is the stored stream {name} (stored, not replayed): the gap to it, {_GENERIC[level]}, says "
                "nothing about how it was produced")
    if level not in ("unknown", "exact"):
        text += f" (kl_k3 {_number(metrics.kl_k3)}, {_share(metrics.frac_outside_2)} of tokens outside [0.5, 2])"
    return Verdict(level=level, meaning="stored, not replayed", text=text)


def verdicts(pairs: Mapping[str, PairMetrics], diagnosis: Diagnosis | None = None,
             engines: Mapping[str, EngineEntry] | None = None) -> dict[str, Verdict]:
    """Each pair's verdict; with `engines` (summary.json's), a pair with a stored stream replayed as
    an engine on one side is worded as such (stored_verdict)."""
    def cause(pair: str) -> str | None:
        found = diagnosis.for_pair(pair) if diagnosis is not None else None
        return found.title if found is not None else None

    def stored(pair: str) -> tuple[str, str] | None:
        for source in pair.split("/"):
            engine = (engines or {}).get(source)
            if source != "sampler" and engine is not None and engine.kind == "stored":
                return source, str(engine.name or "?")
        return None

    out = {}
    for pair, metrics in pairs.items():
        found = stored(pair)
        out[pair] = stored_verdict(pair, metrics, *found) if found else verdict(pair, metrics, cause(pair))
    return out
