"""How the rollout checks report a problem: one `RolloutError` per broken rule, each one line.

`Problems` gathers a rollout's errors (file:line, rollout, field, reason); the helpers word the
values and names a reason quotes, cut short. The rules that use them are `rules`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field

from mismatch.errors import RolloutError

MAX_NAME_CHARS = 60  # ids and names quoted in an error message are cut to this

_JSON_TYPE_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean",
                    int: "number", float: "number", type(None): "null"}
INT_TYPES = frozenset({int})
NUMBER_TYPES = frozenset({int, float})  # bool is excluded on purpose: type(True) is bool


@dataclass(slots=True)
class Problems:
    """The errors of one rollout (a line or row of a file), in the order the rules find them."""

    file: str
    line: int
    rollout: str | None = None
    errors: list[RolloutError] = field(default_factory=list)

    def add(self, where: str | None, reason: str) -> None:
        self.errors.append(RolloutError(reason, file=self.file, line=self.line,
                                        rollout=self.rollout, field=where))


# ---------------------------------------------------------------------------------------------
# Words: values and names as a one-line message shows them


def json_type(value: object) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def show(value: object) -> str:
    """A value as the user wrote it (JSON), cut short so a reason stays one line."""
    try:
        text = json.dumps(value, default=repr)
    except (RecursionError, ValueError):  # nested too deeply to print, or an int too long for str()
        return f"<{json_type(value)} too large to show>"
    return text if len(text) <= 40 else text[:37] + "..."


def name(text: str) -> str:
    """repr() of an id or name for a message, cut to MAX_NAME_CHARS (a 10 MB id stays one short line)."""
    return repr(text) if len(text) <= MAX_NAME_CHARS else repr(text[:MAX_NAME_CHARS]) + "..."


def short_id(text: str | None) -> str | None:
    """A rollout or branch id as messages show it: cut to MAX_NAME_CHARS so the message stays short."""
    if text is None or len(text) <= MAX_NAME_CHARS:
        return text
    return text[:MAX_NAME_CHARS] + "..."


def did_you_mean(key: str, known: tuple[str, ...]) -> str:
    """The known name `key` is likely a typo of, else the known names."""
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(known)}"


def key_path(key: object) -> str:
    if isinstance(key, str) and key.isidentifier() and len(key) <= MAX_NAME_CHARS:
        return f".{key}"
    return f"[{show(key)}]"


def layers_by_k(shape: tuple[int, ...]) -> str:
    return f"{shape[0]} layers x top-{shape[1]}"


def first_of(count: int, what: str) -> str:
    return "" if count == 1 else f" (first of {count} {what})"


def nesting(value: object) -> int:
    """Levels of arrays/objects in a JSON value, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def first_bad_type(values: list, allowed: frozenset[type]) -> int | None:
    # set(map(type, ...)) runs in C, so the common all-good case costs no Python loop per token.
    if set(map(type, values)) <= allowed:
        return None
    return next(i for i, v in enumerate(values) if type(v) not in allowed)


def token_rows(value: object, where: str, num_tokens: int | None, unit: str, recorded: str,
               problems: Problems) -> tuple[list[int], tuple[int, int]] | None:
    """The frame of a per-token [layers][top-k] field (routed_experts, indexer_topk): an array of
    one row per token, null for a token the engine `recorded` none, every row the same rectangle of
    `unit`. The indices of the rows present and their (layers, k); None when every row is null or
    the frame is wrong (then the problem is added)."""
    if not isinstance(value, list):
        problems.add(where, f"must be an array (one [layers][top-k] array of {unit} per token), got {json_type(value)}")
        return None
    if num_tokens is not None and len(value) != num_tokens:
        problems.add(where, f"{len(value)} rows for {num_tokens} tokens (one [layers][top-k] row per token, "
                            f"null for a token the engine {recorded} none)")
        return None
    present = [i for i, row in enumerate(value) if row is not None]
    if not present:
        return None
    shape = _rectangle(value[present[0]])
    bad = next((i for i in present if _rectangle(value[i]) != shape), None) if shape else present[0]
    if bad is not None:
        expected = f"like token {present[0]}'s {layers_by_k(shape)}" if shape else \
            "a non-empty array of equally long non-empty arrays"
        problems.add(where, f"token {bad}: must be [layers][top-k] {unit} ({expected}), got {show(value[bad])}")
        return None
    return present, shape


def _rectangle(row: object) -> tuple[int, int] | None:
    """(layers, k) of one token's [layers][top-k] row, None when it is not such a rectangle."""
    if not isinstance(row, list) or not row or not all(isinstance(layer, list) for layer in row):
        return None
    k = len(row[0])
    return (len(row), k) if k and all(len(layer) == k for layer in row) else None


def check_same_rows(branches: list, field: str, why: str, problems: Problems) -> None:
    """Every segment's per-token `field` ([tokens, layers, k] once decoded) of one rollout has the
    same [layers][top-k]: one model made them (`why`, its words)."""
    first: tuple[str, tuple[int, ...]] | None = None
    for i, branch in enumerate(branches):
        for j, segment in enumerate(branch.segments if branch is not None else ()):
            rows = getattr(segment, field)
            if rows is None:
                continue
            where, shape = f"branches[{i}].segments[{j}].{field}", rows.shape[1:]
            if first is None:
                first = (where, shape)
            elif shape != first[1]:
                problems.add(where, f"{layers_by_k(shape)} per token, but {first[0]} has {layers_by_k(first[1])} "
                                    f"({why})")
