"""The token table of a run: tokens.parquet as it is laid out (`write_tokens`, `TokensWriter`
block by block), read back whole (`read_tokens`) or in chunks of whole rollouts (`tokens_chunks`),
and `TokenStore`, the table of a run being analysed, in the staged results dir or in memory.

pandas and pyarrow are imported when a table is read or written, not with this module.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mismatch.errors import ResultsError
from mismatch.results import chunks as chunking  # DEFAULT_CHUNK_ROWS read at each use (tests patch it)
from mismatch.results.chunks import ChunkSource, table_chunks
from mismatch.results.jsonio import write_summary
from mismatch.results.summary_model import Summary
from mismatch.results.names import TOKENS_FILE
from mismatch.results.staging import staged_dir

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa


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

    def write(self, block: pd.DataFrame | pa.Table) -> None:
        """A block of whole rollouts: a DataFrame, or, for a store in a results dir, the Arrow
        table `arrow_block` made of it (in a forked reader: the parent only writes it)."""
        arrow = _is_arrow(block)
        if not self.columns:
            self.columns = [str(name) for name in (block.column_names if arrow else block.columns)]
        self.num_rows += len(block)
        if self._writer is not None:
            self._writer.write(block)
        else:
            assert not arrow, "an Arrow block for a token table kept in memory"
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
            self._table = (concat_tables(self._blocks) if self.directory is None
                           else read_tokens(self.directory))
            self._blocks = []
        return self._table

    @property
    def chunks(self) -> ChunkSource:
        if self.directory is None:
            return table_chunks(self.table)
        return tokens_chunks([self.directory / TOKENS_FILE])

    def add_column(self, name: str, values: np.ndarray) -> None:
        """A column computed after the blocks were stored (aligned with the rows); one of that name
        already there is replaced."""
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
        if name not in self.columns:
            self.columns.append(name)

    def side_file(self, name: str) -> Path | None:
        """A scratch file beside tokens.parquet (None without a results dir)."""
        if self.directory is None:
            return None
        path = self.directory / f".{name}.parquet"
        self._side.append(path)
        return path

    def keep_side_file(self, name: str, published: str) -> None:
        """Side file `name` published with the results as `published` (a shard's prefix keys, which
        its merge reads), when it was written."""
        assert self.directory is not None
        path = self.directory / f".{name}.parquet"
        if path in self._side and path.is_file():
            os.replace(path, self.directory / published)
            self._side.remove(path)

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


def write_results(out: Path, *, tokens: pd.DataFrame, summary: Summary, force: bool) -> Path:
    """A results dir of a token table in memory and its summary, staged and renamed into place."""
    with staged_dir(out, force=force) as stage:
        write_tokens(tokens, stage / TOKENS_FILE)
        write_summary(stage, summary)
    return out


def concat_tables(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Block tables as one, categoricals kept (their categories united, sorted)."""
    import pandas as pd

    if not tables:
        return pd.DataFrame()
    categorical = [name for name in tables[0].columns if isinstance(tables[0][name].dtype, pd.CategoricalDtype)]
    if len(tables) == 1:
        return tables[0]
    united = {name: sorted({value for table in tables for value in table[name].cat.categories}) for name in categorical}
    return pd.concat([table.astype({name: pd.CategoricalDtype(united[name]) for name in categorical})
                      for table in tables], ignore_index=True)


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
        # A row group at most a chunk: chunks are whole row groups.
        self.file, self.group_rows = file, group_rows or min(1 << 18, chunking.DEFAULT_CHUNK_ROWS)
        self._writer: Any = None
        self._schema: Any = None
        self._pending: list[Any] = []
        self._pending_rows = 0

    def write(self, block: pd.DataFrame | pa.Table) -> None:
        """A block as a DataFrame, or already as Arrow (`arrow_block`)."""
        table = block if _is_arrow(block) else arrow_block(block)
        if self._schema is None:
            self._schema = table.schema
        else:  # one schema for every block, whatever its number of categories
            table = table.select(self._schema.names).cast(self._schema)
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


def _is_arrow(block: pd.DataFrame | pa.Table) -> bool:
    return hasattr(block, "column_names")  # a pa.Table's; a DataFrame has none (pyarrow not imported for it)


def arrow_block(block: pd.DataFrame) -> pa.Table:
    """A block as TokensWriter writes it: NaN kept as NaN (not null), categoricals as
    dictionary<int32, string> (one type for every block, whatever its number of categories).
    A forked reader makes it, so the process that writes tokens.parquet only writes."""
    import pandas as pd
    import pyarrow as pa

    columns, fields = [], []
    for name, values in block.items():
        if isinstance(values.dtype, pd.CategoricalDtype):
            # From the Categorical itself, not through the .cat accessor's Series and a list of its
            # categories: 2.0 -> 1.3 ms a block of 60k rows, the same table.
            categorical = values.array
            array = pa.DictionaryArray.from_arrays(categorical.codes.astype(np.int32),
                                                   pa.array(categorical.categories.astype(str).to_numpy(),
                                                            type=pa.string()))
        else:
            array = pa.array(values.to_numpy(), from_pandas=False)
        columns.append(array)
        fields.append(pa.field(name, array.type))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def tokens_chunks(files: Sequence[Path], *, columns: Sequence[str] | None = None,
                  rows: int | None = None) -> ChunkSource:
    """Chunks of whole rollouts of the tokens.parquet `files` (in order), whole row groups of
    about `rows` rows each (chunks.DEFAULT_CHUNK_ROWS), read by number: re-iterable,
    each call a new pass. Categories come back sorted, as the replay's tables have them. The
    files' footers are read once, at the first use."""
    import pyarrow.parquet as pq

    @functools.cache
    def units() -> list[tuple[Path, Any, list[int] | None]]:
        """(file, its footer, the chunk's row groups | None: the whole file) of each chunk."""
        limit = rows or chunking.DEFAULT_CHUNK_ROWS
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

    def names() -> list[str]:
        listed = units()
        return list(columns) if columns is not None else (listed[0][1].schema.to_arrow_schema().names if listed else [])

    return ChunkSource(count=lambda: len(units()), read=read, columns=names)


def _frame(table: pa.Table) -> pd.DataFrame:
    """A chunk read as pandas, a block per column: consolidating them into 2-D blocks copied every
    chunk again, a large share of each pass. Categories come back sorted."""
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
