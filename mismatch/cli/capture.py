"""The commands that make a rollouts file: import (another framework's dump), record (a proxy in
front of the engine), demo (the built-in example, audited).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mismatch.cli.dependency_output import dependency_log
from mismatch.cli.options import JsonFlag
from mismatch.cli.output import emit_json, err_console, out_console
from mismatch.cli.printing import print_pairs
from mismatch.cli.progress import replay_progress
from mismatch.errors import MismatchError


def record(
    upstream: Annotated[str, typer.Option("--upstream", help="The vLLM or SGLang server, e.g. http://127.0.0.1:8000.")],
    out: Annotated[Path, typer.Option("--out", help="Rollouts file to write, a line per conversation (format v1 JSONL).")],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free one).")] = 9000,
    idle_seconds: Annotated[float, typer.Option(
        "--idle-seconds", help="Write a conversation once it has had no request for this long.")] = 300.0,
    api_key_env: Annotated[Optional[str], typer.Option(
        "--api-key-env", help="Require harnesses to send this environment variable's value as bearer token.")] = None,
    upstream_key_env: Annotated[Optional[str], typer.Option(
        "--upstream-key-env", help="Send this environment variable's value to the upstream as its API key.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output file.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Proxy an OpenAI-compatible engine and record what it sampled as rollouts (stop: Ctrl-C)."""
    try:
        from mismatch.record.proxy import RecordOptions
        from mismatch.record.proxy import record as run_proxy
    except ModuleNotFoundError as e:
        raise MismatchError(f"mismatch record needs {e.name}: pip install 'mismatch[record]'") from None

    done = run_proxy(RecordOptions(upstream=upstream, out=out, host=host, port=port, idle_seconds=idle_seconds,
                                   api_key_env=api_key_env, upstream_key_env=upstream_key_env, force=force),
                     announce=lambda line: err_console.print(line, markup=False, highlight=False, soft_wrap=True))
    if as_json:  # on stop: what was written, as the line below says it
        emit_json({"out": str(done.out), "num_rollouts": done.num_rollouts, "num_requests": done.num_requests,
                   "num_unrecorded": done.num_unrecorded})
        return
    out_console.print(f"wrote {done.num_rollouts} rollouts ({done.num_requests} recorded requests, "
                      f"{done.num_unrecorded} not recorded) to {done.out}", markup=False, highlight=False,
                      soft_wrap=True)


def import_(
    fmt: Annotated[str, typer.Argument(metavar="FORMAT", help="verl, prime-rl, skyrl, verifiers or slime.")],
    file: Annotated[Path, typer.Argument(metavar="FILE", help="The framework's dump.")],
    out: Annotated[Path, typer.Option("--out", help="Rollouts file to write (format v1 JSONL).")],
    allow_pickle: Annotated[bool, typer.Option(
        "--allow-pickle", help="Allow unpickling (runs code from the file: trusted files only).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output file.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Convert another framework's rollout dump into mismatch's format v1."""
    from mismatch.rollouts.importers import import_file

    if out.exists() and not force:
        raise MismatchError(f"{out}: already exists; pass --force to replace it")
    count = import_file(fmt, file, out, allow_pickle=allow_pickle)
    if as_json:
        emit_json({"out": str(out), "num_rollouts": count})
        return
    out_console.print(f"wrote {count} rollouts to {out}", markup=False)


def demo(
    out: Annotated[Path, typer.Option("--out", help="Demo directory.")] = Path("reports/demo"),
    as_json: JsonFlag = False,
) -> None:
    """Build the tiny checkpoint, sample agentic rollouts from it, and audit them."""
    from mismatch.demo import run_demo

    say = (lambda _: None) if as_json else (
        lambda line: err_console.print(line, markup=False, highlight=False, soft_wrap=True))
    with dependency_log(out / "audit"), replay_progress(not as_json) as progress:
        result = run_demo(out, progress=progress, say=say)
    if as_json:
        emit_json(result.record.to_dict())
        return
    print_pairs(result.record)
    out_console.print(f"wrote {result.out}/")
    out_console.print(f"report: {result.out / 'index.html'}  (open it in a browser)", markup=False,
                      highlight=False, soft_wrap=True)
    out_console.print("next:", markup=False)
    for command in (f"mismatch recommend {result.out} --for verl   # the fix, as a config to paste",
                    f"mismatch gate {result.out} --max kl_k3=1e-3   # the CI check (exit 1 past it)"):
        out_console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)
