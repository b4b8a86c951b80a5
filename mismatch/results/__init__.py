"""The results directory, the one contract between the commands, the report, gate and merge.

Its names (`names`), the schema of summary.json (`mismatch/data/summary.schema.json`, checked by
`jsonio.validate_summary`), `json_safe`, the readers and the writers live in this package and
nowhere else; ARCHITECTURE.md, "Results dir", says what each file holds. Importing it loads numpy
only (pandas and pyarrow when a table is read or written).

Everything is built in a hidden sibling temp dir and renamed into place at the end (`staging`), so
a crash or a bad input never leaves a half-written results dir, and an existing dir is replaced
only on request; one run at a time holds OUT (`lock`); an audit in progress keeps its finished
blocks beside it (`workdir`).
"""

from mismatch.results.chunks import DEFAULT_CHUNK_ROWS, ChunkSource, chunk_bounds, table_chunks
from mismatch.results.jsonio import (
    json_safe,
    load_json,
    read_summary,
    summary_schema,
    validate_summary,
    write_summary,
)
from mismatch.results.lock import glob_escape, results_lock
from mismatch.results.summary_model import Summary
from mismatch.results.names import (
    DEPENDENCY_LOG,
    REPORT_FILE,
    ROLLOUTS_FILE,
    SCHEMA_FILE,
    STAGE_IN_PLACE,
    SUMMARY_FILE,
    SUMMARY_SCHEMA,
    TOKENS_FILE,
    is_results_dir,
)
from mismatch.results.staging import (
    PREFIX_KEYS_FILE,
    PUBLISHED_TABLES,
    atomic_write_text,
    check_out_dir,
    check_published_files,
    file_fault,
    published_files,
    staged_dir,
)
from mismatch.results.tokens import (
    TOKENS_ROW_GROUP,
    TokenStore,
    TokensWriter,
    arrow_block,
    concat_tables,
    parquet_layout,
    read_tokens,
    staged_tokens,
    tokens_chunks,
    write_results,
    write_tokens,
)
from mismatch.results.workdir import WorkDir

__all__ = [
    "ChunkSource", "DEFAULT_CHUNK_ROWS", "DEPENDENCY_LOG", "PREFIX_KEYS_FILE", "PUBLISHED_TABLES",
    "REPORT_FILE", "ROLLOUTS_FILE", "SCHEMA_FILE", "STAGE_IN_PLACE", "SUMMARY_FILE", "SUMMARY_SCHEMA",
    "TOKENS_FILE", "TOKENS_ROW_GROUP", "TokenStore", "TokensWriter", "WorkDir", "arrow_block", "atomic_write_text",
    "check_out_dir", "check_published_files", "file_fault", "chunk_bounds", "concat_tables", "glob_escape",
    "Summary", "is_results_dir", "json_safe", "load_json", "parquet_layout", "published_files", "read_summary",
    "read_tokens", "results_lock", "staged_dir", "staged_tokens", "summary_schema", "table_chunks",
    "tokens_chunks", "validate_summary", "write_results", "write_summary", "write_tokens",
]
