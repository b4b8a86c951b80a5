"""Importers: other RL frameworks' rollout dumps (token ids, masks, sampler log-probs) → format v1.

First step of the flow for users of verl, prime-rl, SkyRL, verifiers or slime: `import_file` reads the
dump, converts each record with its framework's module, validates every rollout, writes JSONL.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mismatch.errors import MismatchError
from mismatch.rollouts.importers._common import ImportFormatError, Where
from mismatch.rollouts.importers.steps import dump_files, file_step

# Format name -> module with `convert(record, where) -> list[rollout dict]`; framework specifics
# live in those modules only.
FORMATS: dict[str, str] = {
    "verl": "mismatch.rollouts.importers.verl",
    "prime-rl": "mismatch.rollouts.importers.prime_rl",
    "skyrl": "mismatch.rollouts.importers.skyrl",
    "verifiers": "mismatch.rollouts.importers.verifiers",
    "slime": "mismatch.rollouts.importers.slime",
}
JSONL_SUFFIXES = (".jsonl", ".ndjson")
MSGPACK_SUFFIXES = (".bin", ".msgpack", ".mpk")
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth")  # torch.save files are pickles too
KNOWN_SUFFIXES = frozenset({".json", ".parquet", *JSONL_SUFFIXES, *MSGPACK_SUFFIXES, *PICKLE_SUFFIXES})

Converter = Callable[[Any, Where], list[dict[str, Any]]]


def converter(format_name: str) -> Converter:
    if format_name not in FORMATS:
        raise MismatchError(f"unknown import format {format_name!r} (known: {', '.join(FORMATS)})")
    return importlib.import_module(FORMATS[format_name]).convert


def import_file(format_name: str, path: str | os.PathLike[str], out_path: str | os.PathLike[str], *,
                allow_pickle: bool = False) -> int:
    """Convert `path` (a `format_name` dump file, or a directory of per-step dump files) to format v1
    JSON Lines at `out_path`; returns the count.

    A step named by a file or its folder (`12.jsonl`, `step_12/rank_0.bin`, `global_step_12_...`)
    becomes meta.step of its rollouts unless the dump carries its own. From a directory, every
    rollout id is prefixed with its file's relative name (`step_12/rank_0/...`): the frameworks
    number rollouts per file. Every rollout is validated before anything is written, and the file
    appears in one rename. Pickle files (.pkl, .pickle, .pt, .pth) are refused unless
    `allow_pickle`: unpickling runs code from the file.
    """
    from mismatch.results import atomic_write_text, file_fault

    convert = converter(format_name)
    root = Path(os.fspath(path))
    if root.is_dir():
        files: list[tuple[Path, str | None, int | None]] = list(dump_files(root, KNOWN_SUFFIXES))
        if not files:
            raise MismatchError(f"{root}: no dump files in this directory (known suffixes: "
                                f"{', '.join(sorted(KNOWN_SUFFIXES))})")
    else:
        files = [(root, None, file_step(root))]
    lines: list[str] = []
    first_seen: dict[str, str] = {}
    for file, name, step in files:
        for where, raw in _converted(convert, file, allow_pickle=allow_pickle, name=name, step=step):
            if raw["id"] in first_seen:
                raise where.error("id", f"rollout id {raw['id']!r} already made from {first_seen[raw['id']]}")
            first_seen[raw["id"]] = where.text
            lines.append(json.dumps(raw, separators=(",", ":")))
    if not lines:
        raise MismatchError(f"{os.fspath(path)}: no rollouts found in this {format_name} "
                            f"{'directory' if root.is_dir() else 'file'}")
    try:
        atomic_write_text(Path(out_path), "\n".join(lines) + "\n")
    except OSError as error:  # a full disk is the machine's (exit 3); a directory or /proc, the path's (exit 2)
        raise file_fault(error, os.fspath(out_path)) from None
    return len(lines)


def _converted(convert: Converter, file: Path, *, allow_pickle: bool, name: str | None,
               step: int | None) -> Iterator[tuple[Where, dict[str, Any]]]:
    """Each validated rollout of one dump file, its id prefixed with `name` and tagged with `step`."""
    from mismatch.rollouts import check_rollout

    for where, record in read_records(file, allow_pickle=allow_pickle):
        for raw in convert(record, where):
            if name is not None and isinstance(raw.get("id"), str):
                raw["id"] = f"{name}/{raw['id']}"
            if step is not None and isinstance(raw.get("meta"), dict):
                raw["meta"].setdefault("step", step)  # a step the dump itself carries wins
            _, errors = check_rollout(raw, file=where.file, line=where.line, vocab_size=None)
            if errors:
                raise errors[0]
            yield where, raw


def read_records(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> Iterator[tuple[Where, Any]]:
    """Each record of a dump with where it came from, by file suffix (plain data before pickles)."""
    file = os.fspath(path)
    p = Path(file)
    if not p.is_file():
        raise MismatchError(f"{file}: no such file")
    suffix = p.suffix.lower()
    if suffix in PICKLE_SUFFIXES and not allow_pickle:
        raise MismatchError(f"{file}: {suffix} files are pickles and unpickling runs code from the file; "
                            "export JSON Lines or Parquet instead, or pass --allow-pickle if you trust it")
    if suffix in JSONL_SUFFIXES:
        return _jsonl(p, file)
    if suffix == ".json":
        return _items(file, _load_json(p, file))
    if suffix == ".parquet":
        return _parquet(p, file)
    if suffix in MSGPACK_SUFFIXES:
        return _msgpack_records(p, file)
    if suffix in PICKLE_SUFFIXES:
        return _items(file, _plain(_unpickle(p, suffix)))
    known = ", ".join(sorted(KNOWN_SUFFIXES))
    raise MismatchError(f"{file}: cannot tell the file type from suffix {suffix or '(none)'!r} "
                        f"(known: {known})")


def _jsonl(path: Path, file: str) -> Iterator[tuple[Where, Any]]:
    with path.open("rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield Where(file=file, index=line_no, kind="line"), json.loads(line)
            except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ImportFormatError(f"invalid JSON: {e}", where=f"{file}:{line_no}") from None


def _load_json(path: Path, file: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ImportFormatError(f"invalid JSON: {e}", where=file) from None


def _items(file: str, value: Any) -> Iterator[tuple[Where, Any]]:
    """A top-level array is one record per item; anything else is one record."""
    items = value if isinstance(value, list) else [value]
    for index, item in enumerate(items):
        yield Where(file=file, index=index, kind="item"), item


def _parquet(path: Path, file: str) -> Iterator[tuple[Where, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except pa.ArrowInvalid as e:
        raise MismatchError(f"{file}: not a readable Parquet file: {e}") from None
    row_no = 0
    for batch in table.iter_batches(batch_size=256):
        for row in batch.to_pylist():
            row_no += 1
            yield Where(file=file, index=row_no, kind="line"), row


def _msgpack_records(path: Path, file: str) -> Iterator[tuple[Where, Any]]:
    """prime-rl's `train_rollouts.bin`: one msgspec-encoded TrainingBatch (decoded as plain
    arrays and maps; extension types are refused, nothing in the file is executed)."""
    import msgspec

    from mismatch.rollouts.problems import nesting as _nesting
    from mismatch.rollouts.rules import MAX_NESTING

    def refuse_extension(code: int, data: memoryview) -> Any:
        raise ValueError(f"extension type {code} is not supported")

    try:
        value = msgspec.msgpack.Decoder(ext_hook=refuse_extension).decode(path.read_bytes())
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise MismatchError(f"{file}: not a readable MessagePack file: {e}") from None
    if _nesting(value) > MAX_NESTING:  # the converters below walk it recursively
        raise MismatchError(f"{file}: not a readable MessagePack file: nested deeper than {MAX_NESTING} levels")
    yield Where(file=file, index=0, kind="item"), value


def _unpickle(path: Path, suffix: str) -> Any:
    # Only reached with allow_pickle: the user vouched for this file.
    if suffix in (".pt", ".pth"):
        import torch

        return torch.load(path, map_location="cpu", weights_only=False)
    with path.open("rb") as handle:
        return pickle.load(handle)  # noqa: S301 - explicit opt-in (--allow-pickle)


def _plain(value: Any) -> Any:
    """Tensors, arrays, pydantic models and verl's DataProto as plain lists and dicts."""
    if hasattr(value, "batch") and hasattr(value, "non_tensor_batch"):  # a verl DataProto
        columns = {key: value.batch[key] for key in value.batch.keys()} if value.batch is not None else {}
        return _plain({**columns, **dict(value.non_tensor_batch)})
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump())
    if hasattr(value, "tolist"):  # torch.Tensor, numpy arrays and scalars
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


__all__ = ["FORMATS", "ImportFormatError", "Where", "converter", "dump_files", "import_file", "read_records"]
