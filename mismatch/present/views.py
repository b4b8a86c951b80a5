"""Typed views of plain JSON that is not summary.json (the summary's sections are records of the
model itself: results/summary_model.py, results/section_records.py): `mismatch trend`'s answer
(present/trend.py).

A view names only the fields a reader shows. Each field defaults to "not recorded" (None, an empty
list or map), so an older answer reads as far as it goes; a field of the wrong type is one line
(`SectionError`), never a traceback.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from mismatch.errors import ResultsError

_V = TypeVar("_V")


class SectionError(ResultsError):
    """A section of summary.json whose field is not of the type a run writes."""


class View(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A reader's view of one open section: unknown keys ignored, every field optional."""


def view(data: Any, kind: type[_V], where: str, *, source: str = "summary.json") -> _V:
    """`data` (a section's plain JSON) as the view `kind`; `where` names the section of `source` in
    the error."""
    try:
        return msgspec.convert(data if data is not None else {}, kind, strict=False)
    except msgspec.ValidationError as error:
        raise SectionError(f"{source} {where}: {error}") from None
