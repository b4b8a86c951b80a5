"""What a trainer's config says about how it computes log-probs, as mismatch's engine specs.

A reader (one module per framework here) turns a framework's config file into a `Derived`: the
trainer replay (an `hf` spec), the engine replay (a `vllm` spec), and one `Setting` per config key
that decides a log-prob, each either reproduced by an engine option, approximated by one (and
how), or not reproduced here (and why). summary.json keeps the table under each engine's
`from_config`; the audit prints it before its replay.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# train: the trainer's old-log-prob forward; infer: the rollout engine; update: the policy update's
# forward (new log-probs), where the framework batches it otherwise than the old-log-prob one.
Side = Literal["train", "infer", "update"]
Status = Literal["reproduced", "approximated", "not reproduced"]
SIDES: tuple[Side, ...] = ("train", "infer", "update")


@dataclass(kw_only=True, slots=True, frozen=True)
class Machine:
    """What this machine can run, for the settings whose reproduction depends on it: tensor
    parallelism needs that many GPUs, flash-attention its package and CUDA, CUDA graphs CUDA."""

    gpus: int = 0
    flash_attn: bool = False

    @classmethod
    def here(cls) -> Machine:
        if importlib.util.find_spec("torch") is None:
            return cls()
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(gpus=gpus, flash_attn=gpus > 0 and importlib.util.find_spec("flash_attn") is not None)


@dataclass(kw_only=True, slots=True, frozen=True)
class Setting:
    """One config key that decides a log-prob, and what became of it."""

    side: Side
    key: str             # the framework's own name: "actor_rollout_ref.model.use_remove_padding", "--bf16"
    value: Any           # as the config gives it, after the release's defaults
    status: Status
    option: str | None   # the engine option it became ("packing=varlen"), None where none did
    note: str = ""       # approximated: by what and why; not reproduced: why

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "status": self.status, "option": self.option,
                "note": self.note}

    def line(self) -> str:
        """One line for the terminal: `key=value → option (note)`."""
        became = self.option if self.option else "-"
        note = f" ({self.note})" if self.note else ""
        return f"{self.key}={_shown(self.value)} → {became}{note}"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


@dataclass(kw_only=True, slots=True, frozen=True)
class Derived:
    """A framework config read: the specs each side replays, and every setting's fate."""

    framework: str
    file: str
    loader: str  # how it was read: the release's own loader (and version), or the built-in subset
    specs: dict[Side, str]  # side -> engine spec (train and infer always; update where the framework has it)
    settings: tuple[Setting, ...]
    model: str | None = None     # the model the config names (its path or hub name), None where it names none
    notices: tuple[str, ...] = ()  # what the first screen must say (e.g. verl's bypass mode)
    # the correction settings the config runs, under the framework's own --for names (frameworks/NAME.py
    # SETTINGS): the audit computes the framework's metrics with them, as the run logged them
    framework_settings: dict[str, Any] = field(default_factory=dict)

    def for_side(self, side: Side) -> dict[str, Any]:
        """summary.json `engines.<source>.from_config`: this side's spec and its settings."""
        return {"framework": self.framework, "file": self.file, "loader": self.loader, "side": side,
                "spec": self.specs[side], "model": self.model, "notices": list(self.notices),
                "framework_settings": dict(self.framework_settings),
                "settings": [s.to_dict() for s in self.settings if s.side == side]}


@dataclass(slots=True)
class Deriving:
    """A reader's running account: each key it read, as an option of one side's engine or as a
    line saying why not. `derived()` joins the options into the two specs."""

    framework: str
    file: str
    loader: str
    kinds: dict[Side, str] = field(default_factory=lambda: {"train": "hf", "infer": "vllm"})
    options: dict[Side, dict[str, Any]] = field(default_factory=lambda: {"train": {}, "infer": {}})
    settings: list[Setting] = field(default_factory=list)
    model: str | None = None
    notices: list[str] = field(default_factory=list)
    bypass: bool = False  # the trainer never recomputes old log-probs: the train side is the update's forward
    framework_settings: dict[str, Any] = field(default_factory=dict)

    def notice(self, text: str) -> None:
        """A line the first screen must carry."""
        self.notices.append(text)

    def same(self, side: Side, key: str, value: Any, note: str = "") -> None:
        """`key` is listed for the record; nothing needs setting for the replay to match it."""
        self.settings.append(Setting(side=side, key=key, value=value, status="reproduced", option=None, note=note))

    def reproduce(self, side: Side, key: str, value: Any, option: str, option_value: Any, note: str = "") -> None:
        """`key` is reproduced as the engine option `option=option_value`."""
        self._set(side, option, option_value)
        self.settings.append(Setting(side=side, key=key, value=value, status="reproduced",
                                     option=f"{option}={_shown(option_value)}", note=note))

    def approximate(self, side: Side, key: str, value: Any, note: str, option: str | None = None,
                    option_value: Any = None) -> None:
        """`key` cannot run here as configured; `option=option_value` (or the engine's default,
        with option None) comes nearest, and `note` says what differs."""
        if option is not None:
            self._set(side, option, option_value)
        self.settings.append(Setting(side=side, key=key, value=value, status="approximated",
                                     option=f"{option}={_shown(option_value)}" if option else None, note=note))

    def cannot(self, side: Side, key: str, value: Any, note: str) -> None:
        """`key` decides log-probs and no engine option here reproduces it: `note` says why."""
        self.settings.append(Setting(side=side, key=key, value=value, status="not reproduced", option=None,
                                     note=note))

    def fork(self, side: Side, base: Side, without: frozenset[str]) -> None:
        """A side that computes like `base` but for the options in `without`: base's options and
        settings copied, those of `without` left for the reader to set."""
        self.kinds[side] = self.kinds[base]
        self.options[side] = {k: v for k, v in self.options[base].items() if k not in without}
        self.settings += [replace(s, side=side) for s in self.settings
                          if s.side == base and (s.option or "").partition("=")[0] not in without]

    def _set(self, side: Side, option: str, value: Any) -> None:
        previous = self.options[side].get(option)
        if previous is not None and previous != value:  # two keys onto one option: a reader's bug
            raise AssertionError(f"{self.framework}: {side} option {option} set to {previous!r} and {value!r}")
        self.options[side][option] = value

    def derived(self) -> Derived:
        specs = {side: spec_text(self.kinds[side], self.options.get(side, {})) for side in self.kinds}
        settings = self.settings
        if self.bypass and "update" in specs:  # what the run's ratio compares: the update forward vs the sampler
            specs["train"] = specs["update"]
            settings = [s for s in settings if s.side != "train"] + [replace(s, side="train") for s in settings
                                                                      if s.side == "update"]
        return Derived(framework=self.framework, file=self.file, loader=self.loader, specs=specs,
                       settings=tuple(settings), model=self.model, notices=tuple(self.notices),
                       framework_settings=dict(self.framework_settings))


def spec_text(kind: str, options: dict[str, Any]) -> str:
    """`kind:key=value,...` in the option order given; an engine with no options is its kind."""
    if not options:
        return kind
    return f"{kind}:" + ",".join(f"{key}={_shown(value)}" for key, value in options.items())
