"""The commands that look closer at one input or result: validate, weights, drift, layers, probe,
report. Each parses, calls the library, prints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from mismatch.cli.options import JsonFlag
from mismatch.cli.output import emit_json, err_console, out_console
from mismatch.cli.printing import print_layers, print_weights
from mismatch.cli.progress import working
from mismatch.errors import RolloutError

if TYPE_CHECKING:
    from mismatch.checkpoint import CheckpointInfo


def report(
    results: Annotated[Path, typer.Argument(metavar="RESULTS",
                                            help="Results directory (audit, diff or merge).")],
    tokenizer: Annotated[Optional[Path], typer.Option(
        help="tokenizer.json for token text (default: the checkpoint's, when it is found).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Rebuild DIR/index.html from DIR/summary.json and DIR/tokens.parquet."""
    from mismatch.reports import build_report
    from mismatch.results import REPORT_FILE, file_fault, read_summary, results_lock

    read_summary(results)  # not a results dir: refused before the lock makes anything beside it
    # Held while it reads, as audit and merge hold it while they write: a `merge --force` of this
    # dir replacing tokens.parquet under the reader is refused (exit 2), not a pyarrow traceback.
    with results_lock(results):
        try:
            path = build_report(results, tokenizer_path=tokenizer)
        except OSError as error:  # an immutable or unwritable index.html, a full disk
            raise file_fault(error, str(results / REPORT_FILE)) from None
    if as_json:
        emit_json({"report": str(path)})
        return
    out_console.print(f"wrote {path}", markup=False)


def probe(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT",
                                               help="Checkpoint whose shapes the probes use.")],
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    out: Annotated[Optional[Path], typer.Option(help="Also write the results as JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Kernel probes: each op under the variations that differ between inference and training.

    Matmul, attention, norms, softmax and reductions at the model's shapes; bitwise-equal
    fraction and max abs / ULP difference per variation."""
    from mismatch import probes
    from mismatch.results import atomic_write_text, json_safe

    with working("probing each op under batch, chunking, split-KV, dtype and rounding variations", not as_json):
        results = probes.run_probes(checkpoint, device=device)
    payload = {"environment": probes.environment(device), "results": [r.to_dict() for r in results]}
    if out is not None:
        atomic_write_text(out, json.dumps(json_safe(payload), indent=1) + "\n")
    if as_json:
        emit_json(payload)
        return
    out_console.print(probes.format_table(results), markup=False, highlight=False, soft_wrap=True)


def layers(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="Checkpoint directory.")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollouts file (.jsonl or .parquet).")],
    a: Annotated[str, typer.Option("--a", help="Candidate config (hf or hf-decode spec, or FRAMEWORK:FILE).")],
    b: Annotated[str, typer.Option("--b", help="Reference config (hf or hf-decode spec, or FRAMEWORK:FILE).")],
    max_tokens: Annotated[int, typer.Option(help="Tokens to compare (first branches first).")] = 2048,
    out: Annotated[Optional[Path], typer.Option(help="Also write the localization JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Where a's residual stream departs from b's: per layer and sub-block, logit lens, kernels."""
    from mismatch.checkpoint import checkpoint_info
    from mismatch.frameworks.configs import config_framework, resolve
    from mismatch.localize import check_localizable, localize_models
    from mismatch.replay import plan_replay
    from mismatch.results import atomic_write_text, json_safe
    from mismatch.rollouts import load_rollouts

    # a trainer's config (verl:ppo.yaml) names its trainer replay here, as in audit and diff
    a, b = (resolve(text, "train").spec if config_framework(text) else text for text in (a, b))
    check_localizable(a, b, flag="layers")
    plan = plan_replay(load_rollouts(rollouts, vocab_size=checkpoint_info(checkpoint).vocab_size))
    with working(f"layers: replaying {a} and {b} with hooks on every layer", not as_json):
        found = localize_models(checkpoint, plan.requests, a=a, b=b, max_tokens=max_tokens)
    if out is not None:
        atomic_write_text(out, json.dumps(json_safe(found), indent=1) + "\n")
    if as_json:
        emit_json(found)
        return
    from mismatch.results.section_records import Localization
    from mismatch.results.summary_model import from_builtins, to_builtins

    print_layers(from_builtins(to_builtins(found), Localization))


def weights(
    a: Annotated[Path, typer.Argument(metavar="CKPT_A",
                                      help="First checkpoint (e.g. the trainer's export).")],
    b: Annotated[Path, typer.Argument(metavar="CKPT_B",
                                      help="Second checkpoint (e.g. what the engine loaded).")],
    fail_on_diff: Annotated[bool, typer.Option(help="Exit 1 when any tensor differs.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Tensor-by-tensor diff of two safetensors checkpoints, streamed: the weight-sync bug finder."""
    from mismatch.weights import diff_checkpoints

    with working("comparing the checkpoints tensor by tensor", not as_json):
        report = diff_checkpoints(a, b)
    if as_json:
        emit_json(report.to_dict())
    else:
        print_weights(report)
    if fail_on_diff and not report.identical:
        raise typer.Exit(1)


def drift(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT",
                                               help="Checkpoint whose chat template renders messages.")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollouts with `messages`.")],
    as_json: JsonFlag = False,
) -> None:
    """Re-render each rollout's messages with the chat template; show where the stored tokens differ."""
    from mismatch.rollouts.drift import describe_span, drift_file

    with working("re-rendering each rollout's messages with the chat template", not as_json):
        found = drift_file(checkpoint, rollouts)
    if as_json:
        emit_json(found)
        return
    for span in found["spans"]:
        out_console.print(describe_span(span), markup=False, highlight=False, soft_wrap=True)
    out_console.print(f"{len(found['spans'])} drifted span(s)", markup=False)


def validate(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Rollouts file (.jsonl or .parquet).")],
    checkpoint: Annotated[Optional[Path], typer.Option(help="Check token ids against this vocab (and expert ids against its experts).")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Check token ids against this size.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Check a rollouts file against format v1 and report every problem (exit 2 if any)."""
    from mismatch.checkpoint import checkpoint_info
    from mismatch.rollouts import validate_file

    num_experts = info = None  # with a checkpoint, routed_experts ids are checked against its experts too
    if checkpoint is not None:
        info = checkpoint_info(checkpoint)
        vocab_size, num_experts = info.vocab_size, info.num_experts
    report = validate_file(file, vocab_size=vocab_size, num_experts=num_experts)
    # A valid file is checked against the model's context as an audit checks it before replaying.
    context = _context_errors(file, info) if info is not None and not report.errors else []
    errors = [*report.errors, *context]
    if as_json:
        emit_json({"num_rollouts": report.num_rollouts, "num_branches": report.num_branches,
                    "num_invalid": report.num_invalid, "num_tokens": report.num_tokens, "num_trainable_tokens": report.num_trainable_tokens,
                    "errors": [str(e) for e in errors], "truncated": report.truncated})
    else:
        for error in errors:
            err_console.print(str(error), markup=False, highlight=False, soft_wrap=True)
        total = report.num_rollouts + report.num_invalid
        status = ("ok" if not errors else f"{len(errors)} error(s) in {report.num_invalid}" if report.errors
                  else f"{len(errors)} error(s) for {checkpoint}")
        out_console.print(f"{file}: {total} rollouts, {status}; valid ones hold {report.num_branches} "
                          f"branches, {report.num_tokens:,} tokens ({report.num_trainable_tokens:,} "
                          "trainable)", markup=False, highlight=False, soft_wrap=True)
    if errors:
        raise typer.Exit(2)


def _context_errors(file: Path, info: CheckpointInfo) -> list[RolloutError]:
    """A stream longer than the model's context, as an audit refuses it: the replay's own scan of the
    file and check (replay.checks.check_context), for the checkpoint's model."""
    from mismatch.replay import DEFAULT_BLOCK, FileBlocks, scan_file
    from mismatch.replay.checks import check_context

    if info.max_positions is None:  # config.json declares no context: nothing to check against
        return []
    scan = scan_file(FileBlocks(rollouts=file, info=info, shard=None, block_size=DEFAULT_BLOCK))
    try:
        check_context(scan, {"checkpoint": info}, info, {}, file=str(file))
    except RolloutError as error:
        return [error]
    return []
