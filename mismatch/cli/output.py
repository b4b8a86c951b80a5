"""The CLI's two consoles and its small printing helpers; where --json output goes.

Every other CLI module prints through these, so stdout stays the JSON alone under --json.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from rich.console import Console

if TYPE_CHECKING:
    from rich.table import Table

out_console = Console()
err_console = Console(stderr=True)


def say(line: str) -> None:
    out_console.print(line, markup=False, highlight=False, soft_wrap=True)


# Off a terminal (a pipe, a CI log) nothing redraws and nobody resizes: a table is laid out this
# wide, at its natural width, so no metric name is cut to "log_ratio_abs_me…".
PLAIN_WIDTH = 400


def new_table(**options: Any) -> Table:
    # Imported on use: `mismatch --help` should not pay for rich's table layout.
    from rich.table import Table

    if not out_console.is_terminal and out_console.width < PLAIN_WIDTH:
        out_console.width = PLAIN_WIDTH
    return Table(**options)


# Where --json output goes: the real stdout, kept aside while the command runs with sys.stdout
# pointed at stderr, so whatever a dependency prints (vLLM logs to stdout) cannot corrupt the JSON.
_json_stdout: Any = None


def emit_json(payload: Any) -> None:
    from mismatch.results import json_safe

    (_json_stdout or sys.stdout).write(json.dumps(json_safe(payload), indent=1) + "\n")


@contextmanager
def json_stdout_aside(enabled: bool) -> Iterator[None]:
    """With --json, sys.stdout points at stderr while the command runs; emit_json writes to the
    real stdout, kept aside here."""
    global _json_stdout
    saved = sys.stdout
    if enabled:
        _json_stdout, sys.stdout = saved, sys.stderr
    try:
        yield
    finally:
        sys.stdout, _json_stdout = saved, None
