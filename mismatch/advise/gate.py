"""CI gate: thresholds on a results dir's pair metrics and drift against a baseline, as pass/fail checks.

Flow: results dir (summary.json) -> run_gate -> GateResult -> exit code (0 pass, 1 fail) + table / JSON / JUnit.
"""

from __future__ import annotations

import errno
import math
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from mismatch.results.summary_model import JSONObject
from mismatch.analysis.metrics import PAIR_METRICS
from mismatch.analysis.terms import METRIC_RANGES
from mismatch.advise.consistency import check_summary, in_range
from mismatch.errors import EnvironmentFault, MismatchError, ResultsError
from mismatch.results import SUMMARY_FILE, SUMMARY_SCHEMA, atomic_write_text, load_json

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

# Fails closed: an unknown schema, a pair with no tokens, a missing or NaN metric is a failed check, never
# a pass. Bad input (an unknown metric, a malformed threshold) is a MismatchError: exit 2 at the CLI.
DEFAULT_PAIR = "train/sampler"
# Drift is measured in the direction that is worse; metrics in neither set drift both ways.
HIGHER_IS_WORSE = frozenset({"log_ratio_abs_mean", "log_ratio_abs_max", "ratio_std", "ratio_max", "ratio_q99",
                             "ratio_q999", "kl_k2", "kl_k3", "chi2_token", "chi2_seq", "prob_abs_diff_mean",
                             "prob_abs_diff_max", "frac_outside_2"})
HIGHER_IS_BETTER = frozenset({"ess", "bitwise_equal_frac", "ratio_min", "ratio_q001", "ratio_q01"})
# The quantiles' names before they were ratio_qXYZ: thresholds written with them keep working.
RENAMED = {"ratio_p01": "ratio_q01", "ratio_p99": "ratio_q99", "ratio_p999": "ratio_q999"}
# Compared against a baseline even when no threshold names them: the headline gap metrics.
DRIFT_METRICS = tuple(f"{DEFAULT_PAIR}.{m}" for m in ("kl_k3", "log_ratio_abs_mean", "chi2_token", "frac_outside_2"))
# `dist.NAME`: summary.json `distribution[A/B][NAME]` (--distribution; docs/distribution.md), by default
# of the audit's one engine pair. `dist.kl` is the mean KL(A||B) of the whole next-token distribution.
DIST = "dist."
DIST_PAIR = "train/infer"
DIST_RANGES = {"kl": (0.0, math.inf), "kl_ab_mean": (0.0, math.inf), "kl_ba_mean": (0.0, math.inf),
               "kl_ab_max": (0.0, math.inf), "tv_mean": (0.0, 1.0), "tv_max": (0.0, 1.0),
               "topk_overlap_mean": (0.0, 1.0), "argmax_agree_frac": (0.0, 1.0), "rank_differs_frac": (0.0, 1.0)}
HIGHER_IS_WORSE = HIGHER_IS_WORSE | {DIST + name for name in DIST_RANGES
                                     if name not in ("topk_overlap_mean", "argmax_agree_frac")}
HIGHER_IS_BETTER = HIGHER_IS_BETTER | {DIST + "topk_overlap_mean", DIST + "argmax_agree_frac"}


def split_key(key: str) -> tuple[str, str]:
    """ "A/B.metric" -> (A/B, metric); "A/B.dist.NAME" -> (A/B, dist.NAME)."""
    if "." + DIST in key:
        pair, _, name = key.partition("." + DIST)
        return pair, DIST + name
    pair, _, metric = key.rpartition(".")
    return pair, metric


@dataclass(kw_only=True, slots=True, frozen=True)
class Check:
    """One gate check: `kind` is schema | tokens | max | min | drift."""

    kind: str
    name: str
    value: float | None
    limit: float | None
    passed: bool
    message: str

    def to_dict(self) -> JSONObject:
        return {"kind": self.kind, "name": self.name, "value": self.value, "limit": self.limit,
                "passed": self.passed, "message": self.message}


@dataclass(kw_only=True, slots=True, frozen=True)
class GateResult:
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(check for check in self.checks if not check.passed)

    def to_dict(self) -> JSONObject:
        return {"passed": self.passed, "num_checks": len(self.checks), "num_failed": len(self.failures),
                "checks": [check.to_dict() for check in self.checks]}


@dataclass(kw_only=True, slots=True, frozen=True)
class Thresholds:
    """Limits keyed "A/B.metric"; what a TOML file or --max flags give."""

    maxima: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)
    max_drift_pct: float | None = None


def threshold_key(key: str, *, where: str) -> str:
    """ "kl_k3" -> "train/sampler.kl_k3"; "train/infer.kl_k3" stays; "dist.kl" ->
    "train/infer.dist.kl"; anything else is a MismatchError."""
    if key.startswith(DIST) or "." + DIST in key:
        pair, _, name = key.partition(DIST)
        pair = pair.removesuffix(".") or DIST_PAIR
        if name not in DIST_RANGES:
            raise MismatchError(f"{where}: unknown distribution metric {name!r} (valid: "
                                f"{', '.join(DIST + n for n in DIST_RANGES)})")
        sides = pair.split("/")
        if len(sides) != 2 or not all(sides):
            raise MismatchError(f"{where}: pair {pair!r} is not A/B (e.g. train/infer)")
        return f"{pair}.{DIST}{name}"
    pair, _, metric = key.rpartition(".")
    pair = pair or DEFAULT_PAIR
    metric = RENAMED.get(metric, metric)
    if metric not in PAIR_METRICS:
        raise MismatchError(f"{where}: unknown metric {metric!r} (valid: {', '.join(PAIR_METRICS)})")
    sides = pair.split("/")
    if len(sides) != 2 or not all(sides):
        raise MismatchError(f"{where}: pair {pair!r} is not A/B (e.g. train/sampler)")
    return f"{pair}.{metric}"


def _limit(value: Any, *, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise MismatchError(f"{where}: limit {value!r} is not a number")
    try:
        limit = float(value)
    except ValueError:
        raise MismatchError(f"{where}: limit {value!r} is not a number") from None
    if math.isnan(limit):
        raise MismatchError(f"{where}: limit is NaN")
    return limit


def parse_limits(items: Iterable[str], *, flag: str = "--max") -> dict[str, float]:
    """`--max METRIC=VALUE` (or A/B.METRIC=VALUE) flags -> {"A/B.metric": limit}."""
    limits = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise MismatchError(f"{flag} {item!r}: expected METRIC=VALUE, e.g. kl_k3=1e-3")
        where = f"{flag} {item}"
        full_key, limit = threshold_key(key.strip(), where=where), _limit(value.strip(), where=where)
        if full_key in limits and limits[full_key] != limit:
            raise MismatchError(f"{flag} {full_key}: given twice ({limits[full_key]!r} and {limit!r}); keep one")
        limits[full_key] = limit
    return limits


def combined_limits(from_file: dict[str, float], from_flags: dict[str, float], *, bound: str,
                    file: str | Path | None) -> dict[str, float]:
    """A thresholds file's limits and the flags' together; one metric limited twice, differently, is
    refused (which one a user meant cannot be guessed; the looser would pass what the other fails)."""
    for key, limit in from_flags.items():
        if key in from_file and from_file[key] != limit:
            raise MismatchError(f"--{bound} {key}={limit!r} conflicts with {file}'s [{bound}] "
                                f"{key} = {from_file[key]!r}; keep one")
    return {**from_file, **from_flags}


def load_thresholds(path: str | Path) -> Thresholds:
    """A thresholds TOML: optional `max_drift_pct`, tables [max] and [min] of METRIC or "A/B.METRIC" = limit,
    or per pair as [max."A/B"] tables."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise MismatchError(f"{path}: no such thresholds file") from None
    except tomllib.TOMLDecodeError as exc:
        raise MismatchError(f"{path}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - {"max", "min", "max_drift_pct"})
    if unknown:
        raise MismatchError(f"{path}: unknown key {unknown[0]!r} (valid: max, min, max_drift_pct)")
    tables = {}
    for bound in ("max", "min"):
        table = data.get(bound, {})
        if not isinstance(table, dict):
            raise MismatchError(f"{path}: {bound} must be a table of METRIC = limit")
        tables[bound] = {}
        for key, value in table.items():
            entries = ({f"{key}.{metric}": v for metric, v in value.items()} if isinstance(value, dict)
                       else {key: value})
            for full_key, limit in entries.items():
                where = f"{path}: [{bound}] {full_key}"
                tables[bound][threshold_key(full_key, where=where)] = _limit(limit, where=where)
    drift = data.get("max_drift_pct")
    return Thresholds(maxima=tables["max"], minima=tables["min"],
                      max_drift_pct=None if drift is None else _limit(drift, where=f"{path}: max_drift_pct"))


def summary_file(path: str | Path) -> Path:
    """summary.json of a results dir, or the file itself."""
    path = Path(path)
    return path / SUMMARY_FILE if path.is_dir() else path


def load_summary(path: str | Path) -> JSONObject:
    """summary.json of a results dir (or the file itself), refused (ResultsError, naming the file)
    where no run can have written it (check_summary), or where the dir's tables are not the ones it
    recorded (results.verify; a CI artifact of summary.json alone is gated on its own). Its schema
    is checked by the gate, not here."""
    from mismatch.results.verify import RecordedTables, check_tables

    file = summary_file(path)
    if not file.is_file():
        raise ResultsError(f"{path}: no {SUMMARY_FILE} (not a mismatch results dir)")
    summary = load_json(file)
    if not isinstance(summary, dict):
        raise ResultsError(f"{file}: not a JSON object")
    check_summary(summary, where=str(file))
    if Path(path).is_dir():
        try:
            recorded = msgspec.convert(summary, RecordedTables, strict=False)
        except msgspec.ValidationError as error:  # a hand-edited shard or counts: the field it breaks
            raise ResultsError(f"{file}: {error}") from None
        check_tables(Path(path), recorded, required=())
    return summary


def check_possible(summary: JSONObject, keys: Iterable[str], *, label: str) -> None:
    """Refuse (exit 2) a gated value no measurement can have (the API's summaries; a file's are
    check_summary's at load_summary): it must not pass a gate, nor fail it as a measured regression."""
    for key in keys:
        value, problem = _value(summary, key)
        if problem is not None:
            continue  # missing or NaN: the check itself reports it
        metric = split_key(key)[1]
        low, high = DIST_RANGES[metric.removeprefix(DIST)] if metric.startswith(DIST) else METRIC_RANGES[metric]
        if not (math.isfinite(value) and in_range(value, low, high)):
            raise MismatchError(f"{label}: {key} = {value!r} is impossible ({metric} lies "
                                f"in [{low:g}, {high:g}]): its summary.json was edited or corrupted")


def _value(summary: JSONObject, key: str) -> tuple[float | None, str | None]:
    """(value, None) or (None, why it is unusable) for "A/B.metric"; NaN is stored as null in summary.json."""
    pair, metric = split_key(key)
    if metric.startswith(DIST):
        return _dist_value(summary, pair, metric.removeprefix(DIST))
    pairs = summary.get("pairs") if isinstance(summary.get("pairs"), dict) else {}
    if pair not in pairs:
        return None, f"no pair {pair!r} (pairs: {', '.join(pairs) or 'none'})"
    if not isinstance(pairs[pair], dict):
        return None, f"pair {pair!r} is not an object"
    if metric not in pairs[pair]:
        return None, f"metric {metric!r} missing"
    value = pairs[pair][metric]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, "NaN"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"not a number: {value!r}"
    try:
        return float(value), None
    except OverflowError:  # an integer past float64
        return None, f"not a number: {value!r}"


def _dist_value(summary: JSONObject, pair: str, name: str) -> tuple[float | None, str | None]:
    found = summary.get("distribution") if isinstance(summary.get("distribution"), dict) else {}
    if pair not in found or not isinstance(found[pair], dict):
        return None, (f"no distribution of pair {pair!r} (measured with --distribution K; "
                      f"pairs: {', '.join(found) or 'none'})")
    value = found[pair].get(name)
    if value is None:
        return None, f"distribution {name!r} missing or NaN"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"not a number: {value!r}"
    return float(value), None


def _schema_check(summary: JSONObject, *, label: str) -> Check:
    schema = summary.get("schema")
    ok = schema == SUMMARY_SCHEMA
    return Check(kind="schema", name=f"{label} schema", value=None, limit=None, passed=ok,
                 message=f"{label} schema {schema!r}" + ("" if ok else f" is not {SUMMARY_SCHEMA!r}"))


def _tokens_check(summary: JSONObject, pair: str, *, label: str) -> Check:
    value, problem = _value(summary, f"{pair}.n_tokens")
    ok = problem is None and value > 0
    message = (f"{label} {pair}: {problem}" if problem else
               f"{label} {pair}: {int(value):,} tokens" + ("" if ok else " (nothing was measured)"))
    return Check(kind="tokens", name=f"{label} {pair} tokens", value=value, limit=None, passed=ok, message=message)


def _bound_check(summary: JSONObject, key: str, limit: float, bound: str) -> Check:
    value, problem = _value(summary, key)
    if problem is not None:
        return Check(kind=bound, name=key, value=None, limit=limit, passed=False,
                     message=f"{key}: {problem} ({bound} {limit!r})")
    ok = value <= limit if bound == "max" else value >= limit
    op = ("<=" if ok else ">") if bound == "max" else (">=" if ok else "<")
    return Check(kind=bound, name=key, value=value, limit=limit, passed=ok,
                 message=f"{key} = {_shown(value, limit)} {op} {bound} {_shown(limit, value)}")


def _shown(number: float, other: float) -> str:
    """6 significant digits, or every digit where 6 would make `number` read like `other` (a
    failure must never print "1.066 > max 1.066")."""
    short = f"{number:.6g}"
    return short if number == other or short != f"{other:.6g}" else repr(number)


def drift_pct(value: float, base: float, metric: str) -> float:
    """Relative change from the baseline in %, in the worse direction (improvement counts as 0)."""
    change = value - base
    if metric in HIGHER_IS_BETTER:
        change = -change
    elif metric not in HIGHER_IS_WORSE:
        change = abs(change)
    if change <= 0:
        return 0.0
    return math.inf if base == 0 else 100.0 * change / abs(base)


def _drift_check(summary: JSONObject, baseline: JSONObject, key: str, max_pct: float) -> Check:
    value, problem = _value(summary, key)
    base, base_problem = _value(baseline, key)
    name = f"{key} drift"
    if problem or base_problem:
        why = f"{problem}" if problem else f"baseline {base_problem}"
        return Check(kind="drift", name=name, value=None, limit=max_pct, passed=False,
                     message=f"{key}: {why} (max drift {max_pct!r}%)")
    pct = drift_pct(value, base, split_key(key)[1])
    ok = pct <= max_pct
    return Check(kind="drift", name=name, value=pct, limit=max_pct, passed=ok,
                 message=f"{key} = {_shown(value, base)} vs baseline {_shown(base, value)}: "
                         f"{_shown(pct, max_pct)}% worse ({'<=' if ok else '>'} {_shown(max_pct, pct)}%)")


def run_gate(summary: JSONObject, *, maxima: dict[str, float] | None = None,
             minima: dict[str, float] | None = None, baseline: JSONObject | None = None,
             max_drift_pct: float | None = None, drift_metrics: Iterable[str] | None = None) -> GateResult:
    """Every check on `summary`: its schema, each gated pair having tokens, each max / min, each drift.

    Keys are "A/B.metric" (see parse_limits / threshold_key). With a baseline summary, each of
    `drift_metrics` (default: the gated metrics plus DRIFT_METRICS) may be at most `max_drift_pct` %
    worse than in the baseline.
    """
    # Keys from the API get the same validation and "kl_k3" -> "train/sampler.kl_k3" as flags.
    maxima = {threshold_key(key, where="gate max"): limit for key, limit in (maxima or {}).items()}
    minima = {threshold_key(key, where="gate min"): limit for key, limit in (minima or {}).items()}
    if drift_metrics is not None:
        drift_metrics = [threshold_key(key, where="gate drift") for key in drift_metrics]
    if (baseline is None) != (max_drift_pct is None):
        raise MismatchError("--baseline DIR and --max-drift PCT go together")
    if max_drift_pct is not None and not (max_drift_pct >= 0):
        raise MismatchError(f"--max-drift {max_drift_pct}: must be a percentage >= 0")
    for key in maxima.keys() & minima.keys():
        if minima[key] > maxima[key]:
            raise MismatchError(f"gate: {key} must be >= {minima[key]!r} and <= {maxima[key]!r}: no value can pass")
    if not maxima and not minima and baseline is None:
        raise MismatchError("nothing to gate: give --max METRIC=VALUE, a thresholds file, or "
                            "--baseline DIR with --max-drift PCT")
    drift_keys = list(dict.fromkeys(drift_metrics if drift_metrics is not None
                                    else [*maxima, *minima, *DRIFT_METRICS])) if baseline is not None else []
    pairs = dict.fromkeys(split_key(key)[0] for key in [*maxima, *minima, *drift_keys])
    # A pair the results do not have is a typo in the thresholds (exit 2), not a failed gate (exit 1).
    for label, measured in (("results", summary), ("baseline", baseline)):
        available = (measured or {}).get("pairs") if isinstance((measured or {}).get("pairs"), dict) else {}
        missing = [pair for pair in pairs if measured is not None and available and pair not in available]
        if missing:
            raise MismatchError(f"gate: the {label} have no pair {missing[0]!r} (pairs: {', '.join(available)})")
    check_possible(summary, [*maxima, *minima, *drift_keys], label="results")
    if baseline is not None:
        check_possible(baseline, drift_keys, label="baseline")
    checks = [_schema_check(summary, label="results")]
    checks += [_tokens_check(summary, pair, label="results") for pair in pairs]
    checks += [_bound_check(summary, key, limit, "max") for key, limit in maxima.items()]
    checks += [_bound_check(summary, key, limit, "min") for key, limit in minima.items()]
    if baseline is not None:
        checks.append(_schema_check(baseline, label="baseline"))
        checks += [_tokens_check(baseline, pair, label="baseline")
                   for pair in dict.fromkeys(split_key(key)[0] for key in drift_keys)]
        checks += [_drift_check(summary, baseline, key, max_drift_pct) for key in drift_keys]
    return GateResult(checks=tuple(checks))


def format_table(result: GateResult) -> str:
    """Plain text, one check a line, then the verdict."""
    lines = [f"{'PASS' if check.passed else 'FAIL'}  {check.message}" for check in result.checks]
    lines.append(f"gate {'passed' if result.passed else 'FAILED'}: {len(result.checks) - len(result.failures)}"
                 f"/{len(result.checks)} checks passed")
    return "\n".join(lines)


def github_annotations(result: GateResult) -> list[str]:
    """`::error` workflow commands for the failed checks (print them when GITHUB_ACTIONS=true)."""
    def escape(text: str) -> str:  # GitHub's workflow-command escaping for the message part
        return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return [f"::error title=mismatch gate::{escape(check.message)}" for check in result.failures]


def junit_xml(result: GateResult, *, suite: str = "mismatch gate") -> str:
    """JUnit XML: one testsuite, one testcase per check, a <failure> for each failed one."""
    counts = {"tests": str(len(result.checks)), "failures": str(len(result.failures)), "errors": "0",
              "skipped": "0"}
    root = ET.Element("testsuites", {"name": suite, **counts})
    suite_el = ET.SubElement(root, "testsuite", {"name": suite, **counts})
    for check in result.checks:
        case = ET.SubElement(suite_el, "testcase", {"classname": f"mismatch.advise.gate.{check.kind}",
                                                    "name": check.name, "time": "0"})
        if check.passed:
            ET.SubElement(case, "system-out").text = check.message
        else:
            ET.SubElement(case, "failure", {"message": check.message, "type": check.kind}).text = check.message
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def check_junit_path(path: str | Path) -> None:
    """Refuse, before any check runs, a --junit PATH that cannot be written: a gate whose checks all
    passed must not end in a traceback (exit 1 reads as "the gate failed")."""
    path = Path(path)
    if path.is_dir():
        raise MismatchError(f"--junit {path}: cannot be written (a directory)")
    existing = path.parent
    while not existing.exists():  # the folders write_junit will create
        existing = existing.parent
    if not existing.is_dir():
        raise MismatchError(f"--junit {path}: cannot be written ({existing} is not a directory)")
    try:  # a real file, not permission bits: root, ACLs and read-only mounts answer alike
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise MismatchError(f"--junit {path}: cannot be written ({exc.strerror or exc} in {existing})") from None


def write_junit(result: GateResult, path: str | Path) -> Path:
    """Write junit_xml(result) atomically (temp file + rename); a disk that fails it meanwhile is
    the machine's fault (exit 3), anything else that path's (exit 2)."""
    path = Path(path)
    try:
        atomic_write_text(path, junit_xml(result))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise EnvironmentFault(f"--junit {path}: {exc.strerror}") from None
        raise MismatchError(f"--junit {path}: cannot be written ({exc.strerror or exc})") from None
    return path
