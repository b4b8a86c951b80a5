"""The `mismatch` command line: parse, call the library, print.

Errors meet one boundary here: a MismatchError or a usage error becomes one line on stderr and
exit code 2 (MISMATCH_DEBUG=1 shows the traceback); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Iterator, Optional

import typer
from rich.console import Console

from mismatch.errors import EngineError, MismatchError

if TYPE_CHECKING:
    from mismatch.frameworks._common import Target
    from rich.table import Table

# Plain Click help (no rich markup): brackets and % print as written, flags have no metavar.
app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Measure, localize and correct the log-prob gap between an RL trainer and "
                       "its inference engine.",
                  epilog="Engine specs (--train, --infer, --a, --b, --reference): hf, hf:dtype=bf16,attn=eager, "
                         "hf-decode:dtype=bfloat16, vllm:dtype=bfloat16,enable_prefix_caching=false, "
                         "http://127.0.0.1:8000/v1, sampler, stored:NAME, python:MODULE:CALLABLE[,opt=v], or "
                         "engine.toml. Exit codes: 0 ok, 1 gate failed, 2 bad input or usage "
                         "(MISMATCH_DEBUG=1 shows tracebacks).")


def _click_usage_name(self: Any) -> str:
    """Click's convention on the usage line: a required argument is NAME, an optional one [NAME]
    (typer >= 0.20 writes {NAME}, which reads like a set or a placeholder to fill with braces)."""
    name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
    return name + ("..." if self.nargs != 1 else "")


if hasattr(typer.core.TyperArgument, "_usage_display_name"):
    typer.core.TyperArgument._usage_display_name = _click_usage_name  # type: ignore[method-assign]
out_console = Console()
err_console = Console(stderr=True)

KEY_METRICS = ("n_tokens", "log_ratio_abs_mean", "log_ratio_abs_max", "kl_k3", "chi2_token",
               "ess", "ratio_q001", "ratio_q999", "bitwise_equal_frac")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")]
FrameworkOption = Annotated[Optional[str], typer.Option(
    "--for", help="Your trainer: verl, trl, slime, prime-rl, openrlhf or areal, as NAME[==VERSION]"
                  "[:SETTING=VALUE,...] (its own correction settings; default: $MISMATCH_FRAMEWORK).")]
ShardOption = Annotated[Optional[str], typer.Option(
    "--shard", help="Replay only shard I of N (I/N, 0-based); combine with `mismatch merge`.")]
BlockOption = Annotated[int, typer.Option(
    "--block-size", min=1, help="Rollouts per unit of work (resume, shards, batching).")]
DEFAULT_BLOCK = 64  # mismatch.replay.DEFAULT_BLOCK, repeated so --help needs no heavy import


def _version(show: bool) -> None:
    if show:
        from mismatch import __version__

        out_console.print(f"mismatch {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_version, help="Print the version and exit.")] = False) -> None:
    """Options of `mismatch` itself (before the command)."""


def _read_probes(path: Path) -> list[dict[str, Any]]:
    """The `results` of a `mismatch probe --out FILE` JSON."""
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise MismatchError(f"{path}: no such probes file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise MismatchError(f"{path}: not valid JSON ({exc})") from None
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list) or not all(isinstance(item, dict) for item in results):
        raise MismatchError(f"{path}: not a `mismatch probe --out` file (no `results` list)")
    return results


def _target(spec: str | None) -> Target | None:
    """--for, else $MISMATCH_FRAMEWORK: NAME[==VERSION][:SETTING=VALUE,...]; checked before any work."""
    from mismatch.frameworks import parse_target

    spec = spec or os.environ.get("MISMATCH_FRAMEWORK") or None
    if spec is None:
        return None
    try:
        return parse_target(spec)
    except MismatchError as error:
        source = "--for" if spec != os.environ.get("MISMATCH_FRAMEWORK") else "MISMATCH_FRAMEWORK"
        raise MismatchError(f"{source}: {error}") from None


def _shard(text: str | None):
    from mismatch.replay import Shard

    return Shard.parse(text) if text is not None else None


@contextmanager
def replay_progress(enabled: bool) -> Iterator[Any]:
    """A rich progress bar per replay, on stderr so --json output stays clean.

    Started at the first replay, so an input error found before any replay prints only its line.
    """
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("tokens"), TimeRemainingColumn())
    progress = Progress(*columns, console=err_console)

    loading: set[Any] = set()

    def factory(label: str, total: int | None):
        if total is None:  # a phase without a count (an engine starting), shown while it runs
            if not progress.live.is_started:  # nothing on screen yet: a failing first load stays one line
                return lambda done: None
            task = progress.add_task(label, total=None)
            loading.add(task)
            return lambda done: (progress.remove_task(task), loading.discard(task))
        progress.start()
        task = progress.add_task(label, total=total)
        return lambda done: progress.advance(task, done)

    try:
        yield factory
    finally:
        for task in list(loading):  # a load that failed: its error line says the rest
            progress.remove_task(task)
        if progress.live.is_started:
            progress.stop()


@contextmanager
def dependency_log(out: Path) -> Iterator[None]:
    """Everything the dependencies print goes to DIR/dependencies.log, not between the progress bars.

    File descriptor 2 itself is pointed at the log, so vLLM's engine-core process, C++ warnings
    (NUMA, Triton) and tqdm bars go there too; our own console keeps the real stderr. Python
    warnings and the "vllm" logger are routed to the same file. The log is written beside the
    results dir and moved into it once it is published (its path said once). A failed run keeps
    it as OUT.failed.log only when it holds something (an engine's own account of why it failed)
    and says where; a later successful run removes that file.
    """
    import logging

    from mismatch.results import DEPENDENCY_LOG

    out.parent.mkdir(parents=True, exist_ok=True)
    pending = out.parent / f".{out.name}.{os.getpid()}.log"
    failed_log = out.parent / f"{out.name}.failed.log"
    log_file = pending.open("ab")
    handler = logging.StreamHandler(open(log_file.fileno(), "w", closefd=False, buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("py.warnings", "vllm")]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    sys.stderr.flush()
    real_stderr = os.dup(2)
    # Console._file: None means "whatever sys.stderr is at each write" (what it goes back to).
    restore_file = err_console._file
    console_stream = None
    if _is_fd2(sys.stderr):  # the console writes to the real stderr, not to the log
        console_stream = open(real_stderr, "w", closefd=False, buffering=1)
        err_console.file = console_stream
    os.dup2(log_file.fileno(), 2)
    logging.captureWarnings(True)
    for logger in loggers:
        logger.handlers, logger.propagate = [handler], False
    published, keep = False, False
    try:
        yield
        published = out.is_dir()
    except BaseException as exc:
        # An engine that failed may have said why only in its own output; bad input has its line.
        keep = isinstance(exc, EngineError) or not isinstance(exc, (MismatchError, typer.Abort,
                                                                     KeyboardInterrupt))
        raise
    finally:
        logging.captureWarnings(False)
        for logger, (handlers, propagate) in zip(loggers, saved):
            logger.handlers, logger.propagate = handlers, propagate
        handler.flush()
        sys.stderr.flush()
        if console_stream is not None:
            console_stream.close()  # flushed; the descriptor itself is closed just below
        os.dup2(real_stderr, 2)
        os.close(real_stderr)
        err_console._file = restore_file
        log_file.close()
        _settle_log(pending, out, failed_log, published, keep, DEPENDENCY_LOG)


def _is_fd2(stream: Any) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # a test runner's buffer
        return False


def _last_error_line(log: Path) -> str | None:
    """The last `SomeError: text` line of a log that is not a pointer to another one (a root
    cause raised in an engine's worker process is re-raised as "see above" in the parent)."""
    import re

    pattern = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): \S")
    lines = log.read_text(errors="replace").splitlines()
    causes = [line for line in lines if pattern.match(line) and "root cause" not in line
              and "stack trace" not in line]
    return causes[-1][:400] if causes else None


def _settle_log(pending: Path, out: Path, failed_log: Path, published: bool, keep: bool,
                name: str) -> None:
    """The log into the published dir, kept beside a failed run as OUT.failed.log (`keep`: an
    engine failed), or removed."""
    size = pending.stat().st_size if pending.exists() else 0
    if published:
        failed_log.unlink(missing_ok=True)  # ours, from an earlier failed run of this command
    if size and published:
        import shutil

        shutil.move(pending, out / name)  # a rename, or a copy when OUT is a mount point
        say = f"dependency messages: {out / name}"
    elif size and keep:
        os.replace(pending, failed_log)
        say = f"the dependencies' own output of this failed run: {failed_log}"
        cause = _last_error_line(failed_log)
        if cause:
            say += f"; it ends with: {cause}"
    else:
        pending.unlink(missing_ok=True)
        return
    err_console.print(say, markup=False, highlight=False, soft_wrap=True)


@contextmanager
def working(label: str, enabled: bool) -> Iterator[None]:
    """A spinner with its label on stderr while a phase without a token count runs (not with --json)."""
    if not enabled:
        yield
        return
    with err_console.status(label + " …"):
        yield


def print_pairs(summary: dict[str, Any], target: Target | None = None, out: Path | None = None) -> None:
    """Metrics as rows, pairs as columns: fits 80 columns for the three pairs of an audit. With a
    target framework, its own metric names and values as well: summary.json framework_metrics (its
    default settings), or, when the target names settings, recomputed at them from OUT's tokens."""
    table = _table(title="log(pi_A / pi_B) over trainable tokens", title_justify="left")
    table.add_column("metric")
    pairs = summary["pairs"]
    for pair in pairs:
        table.add_column(pair, justify="right")
    for name in KEY_METRICS:
        table.add_row(name, *(_fmt(metrics.get(name)) for metrics in pairs.values()))
    out_console.print(table)
    if target is not None:
        _print_framework_metrics(summary, target, out)
    from mismatch.analysis.clip import clip_sentence

    if sentence := clip_sentence(summary):  # the question behind the table: is my ratio OK?
        out_console.print(sentence[:1].upper() + sentence[1:] + ".", markup=False, highlight=False,
                          soft_wrap=True)
    for pair, verdict in summary.get("verdicts", {}).items():
        out_console.print(f"{pair} ({verdict['meaning']}): {verdict['level']}: {verdict['text']}",
                          markup=False, highlight=False, soft_wrap=True)
    from mismatch.analysis.prefixes import prefix_sentence, split_prefixes

    for source, finding in split_prefixes(summary).items():
        out_console.print(prefix_sentence(source, finding, (summary.get("engines") or {}).get(source)),
                          markup=False, highlight=False, soft_wrap=True)


def _say(line: str) -> None:
    out_console.print(line, markup=False, highlight=False, soft_wrap=True)


def print_findings(summary: dict[str, Any]) -> None:
    """What the audit found besides the pairs: alignment and semantics, render drift, the turn
    onset or position trend, and what the localizers found (each said when it ran)."""
    alignment = summary.get("alignment") or {}
    if alignment.get("stored"):
        temperature = alignment.get("estimated_temperature")
        _say(f"alignment: shift {int(alignment.get('shift') or 0):+d}, stored log-probs "
             f"{alignment.get('logprob_semantics', 'unknown')}"
             + (f" (estimated temperature {temperature:.3g})" if isinstance(temperature, (int, float)) else ""))
    drift = summary.get("drift") or {}
    if drift.get("num_rollouts_checked"):
        _say(f"render drift: {drift.get('num_spans', 0)} span(s) in {drift.get('num_rollouts_drifted', 0)} of "
             f"{drift['num_rollouts_checked']} rollouts, {drift.get('trainable_tokens_touched', 0)} trainable "
             "token(s) touched")
    turns = (summary.get("localization") or {}).get("turns") or {}
    if turns.get("n_tokens"):
        onset, slope = turns.get("onset") or {}, turns.get("position_slope") or {}
        if turns.get("onset_turn") is not None:
            _say(f"turns: the {turns.get('pair')} gap steps up at turn {turns['onset_turn']}"
                 + (f" in {onset['n_rollouts_departing']} of {onset['n_rollouts_compared']} rollouts" if onset else ""))
        elif isinstance(slope.get("slope_per_1k"), (int, float)):
            grows = "grows" if slope.get("grows_with_position") else "does not grow"
            _say(f"turns: no turn where the {turns.get('pair')} gap steps up; it {grows} with position "
                 f"({slope['slope_per_1k']:.3g} per 1000 tokens)")
    localization = summary.get("localization") or {}
    if "layers" in localization or "kernels" in localization:
        from mismatch.localize import localized_what

        for line in localized_what(localization):
            _say(f"localize: {line}")


def print_diagnosis(summary: dict[str, Any]) -> None:
    """The diagnosis' causes (title, evidence) and findings, then the answer the report leads with."""
    from mismatch.reports.banner import audit_banner

    diagnosis = summary.get("diagnosis") or {}
    for n, cause in enumerate(diagnosis.get("causes") or [], start=1):
        _say(f"cause {n}{' (minor)' if cause.get('minor') else ''}: {cause['title']} [{cause['pair']}]")
        for line in [*(cause.get("evidence") or []), *(cause.get("rules_out") or [])]:
            _say(f"  - {line}")
    for finding in diagnosis.get("findings") or []:
        _say(f"note: {finding}")
    if "verdicts" in summary:
        _say(f"answer: {audit_banner(summary).headline}")


def _print_framework_metrics(summary: dict[str, Any], target: Target, out: Path | None) -> None:
    from mismatch.advise.recommend import logged_metrics

    framework = target.framework
    named = {pair: (block or {}).get(framework) or {} for pair, block in
             (summary.get("framework_metrics") or {}).items()}
    settings = (summary.get("framework_settings") or {}).get(framework)
    if target.settings and out is not None:
        logged = logged_metrics(out, target)
        if logged is not None:
            named, settings = {logged["pair"]: logged["metrics"]}, logged["settings"]
    if not any(named.values()):
        return
    words = ", ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "its defaults"
    table = _table(title=f"as {target.label} logs it (computed its way, with {words})", title_justify="left")
    table.add_column("key")
    for pair in named:
        table.add_column(pair, justify="right")
    for key in dict.fromkeys(k for values in named.values() for k in values):
        table.add_row(key, *(_fmt(values.get(key)) for values in named.values()))
    out_console.print(table)


def _table(**options: Any) -> Table:
    # Imported on use: `mismatch --help` should not pay for rich's table layout.
    from rich.table import Table

    return Table(**options)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


# Where --json output goes: the real stdout, kept aside while the command runs with sys.stdout
# pointed at stderr, so whatever a dependency prints (vLLM logs to stdout) cannot corrupt the JSON.
_json_stdout: Any = None


def _emit_json(payload: Any) -> None:
    from mismatch.results import json_safe

    (_json_stdout or sys.stdout).write(json.dumps(json_safe(payload), indent=1) + "\n")


@app.command()
def audit(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT",
                                               help="Checkpoint directory (HF format, safetensors).")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollouts file (.jsonl or .parquet).")],
    out: Annotated[Path, typer.Option("--out", help="Results directory to write.")],
    train: Annotated[str, typer.Option("--train", help="Trainer engine spec.")] = "hf",
    infer: Annotated[str, typer.Option("--infer", help="Inference engine spec.")] = "hf-decode",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing results dir.")] = False,
    localize: Annotated[bool, typer.Option(
        "--localize", help="Also localize train vs infer by layer and kernel (torch engines).")] = False,
    probe: Annotated[bool, typer.Option(
        "--probe", help="Also run the kernel probes; batch-shape variance adds the batch-invariant fix.")] = False,
    shard: ShardOption = None,
    block_size: BlockOption = DEFAULT_BLOCK,
    clip_eps: Annotated[str, typer.Option(
        "--clip-eps", help="PPO clip range to measure the gap against: EPS or EPS_LOW,EPS_HIGH.")] = "0.2",
    framework: FrameworkOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Replay stored rollouts through a trainer and an engine; write tokens.parquet + summary.json.

    Rerunning the same command after an interruption resumes from the finished blocks."""
    from mismatch.analysis.clip import ClipRange
    from mismatch.audit import audit as run_audit

    clip = ClipRange.parse(clip_eps)  # before any replay: a typo costs nothing
    target = _target(framework)
    with dependency_log(out), replay_progress(not as_json) as progress:
        result = run_audit(checkpoint, rollouts, train=train, infer=infer, out=out, force=force,
                           localize_models=localize, shard=_shard(shard), block_size=block_size,
                           progress=progress, clip=clip, probe=probe)
    if as_json:
        _emit_json(result.summary)
        return
    print_pairs(result.summary, target, out)
    print_findings(result.summary)
    print_diagnosis(result.summary)
    out_console.print(f"wrote {out}/")


@app.command()
def diff(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT",
                                               help="Checkpoint directory (HF format, safetensors).")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollouts file (.jsonl or .parquet).")],
    a: Annotated[str, typer.Option("--a", help="First engine config (spec or TOML).")],
    b: Annotated[str, typer.Option("--b", help="Second engine config (spec or TOML).")],
    out: Annotated[Path, typer.Option("--out", help="Results directory to write.")],
    reference: Annotated[str, typer.Option("--reference", help="Reference engine (the trainer).")] = "hf",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing results dir.")] = False,
    shard: ShardOption = None,
    block_size: BlockOption = DEFAULT_BLOCK,
    as_json: JsonFlag = False,
) -> None:
    """Replay two engine configs against a reference: which is closer, by how much, where, how fast."""
    from mismatch.diff import diff as run_diff

    with dependency_log(out), replay_progress(not as_json) as progress:
        result = run_diff(checkpoint, rollouts, a=a, b=b, reference=reference, out=out, force=force,
                          shard=_shard(shard), block_size=block_size, progress=progress)
    if as_json:
        _emit_json(result.summary)
        return
    print_pairs(result.summary)
    print_diff(result.summary["diff"])
    out_console.print(f"wrote {out}/")


def print_diff(comparison: dict[str, Any]) -> None:
    table = _table(title="b/reference − a/reference (95% bootstrap CI over rollouts)", title_justify="left")
    for column in ("metric", "a", "b", "delta", "ci95"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, d in comparison["deltas"].items():
        table.add_row(name, _fmt(d["a"]), _fmt(d["b"]), _fmt(d["delta"]),
                      f"[{_fmt(d['ci95'][0])}, {_fmt(d['ci95'][1])}]")
    out_console.print(table)
    speed = comparison["throughput_tokens_per_s"]
    out_console.print(f"closer to the reference: {comparison['closer_to_reference']} "
                      f"({comparison['closer_rule']}); replay tokens/s: a {_fmt(speed['a'])}, "
                      f"b {_fmt(speed['b'])}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def merge(
    dirs: Annotated[list[Path], typer.Argument(metavar="DIR...", help="Results dirs of shards 0..N-1.")],
    out: Annotated[Path, typer.Option("--out", help="Merged results directory to write.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing results dir.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Combine the results of `--shard I/N` runs into the results of one run."""
    from mismatch.merge import merge as run_merge

    summary = run_merge(dirs, out, force=force)
    if as_json:
        _emit_json(summary)
        return
    print_pairs(summary)
    out_console.print(f"wrote {out}/")


@app.command()
def report(
    results: Annotated[Path, typer.Argument(metavar="RESULTS",
                                            help="Results directory (audit, diff or merge).")],
    tokenizer: Annotated[Optional[Path], typer.Option(
        help="tokenizer.json for token text (default: the checkpoint's, when it is found).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Rebuild DIR/index.html from DIR/summary.json and DIR/tokens.parquet."""
    from mismatch.reports.build import build_report

    path = build_report(results, tokenizer_path=tokenizer)
    if as_json:
        _emit_json({"report": str(path)})
        return
    out_console.print(f"wrote {path}", markup=False)


@app.command()
def recommend(
    results: Annotated[Path, typer.Argument(metavar="RESULTS", help="Results directory of an audit.")],
    framework: FrameworkOption = None,
    probes: Annotated[Optional[Path], typer.Option(
        "--probes", help="`mismatch probe --out` JSON: batch-shape variance adds the batch-invariant fix.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The correction (and fixes at the source) the measured gap calls for, with a config snippet."""
    from mismatch.advise.recommend import for_target
    from mismatch.results import read_summary

    target = _target(framework)
    probe_results = _read_probes(probes) if probes is not None else None
    summary = read_summary(results)
    if summary.get("command") != "audit":  # a diff compares two configs: it recommends nothing
        raise MismatchError(f"{results}: a `mismatch {summary.get('command')}` results dir; recommend reads an "
                            "audit's (mismatch audit … --out DIR)")
    advice = for_target(summary, target, results=results, probes=probe_results)
    if as_json:
        _emit_json(advice.to_dict())
        return
    if advice.snippet is not None:  # the snippet alone (its comments carry each recommendation): pipeable
        sys.stdout.write(advice.snippet)
        return
    for cause in advice.diagnosis.get("causes") or []:  # the cause first, then what to do about it
        _say(f"cause{' (minor)' if cause.get('minor') else ''}: {cause['title']} [{cause['pair']}]")
    for item in advice.recommendations:
        cost = f" Cost: {item['cost']}." if item.get("cost") else ""
        out_console.print(f"{item['kind']} {json.dumps(item['params'])}: {item['why']}.{cost}",
                          markup=False, highlight=False)


@app.command()
def gate(
    results: Annotated[Path, typer.Argument(metavar="RESULTS", help="Results directory to gate.")],
    maxima: Annotated[Optional[list[str]], typer.Option(
        "--max", help="Upper bound METRIC=VALUE (or PAIR.METRIC=VALUE; default pair train/sampler).")] = None,
    minima: Annotated[Optional[list[str]], typer.Option("--min", help="Lower bound, e.g. ess=0.95.")] = None,
    thresholds: Annotated[Optional[Path], typer.Option(help="Thresholds TOML ([max], [min], max_drift_pct).")] = None,
    baseline: Annotated[Optional[Path], typer.Option(help="Baseline results dir to compare against.")] = None,
    max_drift: Annotated[Optional[float], typer.Option(help="Allowed % worsening vs the baseline.")] = None,
    junit: Annotated[Optional[Path], typer.Option(help="Write a JUnit XML report here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Fail (exit 1) when drift metrics exceed thresholds or worsen past a baseline."""
    from mismatch.advise import gate as gating

    limits = gating.load_thresholds(thresholds) if thresholds else gating.Thresholds()
    drift_pct = max_drift if max_drift is not None else (limits.max_drift_pct if baseline else None)
    result = gating.run_gate(
        gating.load_summary(results),
        maxima=gating.combined_limits(limits.maxima, gating.parse_limits(maxima or []), bound="max",
                                      file=thresholds),
        minima=gating.combined_limits(limits.minima, gating.parse_limits(minima or [], flag="--min"),
                                      bound="min", file=thresholds),
        baseline=gating.load_summary(baseline) if baseline else None, max_drift_pct=drift_pct)
    if junit:
        gating.write_junit(result, junit)
    if as_json:
        _emit_json(result.to_dict())
    else:
        if os.environ.get("GITHUB_ACTIONS") == "true":
            print(*gating.github_annotations(result), sep="\n")
        out_console.print(gating.format_table(result), markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(result.exit_code)


@app.command()
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
        _emit_json(payload)
        return
    out_console.print(probes.format_table(results), markup=False, highlight=False, soft_wrap=True)


@app.command()
def layers(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="Checkpoint directory.")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollouts file (.jsonl or .parquet).")],
    a: Annotated[str, typer.Option("--a", help="Candidate config (hf or hf-decode spec).")],
    b: Annotated[str, typer.Option("--b", help="Reference config (hf or hf-decode spec).")],
    max_tokens: Annotated[int, typer.Option(help="Tokens to compare (first branches first).")] = 2048,
    out: Annotated[Optional[Path], typer.Option(help="Also write the localization JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Where a's residual stream departs from b's: per layer and sub-block, logit lens, kernels."""
    from mismatch.checkpoint import checkpoint_info
    from mismatch.localize import check_localizable, localize_models
    from mismatch.replay import plan_replay
    from mismatch.results import atomic_write_text, json_safe
    from mismatch.rollouts import load_rollouts

    check_localizable(a, b, flag="layers")
    plan = plan_replay(load_rollouts(rollouts, vocab_size=checkpoint_info(checkpoint).vocab_size))
    with working(f"layers: replaying {a} and {b} with hooks on every layer", not as_json):
        found = localize_models(checkpoint, plan.requests, a=a, b=b, max_tokens=max_tokens)
    if out is not None:
        atomic_write_text(out, json.dumps(json_safe(found), indent=1) + "\n")
    if as_json:
        _emit_json(found)
        return
    print_layers(found)


def print_layers(found: dict[str, Any]) -> None:
    found_layers = found["layers"]
    if "skipped" in found_layers:
        out_console.print(f"layers: skipped: {found_layers['skipped']}", markup=False)
    else:
        table = _table(title="relative error of a vs b (reference) by layer and sub-block",
                      title_justify="left")
        for column in ("layer", "block", "rel_error", "local_rel_error", "logit_lens |Δlogp|"):
            table.add_column(column, justify="left" if column == "block" else "right")
        for row in found_layers["by_layer"]:
            table.add_row(str(row["layer"]), row["block"], _fmt(row.get("rel_error")),
                          _fmt(row.get("local_rel_error")), _fmt(row.get("logit_lens_abs_diff")))
        out_console.print(table)
        out_console.print(f"jump: layer {found_layers['jump_layer']} {found_layers['jump_block']}",
                          markup=False)
    kernels = found["kernels"]
    if "skipped" in kernels:
        out_console.print(f"kernels: skipped: {kernels['skipped']}", markup=False)
        return
    table = _table(title="error introduced by each module type (module-local)", title_justify="left")
    for column in ("type", "rel_error", "max_abs"):
        table.add_column(column, justify="left" if column == "type" else "right")
    for row in kernels["by_type"]:
        table.add_row(row["type"], _fmt(row.get("rel_error")), _fmt(row.get("max_abs")))
    out_console.print(table)


@app.command()
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
    payload = report.to_dict()
    if as_json:
        _emit_json(payload)
    else:
        print_weights(payload)
    if fail_on_diff and not report.identical:
        raise typer.Exit(1)


def print_weights(payload: dict[str, Any]) -> None:
    differing = [t for t in payload["tensors"] if not t.get("equal")]
    for tensor in differing:
        out_console.print(
            f"{tensor['name']}: {tensor.get('dtype_a')} {tensor.get('shape_a')} vs {tensor.get('dtype_b')} "
            f"{tensor.get('shape_b')}: max abs {_fmt(tensor.get('max_abs_diff'))}, max rel "
            f"{_fmt(tensor.get('max_rel_diff'))}, bitwise equal {_fmt(tensor.get('bitwise_equal_frac'))}",
            markup=False, highlight=False, soft_wrap=True)
    for side in ("only_a", "only_b"):
        for name in payload.get(side) or []:
            out_console.print(f"{name}: {side.replace('_', ' in ')}", markup=False)
    total = len(payload["tensors"])
    out_console.print(f"{total - len(differing)}/{total} shared tensors bitwise equal", markup=False)
    out_console.print(payload["summary"]["verdict"], markup=False, highlight=False, soft_wrap=True)


@app.command()
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
        _emit_json(found)
        return
    for span in found["spans"]:
        out_console.print(describe_span(span), markup=False, highlight=False, soft_wrap=True)
    out_console.print(f"{len(found['spans'])} drifted span(s)", markup=False)


@app.command()
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
    out_console.print(f"wrote {done.num_rollouts} rollouts ({done.num_requests} recorded requests, "
                      f"{done.num_unrecorded} not recorded) to {done.out}", markup=False, highlight=False,
                      soft_wrap=True)


@app.command(name="import")
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
        _emit_json({"out": str(out), "num_rollouts": count})
        return
    out_console.print(f"wrote {count} rollouts to {out}", markup=False)


@app.command()
def validate(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Rollouts file (.jsonl or .parquet).")],
    checkpoint: Annotated[Optional[Path], typer.Option(help="Check token ids against this vocab (and expert ids against its experts).")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Check token ids against this size.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Check a rollouts file against format v1 and report every problem (exit 2 if any)."""
    from mismatch.checkpoint import checkpoint_info
    from mismatch.rollouts import validate_file

    num_experts = None  # with a checkpoint, routed_experts ids are checked against its experts too
    if checkpoint is not None:
        info = checkpoint_info(checkpoint)
        vocab_size, num_experts = info.vocab_size, info.num_experts
    report = validate_file(file, vocab_size=vocab_size, num_experts=num_experts)
    if as_json:
        _emit_json({"num_rollouts": report.num_rollouts, "num_branches": report.num_branches,
                    "num_invalid": report.num_invalid, "num_tokens": report.num_tokens, "num_trainable_tokens": report.num_trainable_tokens,
                    "errors": [str(e) for e in report.errors], "truncated": report.truncated})
    else:
        for error in report.errors:
            err_console.print(str(error), markup=False, highlight=False, soft_wrap=True)
        total = report.num_rollouts + report.num_invalid
        status = "ok" if not report.errors else f"{len(report.errors)} error(s) in {report.num_invalid}"
        out_console.print(f"{file}: {total} rollouts, {status}; valid ones hold {report.num_branches} "
                          f"branches, {report.num_tokens:,} tokens ({report.num_trainable_tokens:,} "
                          "trainable)", markup=False, highlight=False, soft_wrap=True)
    if report.errors:
        raise typer.Exit(2)


@app.command()
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
        _emit_json(result.summary)
        return
    print_pairs(result.summary)
    out_console.print(f"wrote {result.out}/")
    out_console.print(f"report: {result.out / 'index.html'}  (open it in a browser)", markup=False,
                      highlight=False, soft_wrap=True)
    out_console.print("next:", markup=False)
    for command in (f"mismatch recommend {result.out} --for verl   # the fix, as a config to paste",
                    f"mismatch gate {result.out} --max kl_k3=1e-3   # the CI check (exit 1 past it)"):
        out_console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)


def _quiet_transformers() -> None:
    """Our progress bars replace transformers' per-load bars and vLLM's INFO/WARNING chatter
    (dozens of lines per engine start) in the CLI; a value the user set wins.

    Environment, not `transformers.utils.logging.disable_progress_bar()`: transformers reads
    HF_HUB_DISABLE_PROGRESS_BARS when it is imported, and importing it here would cost every
    command (`--help` included) a second and a half."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM then logs through its "vllm" logger without a handler of its own (dependency_log gives
    # it one); it would otherwise write to stdout.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import logging

    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    if "transformers" in sys.modules:  # too late for the environment (a caller imported it first)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: the error boundary."""
    global _json_stdout
    debug = os.environ.get("MISMATCH_DEBUG") == "1"
    _quiet_transformers()
    args = sys.argv[1:] if argv is None else argv
    saved = sys.stdout
    if "--json" in args:
        _json_stdout, sys.stdout = saved, sys.stderr
    try:
        code = app(args=argv, prog_name="mismatch", standalone_mode=False)
    except MismatchError as exc:
        if debug:
            raise
        err_console.print(f"mismatch: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except typer.TyperException as exc:  # usage errors: missing option, bad value, unknown command
        message = getattr(exc, "format_message", exc.__str__)()
        if message.startswith("Usage:"):  # bare `mismatch`: its help is the message, not an error
            sys.stderr.write(message.rstrip("\n") + "\n")
        elif message:
            err_console.print(f"mismatch: error: {message}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except typer.Abort:
        err_console.print("mismatch: aborted", markup=False)
        return 130
    finally:
        sys.stdout, _json_stdout = saved, None
    return code if isinstance(code, int) else 0


def run() -> None:
    """The console script: a process of its own, set up as a batch job (mismatch/batch.py)."""
    from mismatch.batch import end_batch, tune_for_batch

    tune_for_batch()
    code = main()
    end_batch()
    sys.exit(code)
