"""What every importer shares: where a record came from, typed field access, and segment building.

Framework modules turn one record of their dump into format v1 rollout dicts with these helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from mismatch.errors import MismatchError

T = TypeVar("T")


class ImportFormatError(MismatchError):
    """A dump that does not follow its framework's documented fields (names file, record, field)."""

    def __init__(self, message: str, *, where: str, field: str | None = None) -> None:
        self.where, self.field, self.reason = where, field, message
        super().__init__(": ".join([where, *([field] if field else []), message]))


@dataclass(kw_only=True, slots=True, frozen=True)
class Where:
    """One record of a dump: `file:line` for JSON Lines / Parquet rows, `file[i]` for array items."""

    file: str
    index: int   # 1-based line or row; 0-based item
    kind: str    # "line" | "item"

    @property
    def text(self) -> str:
        return f"{self.file}:{self.index}" if self.kind == "line" else f"{self.file}[{self.index}]"

    @property
    def line(self) -> int:
        """A positive number for the v1 validator's messages (items count from 1 there)."""
        return self.index if self.kind == "line" else self.index + 1

    def error(self, field: str | None, reason: str) -> ImportFormatError:
        return ImportFormatError(reason, where=self.text, field=field)


def _type_name(value: Any) -> str:
    return type(value).__name__ if value is not None else "null"


def get(record: Any, key: str, where: Where, *, prefix: str = "") -> Any:
    """record[key], or an error naming the field when the record has no such key."""
    if not isinstance(record, dict):
        raise where.error(prefix.rstrip(".") or None,
                          f"expected an object with {key!r}, got {_type_name(record)}")
    if key not in record or record[key] is None:
        raise where.error(prefix + key, "missing required field")
    return record[key]


def typed(record: Any, shape: type[T], where: Where, *, prefix: str = "") -> T:
    """A dump's record as the importer's typed view of it (msgspec.convert: Structs naming the
    fields it reads, unknown fields ignored); a field of another type is one ImportFormatError
    naming it by msgspec's path (`traces[0].nodes[2].token_ids[5]`)."""
    try:
        return msgspec.convert(record, shape)
    except msgspec.ValidationError as error:
        reason, _, path = str(error).partition(" - at `$")
        raise where.error((prefix + path.rstrip("`").lstrip(".")).rstrip(".") or None, reason) from None


def ints(value: Any, field: str, where: Where) -> list[int]:
    if not isinstance(value, list):
        raise where.error(field, f"must be an array of integers, got {_type_name(value)}")
    bad = next((i for i, v in enumerate(value) if type(v) is not int), None)  # bool is not a token id
    if bad is not None:
        raise where.error(field, f"must be an array of integers (item {bad} is {_type_name(value[bad])})")
    return value


def floats(value: Any, field: str, where: Where) -> list[float]:
    if not isinstance(value, list) or not all(type(v) in (int, float) for v in value):
        raise where.error(field, "must be an array of numbers")
    return [float(v) for v in value]


def same_length(field: str, values: Sequence, other: str, reference: Sequence, where: Where) -> None:
    if len(values) != len(reference):
        raise where.error(field, f"has {len(values)} entries for {len(reference)} {other}")


def response_sample(row: Any, where: Where, prefix: str, *, prompt: str, response: str, mask: str,
                    logprobs: str) -> tuple[list[int], list[int], list[int], list[float] | None]:
    """(prompt ids, response ids, loss mask, sampler log-probs or None) of a flat sample record,
    under the record's own field names; the mask and log-probs must align with the response."""
    prompt_ids = ints(get(row, prompt, where, prefix=prefix), prefix + prompt, where)
    response_ids = ints(get(row, response, where, prefix=prefix), prefix + response, where)
    loss_mask = ints(get(row, mask, where, prefix=prefix), prefix + mask, where)
    same_length(prefix + mask, loss_mask, response, response_ids, where)
    logp = row.get(logprobs)
    if logp is not None:
        logp = floats(logp, prefix + logprobs, where)
        same_length(prefix + logprobs, logp, response, response_ids, where)
    return prompt_ids, response_ids, loss_mask, logp


def runs(mask: Sequence[int]) -> list[tuple[int, int, bool]]:
    """(start, stop, on) for each run of equal mask values."""
    out: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or bool(mask[i]) != bool(mask[start]):
            out.append((start, i, bool(mask[start])))
            start = i
    return out


def routed_rows(value: Any, field: str, num_tokens: int, where: Where) -> list[Any]:
    """A dump's routed experts ([positions][layers][top-k] ids from the rollout engine, as vLLM's
    CompletionOutput.routed_experts) as one row per token, None where it has none: past its end
    (the last token is never fed) or an all-zero row, which is a framework's padding, never a
    routing (a top-k of k > 1 names k different experts). The v1 validator checks the rest."""
    if not isinstance(value, list) or len(value) > num_tokens:
        raise where.error(field, f"must be an array of at most {num_tokens} [layers][top-k] rows (one per "
                                 f"token), got {_type_name(value) if not isinstance(value, list) else len(value)}")
    rows = [None if _is_padding(row) else row for row in value]
    return rows + [None] * (num_tokens - len(rows))


def _is_padding(row: Any) -> bool:
    return (isinstance(row, list) and all(isinstance(layer, list) and len(layer) > 1 for layer in row)
            and not any(expert for layer in row for expert in layer))


def with_routing(segment: dict[str, Any], rows: list[Any] | None) -> dict[str, Any]:
    """The segment with its routed_experts rows, when the dump has any for its tokens."""
    if rows is not None and any(row is not None for row in rows):
        segment["routed_experts"] = rows
    return segment


def masked_segments(ids: list[int], mask: Sequence[int], logprobs: list[float] | None, *,
                    off_role: str, routed: list[Any] | None = None,
                    extra_logprobs: dict[str, list[float]] | None = None) -> list[dict[str, Any]]:
    """Segments of a response whose mask marks trained (1) and other (0) tokens.

    Mask-1 runs are assistant turns with their log-probs. Mask-0 runs are `off_role`: "tool"
    for frameworks whose 0 means environment tokens inside the response (their placeholder
    log-probs are dropped), or "assistant" for ones whose 0 means a sampled token left out of
    the loss (kept with its log-probs, trainable false). `routed`: one routed_experts row (or
    None) per token, split with the tokens. `extra_logprobs`: other log-prob streams aligned with
    the response (a trainer's own, e.g. "trainer_old"), split like the sampler's.
    """
    segments = []
    for start, stop, on in runs(mask):
        role = "assistant" if on else off_role
        segment: dict[str, Any] = {"role": role, "tokens": ids[start:stop]}
        if logprobs is not None and role == "assistant":
            segment["logprobs"] = logprobs[start:stop]
        if extra_logprobs and role == "assistant":
            segment["extra_logprobs"] = {name: values[start:stop] for name, values in extra_logprobs.items()}
        if role == "assistant" and not on:
            segment["trainable"] = False
        segments.append(with_routing(segment, routed[start:stop] if routed is not None else None))
    return segments


def branch(branch_id: str, segments: list[dict[str, Any]], *, kind: str = "main", parent: str | None = None,
           fork_at: int | None = None) -> dict[str, Any]:
    return {"id": branch_id, "kind": kind, "parent": parent, "fork_at": fork_at,
            "segments": [s for s in segments if s["tokens"]]}


def source_meta(format_name: str, where: Where, **extra: Any) -> dict[str, Any]:
    """`meta` for an imported rollout: where it came from, plus the framework's own facts."""
    return {"source": {"format": format_name, "file": where.file, where.kind: where.index},
            **{key: value for key, value in extra.items() if value is not None}}


def rows_of(record: dict[str, Any], keys: Sequence[str], where: Where) -> list[dict[str, Any]]:
    """A columnar batch (each key a list, one entry per sample) as one dict per sample."""
    present = [key for key in keys if record.get(key) is not None]
    lengths = {key: len(record[key]) for key in present if isinstance(record[key], list)}
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{key} {n}" for key, n in lengths.items())
        raise where.error(None, f"batch columns differ in length ({detail})")
    num_rows = next(iter(lengths.values()), 0)
    return [{key: record[key][i] for key in lengths} for i in range(num_rows)]
