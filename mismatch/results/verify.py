"""A results dir's tables against the summary.json beside them: what every reader checks first.

report, gate, recommend and trend read a dir that may have been edited, copied together from two
runs or cut short. `check_tables` holds its tables to what its summary recorded (each file's
SHA-256 and rows, summary.json `shard.files`), and, where a summary records none (written by hand
or by an older mismatch), to what any run writes: readable Parquet with the contract's columns,
as many token rows as `counts.tokens`. A dir that fails is one ResultsError line, exit 2.
"""

from __future__ import annotations

from pathlib import Path

from msgspec import UNSET, Struct, UnsetType, field

from mismatch.errors import ResultsError
from mismatch.results.names import ROLLOUTS_FILE, SUMMARY_FILE, TOKENS_FILE
from mismatch.results.staging import check_published_files, check_recorded_files
from mismatch.results.summary_model import RowCounts, Shard, Summary, present

# The columns every tokens.parquet has (ARCHITECTURE.md, "Results dir"), and rollouts.parquet's.
TOKEN_COLUMNS = ("rollout", "branch", "turn", "pos", "role", "token_id", "trainable")
ROLLOUT_COLUMNS = ("pair", "n_tokens")


class RecordedTables(Struct, kw_only=True, forbid_unknown_fields=False):
    """What a summary.json records of its tables, read alone (the gate reads the rest of a file as
    it is: a hand-edited one is checked, not decoded): the shard's files and the token count."""

    shard: Shard | UnsetType = UNSET
    counts: RowCounts = field(default_factory=RowCounts)


def check_tables(directory: Path, summary: Summary | RecordedTables, *,
                 tables: tuple[str, ...] = (TOKENS_FILE, ROLLOUTS_FILE), required: tuple[str, ...] = (TOKENS_FILE,)) -> None:
    """Refuse `directory` when a table of `tables` is not the one its summary.json describes.
    `required`: the tables that must be there (report needs tokens.parquet; trend only rollouts)."""
    directory = Path(directory)
    shard = present(summary.shard)
    recorded = present(shard.files) if shard is not None else None
    if recorded:
        # A table the reader does not need may be absent (gate on a summary.json copied alone); one
        # that is there must be the one recorded.
        wanted = {name: entry for name, entry in recorded.items()
                  if name in tables and (name in required or (directory / name).is_file())}
        check_published_files(directory, wanted) if TOKENS_FILE in wanted else check_recorded_files(directory, wanted)
    for name in tables:
        file = directory / name
        if not file.is_file():
            if name in required:
                raise ResultsError(f"{directory}: no {name} ({SUMMARY_FILE} is there: a results dir cut short, "
                                   "or a file removed)")
            continue
        rows, names = _layout(file)
        columns = TOKEN_COLUMNS if name == TOKENS_FILE else ROLLOUT_COLUMNS
        missing = [column for column in columns if column not in names]
        if name == TOKENS_FILE and not any(n.startswith("logp_") for n in names):
            missing.append("logp_<source>")
        if missing:
            raise ResultsError(f"{file}: missing column(s) {', '.join(missing)}: not the table a run writes")
        expected = present(summary.counts.tokens) if name == TOKENS_FILE else None
        if expected is not None and expected != rows:
            raise ResultsError(f"{file}: {rows} rows, but {directory}/{SUMMARY_FILE} counts {expected} tokens "
                               "(another run's file, or cut short)")


def _layout(file: Path) -> tuple[int, list[str]]:
    """(rows, column names) of a Parquet file, or one line saying it is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
        return parquet.metadata.num_rows, list(parquet.schema_arrow.names)
    except (pa.ArrowException, OSError, ValueError) as error:
        detail = " ".join(str(error).split())[:160]
        raise ResultsError(f"{file}: not a readable Parquet table ({detail})") from None
