"""summary.json as JSON: `json_safe` (no NaN: it must parse in a browser), the strict reader
(decoding into the typed `Summary`), the writer, and the shipped JSON Schema
(`mismatch/data/summary.schema.json`, generated from the model) it is checked by.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import msgspec

from mismatch.errors import ResultsError
from mismatch.results.names import SCHEMA_FILE, SUMMARY_FILE, SUMMARY_SCHEMA
from mismatch.results.summary_model import Summary, encode, partial_summary

_PLAIN = frozenset({int, str, bool, type(None)})  # JSON as they are


def json_safe(value: Any) -> Any:
    """NaN and ±inf become null: summary.json must parse in a browser (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        # Plain items and finite floats kept without a call each: a report's token columns are
        # lists of 10^5 numbers.
        return [v if type(v) in _PLAIN or (type(v) is float and math.isfinite(v)) else json_safe(v)
                for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return json_safe(value.item())
    return value


def write_summary(directory: Path, summary: Summary) -> None:
    (directory / SUMMARY_FILE).write_text(encode(summary))


def load_json(file: Path) -> Any:
    """A JSON file as summary.json is written: strict (a literal NaN or Infinity was put there by
    hand), and any way it fails to parse is one ResultsError naming the file."""
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a value summary.json holds (it writes null)")

    try:
        return json.loads(Path(file).read_bytes(), parse_constant=no_constant)
    except RecursionError:
        raise ResultsError(f"{file}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, no_constant, a huge integer
        raise ResultsError(f"{file}: not valid JSON ({' '.join(str(exc).split())[:200]})") from None


def read_summary(path: Path) -> Summary:
    """summary.json of results dir `path`, as the typed `Summary` (results/summary_model.py)."""
    path = Path(path)
    if not path.is_dir():
        raise ResultsError(f"{path}: not a directory (give the results dir an audit, diff or merge wrote)")
    file = path / SUMMARY_FILE
    if not file.is_file():
        raise ResultsError(f"{path}: no {SUMMARY_FILE}: not a mismatch results dir")
    summary = load_json(file)
    if not isinstance(summary, dict) or summary.get("schema") != SUMMARY_SCHEMA:
        raise ResultsError(f"{file}: schema is not {SUMMARY_SCHEMA!r}")
    if not isinstance(summary.get("pairs"), dict):
        raise ResultsError(f"{file}: no 'pairs' object")
    # Decoded by the model, so that no reader (report, recommend, trend, merge) meets a `verdicts`
    # that is a number or a `diagnosis` that is a string as a traceback: one line naming the path
    # of the first field that breaks it. A section or a pair metric missing reads as empty / null
    # (a hand-made or older summary may lack `turns` or a metric added since); a field of the
    # wrong shape is refused here.
    try:
        return partial_summary(summary)
    except msgspec.ValidationError as error:
        # msgspec's path elides a map's keys ($.pairs[...]); the generated schema's check of the
        # same data names them (pairs/train/sampler).
        problems = validate_summary(summary, missing_keys=False)
        detail = problems[0] if problems else str(error)
        raise ResultsError(f"{file}: not a summary.json a run writes ({' '.join(detail.split())[:200]})") from None


@functools.cache
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(summary_schema())


def summary_schema() -> dict[str, Any]:
    """The JSON Schema of summary.json (draft 2020-12), shipped in the package."""
    return json.loads(SCHEMA_FILE.read_text())


def validate_summary(summary: dict[str, Any], *, missing_keys: bool = True) -> list[str]:
    """Where `summary` breaks the schema, one line each (empty: it conforms). `missing_keys` False:
    a required key missing is not reported (hand-made and older summaries lack some, and readers
    take them as absent); the keys that are there are held to their shapes."""
    validator = _validator()
    errors = [error for error in validator.iter_errors(summary) if missing_keys or error.validator != "required"]
    return [f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
            for error in sorted(errors, key=lambda e: list(map(str, e.absolute_path)))]
