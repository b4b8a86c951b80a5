"""JSON with the bare words NaN, Infinity and -Infinity (Python's json writes a non-finite float so),
read by msgspec and written back byte for byte.

Inside `mismatch record`'s dialects: a server may write a sampled token's log-prob as one of these
words, which no JSON parser but Python's takes. `quote` turns each into a unique string literal so
msgspec decodes the answer (its values kept as raw bytes), `unquote` turns them back in what the
harness gets, and `logprob` reads a value as the number it was (null and junk: None).
"""

from __future__ import annotations

import math
import re

# A string no server writes: a NUL then our name. `quote` refuses a text that holds it already.
_MARK = b'"\\u0000mismatch:'
_WORDS = {b"NaN": math.nan, b"Infinity": math.inf, b"-Infinity": -math.inf}
_QUOTED = {word: _MARK + word + b'"' for word in _WORDS}
_VALUES = {("\x00mismatch:" + word.decode()): value for word, value in _WORDS.items()}
# A string literal (skipped whole: the words inside one are text), or a bare word.
_TOKEN = re.compile(rb'"(?:[^"\\]++|\\.)*+"|-?Infinity|NaN', re.DOTALL)


def quote(data: bytes) -> bytes | None:
    """`data` with every bare word a string literal; None when it holds our mark already (then
    the words could not be told from the server's own strings)."""
    if _MARK in data:
        return None
    return _TOKEN.sub(lambda found: _QUOTED.get(found.group(), found.group()), data)


def unquote(data: bytes) -> bytes:
    """The bare words back where `quote` put string literals."""
    for word, quoted in _QUOTED.items():
        data = data.replace(quoted, word)
    return data


def logprob(value: object) -> float | None:
    """A sampled log-prob as the server wrote it: a number (NaN and ±inf included, from a quoted
    word); None for null, and for anything else a log-prob cannot be (a string, a bool, a list)."""
    if isinstance(value, str):
        return _VALUES.get(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer past float64: no log-prob either
        return None
