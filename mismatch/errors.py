"""The one exception hierarchy of mismatch: what the user got wrong, and where.

The CLI (`cli.main`) turns any `MismatchError` into one line on stderr and exit code 2, and an
`EnvironmentFault` (the machine, not the input: disk full) into one line and exit code 3; exit
code 1 means only "the gate failed". Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MismatchError(Exception):
    """Bad input or usage: the message is complete, one line, and names where."""


class RolloutError(MismatchError):
    """A rollout file that does not follow format v1 (names file, line, rollout and field)."""

    def __init__(self, message: str, *, file: str, line: int | None = None,
                 rollout: str | None = None, field: str | None = None) -> None:
        self.file, self.line, self.rollout, self.field = file, line, rollout, field
        self.reason = message
        super().__init__(self._format())

    def _format(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        parts = [where]
        if self.rollout is not None:
            parts.append(f"rollout {self.rollout!r}")
        if self.field is not None:
            parts.append(self.field)
        parts.append(self.reason)
        return ": ".join(parts)


class SpecError(MismatchError):
    """An engine spec string or TOML that cannot be understood."""


class EngineError(MismatchError):
    """An engine that fails in a way the user can fix (missing backend, bad output, no server)."""


class CheckpointError(MismatchError):
    """A checkpoint directory that cannot be loaded safely."""


class ResultsError(MismatchError):
    """A results directory that is missing, malformed, or would overwrite the user's files."""


class ReportError(MismatchError, ValueError):
    """A results dir the report cannot be built from (raised by `reports/`, which may import only this
    module of the core: a light import, so the CLI catches it without loading the report builder)."""


class EnvironmentFault(Exception):
    """The machine failed the run, not its input (disk full, quota, read-only file system): one
    line and exit code 3, so a CI script tells it from bad input (2) and a failed gate (1)."""


ENVIRONMENT_FAULT_EXIT = 3
