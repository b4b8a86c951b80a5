"""A tiny HTML builder that escapes by construction: text is escaped, only `Html` passes through.

Every string from a results dir (rollout ids, specs, recommendation prose) reaches the static part
of the page through `el`, so nothing from the data is ever parsed as markup.
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape
from typing import Any

VOID_TAGS = frozenset({"br", "hr", "img", "input", "link", "meta", "wbr"})


class Html(str):
    """Markup that is already safe: built by `el`, or one of our own constant strings."""


def render(child: Any) -> str:
    """Children to markup: Html as is, text escaped, iterables joined, None/False dropped."""
    if child is None or child is False:
        return ""
    if isinstance(child, Html):
        return child
    if isinstance(child, str):
        return escape(child, quote=True)
    if isinstance(child, (int, float)):
        return escape(str(child))
    if isinstance(child, Iterable):
        return "".join(render(c) for c in child)
    return escape(str(child), quote=True)


def _attribute(name: str, value: Any) -> str:
    # class_ -> class, data_fig -> data-fig: Python keywords and dashes in keyword arguments.
    name = name.rstrip("_").replace("_", "-")
    if value is True:
        return f" {name}"
    return f' {name}="{escape(str(value), quote=True)}"'


def el(tag: str, *children: Any, **attrs: Any) -> Html:
    attributes = "".join(_attribute(k, v) for k, v in attrs.items() if v is not None and v is not False)
    if tag in VOID_TAGS:
        return Html(f"<{tag}{attributes}>")
    return Html(f"<{tag}{attributes}>{render(children)}</{tag}>")


def join(*parts: Any) -> Html:
    return Html(render(parts))
