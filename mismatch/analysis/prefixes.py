"""Prefix consistency from the data: one engine config must give identical log-probs to the same
token after the same prefix, whichever request it came in (the samples of a GRPO group share their
prompt; duplicated rollouts share everything). Where it does not, the engine's numbers depend on
what else was batched with them (batch variance), or on a bug (a cache that serves stale rows).

Each replayed token is keyed by a 64-bit hash of its stream up to and including it, and its
position; tokens with the same key are the same prefix. Per log-prob column: how many tokens share
a prefix with another request, how many of those groups agree bit for bit, and the worst spread.
The groups span the whole run, so DuckDB forms them, out of core (DUCKDB_MEMORY), over
tokens.parquet and a side file of the keys.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mismatch.streams import ReplayRequest

_P = np.uint64(0x100000001B3)            # the FNV-1a 64-bit prime: odd, so invertible mod 2^64
_P_INV = np.uint64(pow(0x100000001B3, -1, 2**64))


def prefix_keys(requests: Sequence[ReplayRequest]) -> np.ndarray:
    """Per token-table row (the requests' scored tokens, in order): a hash of the request's tokens
    0..position (h_i = sum_j (t_j + 1) P^(i - j) mod 2^64, computed as P^i * cumsum((t_j + 1) P^-j)).

    All of a block's requests at once: i and j count from each request's start, and each
    request's running sum is the block's less what the requests before it summed (exact: uint64
    arithmetic is modulo 2^64), so no numpy call is made per request.
    """
    if not requests:
        return np.empty(0, np.uint64)
    lengths = np.fromiter((len(request.tokens) for request in requests), dtype=np.int64, count=len(requests))
    starts = np.cumsum(lengths) - lengths
    local = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)  # i: the position in its request
    longest = int(lengths.max())
    with np.errstate(over="ignore"):
        tokens = np.concatenate([request.tokens for request in requests]).astype(np.uint64)
        sums = np.zeros(len(tokens) + 1, dtype=np.uint64)  # sums[k]: of the block's first k terms
        np.cumsum((tokens + np.uint64(1)) * _powers(_P_INV, longest)[local], dtype=np.uint64, out=sums[1:])
        keys = (sums[1:] - np.repeat(sums[starts], lengths)) * _powers(_P, longest)[local]
    score_from = np.fromiter((request.score_from for request in requests), dtype=np.int64, count=len(requests))
    return keys[local >= np.repeat(score_from, lengths)]


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) mod 2^64 (uint64 arithmetic wraps)."""
    steps = np.full(n, base, dtype=np.uint64)
    if n:
        steps[0] = 1
    return np.cumprod(steps, dtype=np.uint64)


class PrefixKeys:
    """Each token row's prefix key, added block by block: a Parquet side file beside tokens.parquet
    (row for row), or, without a file, in memory."""

    def __init__(self, file: Path | None) -> None:
        self.file = file
        self._parts: list[np.ndarray] = []
        self._writer: Any = None

    def add(self, keys: np.ndarray) -> None:
        if self.file is None:
            self._parts.append(keys)
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"key": pa.array(keys, type=pa.uint64())})
        if self._writer is None:
            # Plain and uncompressed: hashes neither repeat nor compress, and Parquet's default
            # dictionary, tried on every block and dropped, took 1.1 of 1.2 s at 9.3M rows; no
            # statistics either (a third of what was left): nothing filters this file by its values.
            self._writer = pq.ParquetWriter(self.file, table.schema, use_dictionary=False, compression="none",
                                            write_statistics=False)
        self._writer.write_table(table)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    @property
    def values(self) -> np.ndarray:
        """In memory: every row's key."""
        return np.concatenate(self._parts) if self._parts else np.empty(0, np.uint64)


# DuckDB's working memory for the group-by over every row's key: it spills to disk beyond this,
# so a run of 10^8 tokens stays within it. Measured on 9.3M and 28M rows (2 cores): 512 MB never
# spills there and the process peaks at ~350 MB either way; 384 and 256 MB spill, and their
# spilling peaks higher (470-640 MB) and runs 3-5x slower.
DUCKDB_MEMORY = "512MB"


def prefix_consistency(tokens: pd.DataFrame | Path, keys: np.ndarray | Path,
                       sources: Sequence[str]) -> dict[str, Any]:
    """summary.json["prefix_consistency"]: per source with a log-prob column, over the tokens whose
    prefix (key and position) occurs in more than one request of this run.

    `tokens` is a token table in memory or a tokens.parquet file, `keys` each row's prefix key (an
    array, or a Parquet file of one `key` column written row for row with it). DuckDB groups the
    rows by key, out of core past DUCKDB_MEMORY: the groups span the whole run, not a chunk.
    """
    import duckdb

    with tempfile.TemporaryDirectory(prefix="mismatch-duckdb-") as spill:
        con = duckdb.connect(config={"memory_limit": DUCKDB_MEMORY, "temp_directory": spill})
        try:
            columns = _register(con, tokens, keys)
            wanted = [(source, f"logp_{source}") for source in sources if f"logp_{source}" in columns]
            # One group-by for every column: the hash already covers the whole prefix (its length
            # included), so a key is a prefix; only keys of more than one row are kept. A NaN (no
            # log-prob) becomes NULL once per row, which count/min/max skip: a FILTER on each of the
            # three aggregates tested it three times (1.39 -> 1.10 CPU-s over 9.3M rows).
            values = "".join(f', CASE WHEN isnan("{c}") THEN NULL ELSE "{c}" END AS "v_{s}"' for s, c in wanted)
            per_column = "".join(f', count("v_{s}") AS "n_{s}", min("v_{s}") AS "lo_{s}", max("v_{s}") AS "hi_{s}"'
                                 for s, _ in wanted)
            con.execute(f"CREATE TEMP TABLE groups AS SELECT key, min(row) AS first_row{per_column} "
                        f"FROM (SELECT key, row{values} FROM rows) GROUP BY key HAVING count(*) > 1")
            return {source: _source_consistency(con, source, column) for source, column in wanted}
        finally:
            con.close()


class PrefixConsistency:
    """prefix_consistency beside an audit's analyses (a chunked.WholeRunJob): its one DuckDB query reads
    the files itself, so it runs in a process of its own during the analysis's first pass instead
    of before the analysis on one core (DuckDB's positional join of the two files scans on one
    thread: ~1 s over benchmarks/audit_stored.py's 9.3M rows)."""

    def __init__(self, tokens: pd.DataFrame | Path, keys: np.ndarray | Path, sources: Sequence[str]) -> None:
        self.inputs: tuple[pd.DataFrame | Path, np.ndarray | Path] | None = (tokens, keys)
        self.sources = list(sources)
        self.found: dict[str, Any] | None = None

    def compute(self) -> None:
        if self.inputs is not None:
            self.found = prefix_consistency(*self.inputs, self.sources)
            self.inputs = None  # a table in memory is not sent back from a worker with the result

    def result(self) -> dict[str, Any]:
        self.compute()
        assert self.found is not None
        return self.found


def _register(con: Any, tokens: pd.DataFrame | Path, keys: np.ndarray | Path) -> list[str]:
    """The view `rows` (key, row, rollout, pos, logp_*) over the tokens and their keys."""
    if isinstance(tokens, pd.DataFrame):
        wanted = ["rollout", "pos", *(c for c in tokens.columns if str(c).startswith("logp_"))]
        frame = tokens[wanted].assign(rollout=tokens["rollout"].astype(str),
                                      key=np.asarray(keys, dtype=np.uint64), row=np.arange(len(tokens)))
        con.register("rows", frame)
        return [str(c) for c in wanted]
    import pyarrow.parquet as pq

    names = [name for name in pq.ParquetFile(tokens).schema_arrow.names if name.startswith("logp_")]
    selected = ", ".join(f't."{name}"' for name in names)
    con.execute(f"CREATE VIEW rows AS SELECT k.key, t.file_row_number AS row, CAST(t.rollout AS VARCHAR) AS rollout, "
                f"t.pos, {selected} FROM read_parquet({_literal(tokens)}, file_row_number = true) t "
                f"POSITIONAL JOIN read_parquet({_literal(keys)}) k")
    return names


def _literal(path: Path) -> str:
    """A path as an SQL string literal (a view's definition cannot take parameters)."""
    return "'" + str(path).replace("'", "''") + "'"


def _source_consistency(con: Any, source: str, column: str) -> dict[str, Any]:
    n, lo, hi = f'"n_{source}"', f'"lo_{source}"', f'"hi_{source}"'
    n_shared, n_prefixes, equal, spread = con.execute(
        f"SELECT coalesce(sum({n}), 0), count(*), avg(CASE WHEN {lo} = {hi} THEN 1.0 ELSE 0.0 END), "
        f"max({hi} - {lo}) FROM groups WHERE {n} > 1").fetchone()
    if not n_prefixes:
        return {"n_shared_tokens": 0, "n_prefixes": 0, "frac_prefixes_bitwise_equal": None,
                "max_abs_spread": None, "worst": None}
    key, worst_spread = con.execute(f"SELECT key, {hi} - {lo} FROM groups WHERE {n} > 1 "
                                    f"ORDER BY {hi} - {lo} DESC, first_row LIMIT 1").fetchone()
    worst = None
    if worst_spread > 0:
        members = con.execute(f'SELECT rollout, pos FROM rows WHERE key = ? AND NOT isnan("{column}") ORDER BY row',
                              [key]).fetchall()
        worst = {"rollouts": sorted({str(rollout) for rollout, _ in members})[:5], "pos": int(members[0][1]),
                 "spread": float(worst_spread)}
    return {"n_shared_tokens": int(n_shared), "n_prefixes": int(n_prefixes),
            "frac_prefixes_bitwise_equal": float(equal), "max_abs_spread": float(spread), "worst": worst}
