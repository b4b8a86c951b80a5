"""The `mismatch` command line: parse, call the library, print.

Errors meet one boundary here (`main`): a MismatchError or a usage error becomes one line on
stderr and exit code 2 (MISMATCH_DEBUG=1 shows the traceback); anything else is a bug and keeps
its traceback. SIGTERM and SIGINT meet it too: the run unwinds (its `finally` blocks clean up),
then one line and exit code 128 + the signal. The commands live by what users do with them: measure.py (audit, diff, merge,
recommend, gate), trend.py (a run's steps), inspect.py (report, probe, layers, weights, drift, validate) and capture.py
(record, import, demo); this module gathers them into one typer app.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated, Any

import typer

from mismatch.batch import interruptible
from mismatch.cli.capture import demo, import_, record
from mismatch.cli.dependency_output import dependency_log, quiet_dependencies
from mismatch.cli.inspect import drift, layers, probe, report, validate, weights
from mismatch.cli.measure import audit, diff, gate, merge, recommend
from mismatch.cli.output import err_console, json_stdout_aside, out_console
from mismatch.cli.printing import (
    KEY_METRICS,
    print_diagnosis,
    print_diff,
    print_findings,
    print_layers,
    print_pairs,
    print_weights,
)
from mismatch.cli.progress import replay_progress, working
from mismatch.cli.trend import trend
from mismatch.errors import ENVIRONMENT_FAULT_EXIT, EnvironmentFault, MismatchError

__all__ = ["KEY_METRICS", "app", "audit", "demo", "dependency_log", "diff", "drift", "err_console",
           "gate", "import_", "layers", "main", "merge", "out_console", "print_diagnosis", "print_diff",
           "print_findings", "print_layers", "print_pairs", "print_weights", "probe", "record",
           "recommend", "replay_progress", "report", "run", "trend", "validate", "weights", "working"]

# The one statement of the exit codes: `mismatch --help` prints it and the README quotes it
# (tests/test_readme.py holds the two equal).
EXIT_CODES = ("Exit codes: 0 ok, 1 gate failed, 2 bad input or usage, 3 the machine failed (disk full), "
              "130 or 143 interrupted by SIGINT or SIGTERM (rerun to resume).")

# Plain Click help (no rich markup): brackets and % print as written, flags have no metavar.
app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Measure, localize and correct the log-prob gap between an RL trainer and "
                       "its inference engine.",
                  epilog="Engine specs (--train, --infer, --a, --b, --reference): hf, hf:dtype=bf16,attn=eager, "
                         "hf-decode:dtype=bfloat16, vllm:dtype=bfloat16,enable_prefix_caching=false, "
                         "http://127.0.0.1:8000/v1, sampler, stored:NAME, python:MODULE:CALLABLE[,opt=v], or "
                         f"engine.toml. {EXIT_CODES} MISMATCH_DEBUG=1 shows tracebacks. Every word of the "
                         "outputs is defined in docs/glossary.md.")

# `mismatch --help` lists the commands in this order (typer keeps the order they are added in).
COMMANDS = (("audit", audit), ("diff", diff), ("merge", merge), ("report", report),
            ("recommend", recommend), ("gate", gate), ("trend", trend), ("probe", probe), ("layers", layers),
            ("weights", weights), ("drift", drift), ("record", record), ("import", import_),
            ("validate", validate), ("demo", demo))
for _name, _command in COMMANDS:
    app.command(name=_name)(_command)


def _click_usage_name(self: Any) -> str:
    """Click's convention on the usage line: a required argument is NAME, an optional one [NAME]
    (typer >= 0.20 writes {NAME}, which reads like a set or a placeholder to fill with braces)."""
    name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
    return name + ("..." if self.nargs != 1 and not name.rstrip("]").endswith("...") else "")


def _argument_type(self: Any, ctx: Any) -> str | None:
    """An argument's metavar (RESULTS..., DIR...) says what it takes: no `<list[Path]>` beside it."""
    return None if self.metavar else _typer_argument_type(self, ctx)


if hasattr(typer.core.TyperArgument, "_usage_display_name"):
    typer.core.TyperArgument._usage_display_name = _click_usage_name  # type: ignore[method-assign]
_typer_argument_type = getattr(typer.core.TyperArgument, "display_type_rich", None)
if _typer_argument_type is not None:
    typer.core.TyperArgument.display_type_rich = _argument_type  # type: ignore[method-assign]


def _version(show: bool) -> None:
    if show:
        from mismatch.version import __version__

        out_console.print(f"mismatch {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_version, help="Print the version and exit.")] = False) -> None:
    """Options of `mismatch` itself (before the command)."""


INTERRUPTED = "mismatch: interrupted; rerun the same command to resume"


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: the error boundary, and the signals' (see batch.interruptible)."""
    with interruptible() as interrupt:
        try:
            code = _command(argv)
        except KeyboardInterrupt:  # one raised outside the command (typer turns one inside into 130)
            interrupt.signum = interrupt.signum or signal.SIGINT
    if interrupt.signum is not None:
        err_console.print(INTERRUPTED, markup=False, highlight=False, soft_wrap=True)
        return 128 + interrupt.signum
    return code


def _command(argv: list[str] | None) -> int:
    debug = os.environ.get("MISMATCH_DEBUG") == "1"
    quiet_dependencies()
    args = sys.argv[1:] if argv is None else argv
    with json_stdout_aside("--json" in args):
        try:
            code = app(args=argv, prog_name="mismatch", standalone_mode=False)
        except MismatchError as exc:
            if debug:
                raise
            err_console.print(f"mismatch: error: {exc}", markup=False, highlight=False, soft_wrap=True)
            return 2
        except EnvironmentFault as exc:
            if debug:
                raise
            err_console.print(f"mismatch: error: {exc}", markup=False, highlight=False, soft_wrap=True)
            return ENVIRONMENT_FAULT_EXIT
        except typer.TyperException as exc:  # usage errors: missing option, bad value, unknown command
            message = getattr(exc, "format_message", exc.__str__)()
            if message.startswith("Usage:"):  # bare `mismatch`: its help is the message, not an error
                sys.stderr.write(message.rstrip("\n") + "\n")
            elif message:
                err_console.print(f"mismatch: error: {message}", markup=False, highlight=False, soft_wrap=True)
            return 2
        except typer.Abort as exc:
            if not isinstance(exc.__cause__, KeyboardInterrupt):  # Ctrl-C (in older click): main says it
                err_console.print("mismatch: aborted", markup=False)
            return 130
    return code if isinstance(code, int) else 0


def run() -> None:
    """The console script: a process of its own, set up as a batch job (mismatch/batch.py)."""
    from mismatch.batch import end_batch, tune_for_batch

    tune_for_batch()
    code = main()
    end_batch()
    sys.exit(code)
