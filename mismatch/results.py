"""The results directory, the one contract between the commands, the report, gate and merge.

Its names (the files below), the schema of summary.json (`mismatch/data/summary.schema.json`,
checked by `validate_summary`), `json_safe`, the readers and the writers live here and nowhere
else; ARCHITECTURE.md, "Results dir", says what each file holds. Importing this module
loads numpy only (pandas and pyarrow when a table is read or written).

Everything is built in a hidden sibling temp dir and renamed into place at the end, so a crash or
a bad input never leaves a half-written results dir, and an existing dir is replaced only on request.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mismatch.errors import ResultsError

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

    from mismatch.analysis.chunked import ChunkSource

SUMMARY_SCHEMA = "mismatch.summary/v1"
SUMMARY_FILE = "summary.json"          # the numbers (schema: SCHEMA_FILE)
TOKENS_FILE = "tokens.parquet"         # one row per replayed token
ROLLOUTS_FILE = "rollouts.parquet"     # the pair metrics per rollout
REPORT_FILE = "index.html"             # the report (reports/)
DEPENDENCY_LOG = "dependencies.log"    # what the dependencies printed during the run
SCHEMA_FILE = Path(__file__).with_name("data") / "summary.schema.json"


def is_results_dir(path: Path) -> bool:
    summary = path / SUMMARY_FILE
    if not summary.is_file():
        return False
    try:
        return json.loads(summary.read_text()).get("schema") == SUMMARY_SCHEMA
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


@contextmanager
def results_lock(out: Path | None) -> Iterator[None]:
    """Hold OUT for one run from its first check to its publish (a no-op without OUT).

    A second run into the same OUT (or its work dir) exits 2 naming the first's pid and host,
    instead of mixing its blocks into the first's. Under the lock, whatever a killed run of this
    OUT left is ours to settle: a `--force` replace killed between its two renames is rolled
    back, and hidden stage, trash and temp files are removed.
    """
    if out is None:
        yield
        return
    import fcntl
    import socket

    out = Path(out)
    _writable_parent(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    while True:
        handle = lock_path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ResultsError(f"{out}: another mismatch run is writing it ({holder}); wait for it "
                               "to finish or choose another --out") from None
        # The file we locked may have been removed by the run that held it a moment ago.
        if lock_path.exists() and os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        _settle_leftovers(out)
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        handle.close()


def _writable_parent(out: Path) -> None:
    """Refuse an OUT whose directory cannot be written, before any work (not at the first block)."""
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ResultsError(f"{out}: cannot write in {existing} (permission denied or read-only)")
    if out.is_dir() and os.path.ismount(out) and not os.access(out, os.W_OK | os.X_OK):
        raise ResultsError(f"{out}: a mount point that cannot be written")


def _settle_leftovers(out: Path) -> None:
    """What killed runs of OUT left beside or inside it (called with OUT's lock held)."""
    parent = out.parent
    trashes = sorted(parent.glob(f".{glob_escape(out.name)}.old-*"))
    if not out.exists():
        for trash in trashes:  # killed between "old out -> trash" and "stage -> out": roll back
            if (trash / "old").is_dir():
                os.replace(trash / "old", out)
                break
    for leftover in [*trashes, *parent.glob(f".{glob_escape(out.name)}.tmp-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    for log in parent.glob(f".{glob_escape(out.name)}.*.log"):  # the CLI's pending dependency logs
        pid = log.name.removeprefix(f".{out.name}.").removesuffix(".log")
        if pid.isdigit() and not _alive(int(pid)):
            log.unlink(missing_ok=True)
    if out.is_dir():
        for leftover in [*out.glob(".index.html.tmp-*"), *out.glob(f"{STAGE_IN_PLACE}*")]:
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


def check_out_dir(out: Path, *, force: bool) -> None:
    """Refuse early (before any replay) to overwrite what the user has."""
    if out.exists() and not out.is_dir():
        raise ResultsError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ResultsError(f"{out}: already exists; pass --force to replace it")
    if force and out.is_dir() and any(out.iterdir()) and not is_results_dir(out):
        raise ResultsError(f"{out}: is not a mismatch results dir (no {SUMMARY_FILE}); "
                           "refusing to replace it even with --force")


# A results dir that is a mount point (a container volume: `-v …:/out --out /out`) cannot be
# renamed; its files are staged inside it under this prefix and moved in one by one.
STAGE_IN_PLACE = ".mismatch-stage-"


@contextmanager
def staged_dir(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `out` in one rename (file by file when
    `out` is a mount point), on error it vanishes."""
    check_out_dir(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    in_place = out.is_dir() and os.path.ismount(out)
    stage = Path(tempfile.mkdtemp(prefix=STAGE_IN_PLACE if in_place else f".{out.name}.tmp-",
                                  dir=out if in_place else out.parent))
    os.chmod(stage, 0o777 & ~_umask())  # mkdtemp makes 0700; the user expects a normal dir
    try:
        yield stage
        if in_place:
            _replace_contents(out, stage)
        elif out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "old")
            os.replace(stage, out)
            shutil.rmtree(trash)
        else:
            os.replace(stage, out)
    finally:
        if stage.exists():
            shutil.rmtree(stage)


def _replace_contents(out: Path, stage: Path) -> None:
    """The staged files into `out` one by one (each an atomic rename; summary.json last, so a
    reader that sees it sees the rest), after the previous results (checked by check_out_dir)."""
    for old in out.iterdir():
        if old != stage:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    names = sorted(path.name for path in stage.iterdir())
    for name in sorted(names, key=lambda name: name == SUMMARY_FILE):
        os.replace(stage / name, out / name)
    stage.rmdir()


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file via temp + rename so readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the user expects a normal file
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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


class Handoff:
    """A value handed on to be consumed once: the receiver `take`s it and the sender keeps no name
    for it, so it is freed as soon as the receiver is done (a token table of 10^8 rows must not
    stay in memory while the report reads tokens.parquet back)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    @property
    def value(self) -> Any:
        """The value, still the Handoff's (for a reader that runs before the receiver)."""
        return self._value

    def take(self) -> Any:
        value, self._value = self._value, None
        if value is None:
            raise RuntimeError("Handoff taken twice")
        return value


class TokenStore:
    """The token table of a run being analysed: tokens.parquet in the staged results dir, written
    block by block and read back in chunks of whole rollouts (`chunks`), or, without a results
    dir, the blocks in memory. Side files (`side_file`) are the analysis's scratch beside it,
    removed before the dir is published."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._writer = TokensWriter(directory / TOKENS_FILE) if directory is not None else None
        self._blocks: list[pd.DataFrame] = []
        self._table: pd.DataFrame | None = None
        self._side: list[Path] = []
        self.columns: list[str] = []
        self.num_rows = 0

    def write(self, block: pd.DataFrame) -> None:
        if not self.columns:
            self.columns = [str(name) for name in block.columns]
        self.num_rows += len(block)
        if self._writer is not None:
            self._writer.write(block)
        else:
            self._blocks.append(block)

    def close(self, empty: pd.DataFrame | None = None) -> None:
        if self._writer is not None:
            self._writer.close(empty=empty)
        if empty is not None and not self.columns:
            self.columns = [str(name) for name in empty.columns]

    @property
    def file(self) -> Path | None:
        """tokens.parquet, when the store is one."""
        return self.directory / TOKENS_FILE if self.directory is not None else None

    @property
    def table(self) -> pd.DataFrame:
        """The whole table (in memory: its blocks put together; on disk: read back)."""
        if self._table is None:
            from mismatch.replay import concat_tables

            self._table = (concat_tables(self._blocks) if self.directory is None
                           else read_tokens(self.directory))
            self._blocks = []
        return self._table

    @property
    def chunks(self) -> ChunkSource:
        from mismatch.analysis.chunked import table_chunks

        if self.directory is None:
            return table_chunks(self.table)
        return tokens_chunks([self.directory / TOKENS_FILE])

    def add_column(self, name: str, values: np.ndarray) -> None:
        """A column computed after the blocks were stored (aligned with the rows)."""
        if self.directory is None:
            self.table[name] = values
        else:
            file, offset = self.directory / TOKENS_FILE, 0
            writer = TokensWriter(self.directory / f".{TOKENS_FILE}.new")
            for chunk in tokens_chunks([file])():
                chunk[name] = values[offset:offset + len(chunk)]
                offset += len(chunk)
                writer.write(chunk)
            writer.close()
            os.replace(writer.file, file)
        self.columns.append(name)

    def side_file(self, name: str) -> Path | None:
        """A scratch file beside tokens.parquet (None without a results dir)."""
        if self.directory is None:
            return None
        path = self.directory / f".{name}.parquet"
        self._side.append(path)
        return path

    def remove_side_files(self) -> None:
        for path in self._side:
            path.unlink(missing_ok=True)


@contextmanager
def staged_tokens(out: Path | None, *, force: bool) -> Iterator[TokenStore]:
    """A TokenStore in the staged results dir, renamed into place when the block ends without an
    error (staged_dir); without `out`, one in memory."""
    if out is None:
        yield TokenStore(None)
        return
    with staged_dir(out, force=force) as stage:
        yield TokenStore(stage)


def write_results(out: Path, *, tokens: pd.DataFrame, summary: dict[str, Any], force: bool) -> Path:
    """A results dir of a token table in memory and its summary, staged and renamed into place."""
    with staged_dir(out, force=force) as stage:
        write_tokens(tokens, stage / TOKENS_FILE)
        write_summary(stage, summary)
    return out


def write_summary(directory: Path, summary: dict[str, Any]) -> None:
    (directory / SUMMARY_FILE).write_text(json.dumps(json_safe(summary), indent=1) + "\n")


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


def read_summary(path: Path) -> dict[str, Any]:
    """summary.json of results dir `path`, checked to be one (its schema name and pairs)."""
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
    return summary


def summary_schema() -> dict[str, Any]:
    """The JSON Schema of summary.json (draft 2020-12), shipped in the package."""
    return json.loads(SCHEMA_FILE.read_text())


def validate_summary(summary: dict[str, Any]) -> list[str]:
    """Where `summary` breaks the schema, one line each (empty: it conforms). Needs jsonschema."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(summary_schema())
    return [f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
            for error in sorted(validator.iter_errors(summary), key=lambda e: list(map(str, e.absolute_path)))]


# Rows per Parquet row group of tokens.parquet: one group for any table up to this size, so that a
# reader gets every column back as one array (write_tokens); a bigger table gets several.
TOKENS_ROW_GROUP = 64 * 2**20


def write_tokens(tokens: pd.DataFrame, file: Path) -> None:
    """tokens.parquet of a table in memory (diff, merge): missing log-probs stay NaN (the contract)
    rather than becoming Parquet nulls, and the rows are one row group (up to TOKENS_ROW_GROUP),
    so each column decodes into one Arrow buffer that pandas takes without a copy (read_tokens).
    An audit writes its blocks with TokensWriter instead."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(tokens, preserve_index=False)
    for index, field in enumerate(table.schema):
        if pa.types.is_floating(field.type) and table.column(index).null_count:
            values = pa.array(tokens[field.name].to_numpy(), type=field.type, from_pandas=False)
            table = table.set_column(index, field, values)
    pq.write_table(table, file, row_group_size=max(1, min(len(table), TOKENS_ROW_GROUP)), **parquet_layout(table.schema))


class TokensWriter:
    """tokens.parquet written a block of whole rollouts at a time, so no run holds its table whole.

    Blocks are gathered into row groups of about `group_rows` rows; a row group never cuts a
    rollout, so `tokens_chunks` reads back chunks of whole rollouts. Missing log-probs stay NaN,
    as write_tokens keeps them; categoricals are written as dictionaries of strings.
    """

    def __init__(self, file: Path, group_rows: int | None = None) -> None:
        from mismatch.analysis import chunked

        # A row group at most a chunk: chunks are whole row groups.
        self.file, self.group_rows = file, group_rows or min(1 << 18, chunked.DEFAULT_CHUNK_ROWS)
        self._writer: Any = None
        self._schema: Any = None
        self._pending: list[Any] = []
        self._pending_rows = 0

    def write(self, block: pd.DataFrame) -> None:
        table = _arrow_table(block, self._schema)
        if self._schema is None:
            self._schema = table.schema
        self._pending.append(table)
        self._pending_rows += len(block)
        if self._pending_rows >= self.group_rows:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._pending:
            return
        # One dictionary per column in the row group: blocks each bring their own, and Parquet's
        # writer, handed a column whose dictionary changes, falls back to plain strings for it
        # (the rollout column of a 290k-row group: 3.3 MB instead of 7 KB, and every reading of
        # it re-encoded 290k strings: 0.63 -> 0.43 s of CPU a pass over 9.3M rows).
        table = pa.concat_tables(self._pending).unify_dictionaries().combine_chunks()
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.file, table.schema, **parquet_layout(table.schema))
        self._writer.write_table(table, row_group_size=len(table) or 1)
        self._pending, self._pending_rows = [], 0

    def close(self, empty: pd.DataFrame | None = None) -> None:
        """Write what is pending and close; with no block at all, an empty table like `empty`."""
        if self._writer is None and not self._pending and empty is not None:
            write_tokens(empty, self.file)
            return
        self._flush()
        if self._writer is not None:
            self._writer.close()


def parquet_layout(schema: Any) -> dict[str, Any]:
    """How tokens.parquet is encoded: dictionaries only for the categorical columns (rollout,
    branch, role, ...) and LZ4. Parquet's default, a dictionary tried on every column, spends its
    time on log-prob columns that never compress that way; measured on 9.3M rows: write 2.4 ->
    1.5 s, each read back 1.5 -> 0.3 s, 184 -> 152 MB. Min/max statistics only where a reader
    may filter row groups by them (a rollout): on every column they cost 0.2 s of the write."""
    import pyarrow as pa

    return {"use_dictionary": [field.name for field in schema if pa.types.is_dictionary(field.type)],
            "compression": "lz4",
            "write_statistics": [name for name in ("rollout_index", "rollout") if name in schema.names]}


def _arrow_table(block: pd.DataFrame, schema: Any) -> Any:
    """A block as Arrow: NaN kept as NaN (not null), categoricals as dictionary<int32, string> (one
    type for every block, whatever its number of categories); cast to `schema` after the first."""
    import pandas as pd
    import pyarrow as pa

    columns, fields = [], []
    for name in block.columns:
        values = block[name]
        if isinstance(values.dtype, pd.CategoricalDtype):
            array = pa.DictionaryArray.from_arrays(pa.array(values.cat.codes.to_numpy(np.int32)),
                                                   pa.array(values.cat.categories.astype(str).tolist(),
                                                            type=pa.string()))
        else:
            array = pa.array(values.to_numpy(), from_pandas=False)
        columns.append(array)
        fields.append(pa.field(name, array.type))
    table = pa.Table.from_arrays(columns, schema=pa.schema(fields))
    return table if schema is None else table.select(schema.names).cast(schema)


def tokens_chunks(files: Sequence[Path], *, columns: Sequence[str] | None = None,
                  rows: int | None = None) -> ChunkSource:
    """Chunks of whole rollouts of the tokens.parquet `files` (in order), whole row groups of
    about `rows` rows each (analysis.chunked.DEFAULT_CHUNK_ROWS), read by number: re-iterable,
    each call a new pass. Categories come back sorted, as the replay's tables have them. The
    files' footers are read once, at the first use."""
    import pyarrow.parquet as pq

    from mismatch.analysis import chunked

    @functools.cache
    def units() -> list[tuple[Path, Any, list[int] | None]]:
        """(file, its footer, the chunk's row groups | None: the whole file) of each chunk."""
        limit = rows or chunked.DEFAULT_CHUNK_ROWS
        listed = []
        for file in files:
            metadata = pq.ParquetFile(file).metadata
            groups: list[int] = []
            size = 0
            for group in range(metadata.num_row_groups):
                groups.append(group)
                size += metadata.row_group(group).num_rows
                if size >= limit or group == metadata.num_row_groups - 1:
                    listed.append((file, metadata, groups))
                    groups, size = [], 0
            if metadata.num_row_groups == 0:
                listed.append((file, metadata, None))
        return listed

    def read(number: int) -> pd.DataFrame:
        file, metadata, groups = units()[number]
        reader = pq.ParquetFile(file, metadata=metadata)  # read, not mapped: mapped pages would count in the RSS
        return _frame(reader.read(columns=columns) if groups is None else reader.read_row_groups(groups, columns=columns))

    return chunked.ChunkSource(count=lambda: len(units()), read=read)


def _frame(table: pa.Table) -> pd.DataFrame:
    """A chunk read as pandas, a block per column: consolidating them into 2-D blocks copied every
    chunk again (0.4 of 0.9 s a pass at 10^7 rows). Categories come back sorted."""
    return _sorted_categories(table.to_pandas(split_blocks=True, self_destruct=True))


def _sorted_categories(frame: pd.DataFrame) -> pd.DataFrame:
    import pandas as pd

    for name in frame.columns:
        values = frame[name]
        if isinstance(values.dtype, pd.CategoricalDtype) and not values.cat.categories.is_monotonic_increasing:
            frame[name] = values.cat.reorder_categories(sorted(values.cat.categories))
    return frame


def read_tokens(path: Path, *, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """The token table of results dir `path` (only `columns`, when given)."""
    import pyarrow.parquet as pq

    file = path / TOKENS_FILE
    if not file.is_file():
        raise ResultsError(f"{path}: no {TOKENS_FILE}")
    # Mapped, not read into buffers: the compressed bytes are the page cache's, not fresh memory.
    table = pq.ParquetFile(file, memory_map=True).read(columns=None if columns is None else list(columns))
    # One block per column and the Arrow buffers handed over: no consolidating copy (write_tokens).
    return table.to_pandas(split_blocks=True, self_destruct=True)


class WorkDir:
    """Finished (source, block) log-prob columns of an audit in progress, for resuming after a kill.

    Lives beside the results dir as `.NAME.work/`; its manifest names the inputs, so a rerun of the
    same command resumes and a different command never picks up another run's blocks.
    """

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self._loaded: dict[str, int] = {}
        self._facts: dict[str, dict[str, Any]] = {}  # source -> engine_facts, written with its first block

    @classmethod
    def open(cls, out: Path, manifest: dict[str, Any], *, force: bool) -> WorkDir:
        path = out.parent / f".{out.name}.work"
        manifest_file = path / "manifest.json"
        if path.exists():
            previous = json.loads(manifest_file.read_text()) if manifest_file.is_file() else None
            if previous != json_safe(manifest):
                if not force:
                    raise ResultsError(f"{path}: holds an interrupted run with other inputs; "
                                       "pass --force to discard it")
                shutil.rmtree(path)
        # Nothing is created until the first block is saved: bad input must leave nothing behind.
        return cls(path, manifest)

    def _file(self, source: str, block: int) -> Path:
        return self.path / f"{source}-{block:06d}.npy"

    def load(self, source: str, block: int) -> np.ndarray | None:
        file = self._file(source, block)
        if not file.is_file():
            return None
        try:
            values = np.load(file, allow_pickle=False)
        except (ValueError, OSError, EOFError):
            # Saves are atomic, so only something outside this tool makes a block unreadable
            # (an empty or cut file): replayed again, never trusted and never fatal.
            file.unlink(missing_ok=True)
            return None
        self._loaded[source] = self._loaded.get(source, 0) + 1
        return values

    def _create(self) -> None:
        """The dir and its manifest, at the first save (bad input must leave nothing behind)."""
        if not (self.path / "manifest.json").is_file():
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path / "manifest.json", json.dumps(json_safe(self.manifest), indent=1) + "\n")

    def save(self, source: str, block: int, logp: np.ndarray) -> None:
        self._create()
        if source in self._facts and not (self.path / f"{source}-engine.json").is_file():
            atomic_write_text(self.path / f"{source}-engine.json", json.dumps(self._facts[source]) + "\n")
        self._write_binary(self._file(source, block),
                           lambda handle: np.save(handle, logp, allow_pickle=False))

    def _write_binary(self, file: Path, write: Callable[[Any], None]) -> None:
        """`write(handle)` into a temp file renamed to `file`: a kill mid-write leaves a temp
        file (removed with the work dir), never a short block."""
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.tmp-", dir=self.path)
        try:
            with os.fdopen(fd, "wb") as handle:
                write(handle)
            os.replace(tmp, file)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def save_routing(self, source: str, block: int, routed: list[Any]) -> None:
        """A block's MoE routing (engines/routing.StreamRouting per request), beside its log-probs."""
        self._create()
        self._write_binary(self.path / f"{source}-routing-{block:06d}.npz", lambda handle: np.savez(
            handle, lengths=np.array([len(r.experts) for r in routed], dtype=np.int64),
            experts=np.concatenate([r.experts for r in routed]), margin=np.concatenate([r.margin for r in routed])))

    def load_routing(self, source: str, block: int) -> list[Any] | None:
        from mismatch.streams import StreamRouting

        file = self.path / f"{source}-routing-{block:06d}.npz"
        if not file.is_file():
            return None
        try:
            with np.load(file, allow_pickle=False) as saved:
                cuts = np.cumsum(saved["lengths"])[:-1]
                return [StreamRouting(experts=e, margin=m) for e, m in
                        zip(np.split(saved["experts"], cuts), np.split(saved["margin"], cuts))]
        except (ValueError, OSError, EOFError, KeyError):
            file.unlink(missing_ok=True)  # cut or foreign: replayed again (see load)
            return None

    def _write_json(self, name: str, data: dict[str, Any]) -> None:
        self._create()
        atomic_write_text(self.path / name, json.dumps(json_safe(data)) + "\n")

    def _read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON file of the work dir, or None when it is missing or unreadable (then redone)."""
        try:
            return json.loads((self.path / name).read_text()) if (self.path / name).is_file() else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def save_stage(self, name: str, result: dict[str, Any]) -> None:
        """A finished stage after the replays (the model localizers), so a rerun after a kill
        during a later stage does not redo it."""
        self._write_json(f"stage-{name}.json", result)

    def load_stage(self, name: str) -> dict[str, Any] | None:
        return self._read_json(f"stage-{name}.json")

    def save_described(self, source: str, described: dict[str, Any]) -> None:
        """The engine's describe() once its blocks are done: a resume that replays nothing for a
        source still reports the engine as it was (resolved options, semantics), as one run would."""
        if self.path.is_dir():
            self._write_json(f"{source}-described.json", described)

    def load_described(self, source: str) -> dict[str, Any] | None:
        return self._read_json(f"{source}-described.json")

    def check_engine(self, source: str, facts: dict[str, Any]) -> None:
        """Refuse to mix blocks from an engine that reports itself differently (an HTTP server now
        serving another model or version, "auto" resolving to another dtype); remember the facts."""
        file = self.path / f"{source}-engine.json"
        facts = json_safe(facts)
        previous = json.loads(file.read_text()) if file.is_file() else None
        if previous is not None and previous != facts and any(self.path.glob(f"{source}-*.npy")):
            changed = sorted(key for key in set(previous) | set(facts) if previous.get(key) != facts.get(key))
            raise ResultsError(f"{self.path}: its {source} blocks came from an engine reporting "
                               f"{', '.join(f'{k}={previous.get(k)!r}' for k in changed)}; it now reports "
                               f"{', '.join(f'{k}={facts.get(k)!r}' for k in changed)}; pass --force to "
                               "discard those blocks")
        self._facts[source] = facts

    def num_loaded(self, source: str) -> int:
        return self._loaded.get(source, 0)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
