"""A trainer's run script as the command line it launches: bash `NAME=( ... )` arrays expanded into
the launch line (`python train.py ${MODEL_ARGS[@]} ...`), backslash continuations joined, words split
as the shell splits them (`shlex`). OpenRLHF's and slime's example scripts are written this way."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from mismatch.errors import SpecError

ARRAY = re.compile(r"^[ \t]*([A-Za-z_]\w*)=\(", re.M)
REFERENCE = re.compile(r"^\$\{([A-Za-z_]\w*)\[[@*]\]\}$")  # ${NAME[@]}: the whole array


def command_line(path: Path, text: str, launcher: re.Pattern[str]) -> tuple[list[str], tuple[str, ...]]:
    """The launched program's argv as the file gives it, and the arrays it names but lacks: the line
    `launcher` finds, its `${NAME[@]}` replaced by each `NAME=( ... )` array; without that line, the
    arrays in order; without arrays either, the whole file as one command line."""
    arrays = {match[1]: _array(path, text, match) for match in ARRAY.finditer(text)}
    line = launcher.search(text)
    if line is None:
        if arrays:
            return [token for tokens in arrays.values() for token in tokens], ()
        return _tokens(path, text.replace("\\\n", " \n"), 1), ()
    rest = text[line.end():]
    end = re.search(r"(?<!\\)\n", rest)
    first = text.count("\n", 0, line.end()) + 1
    argv, unread = [], []
    for token in _tokens(path, rest[:end.start() if end else None].replace("\\\n", " "), first):
        name = REFERENCE.match(token)
        if name is None:
            argv.append(token)
        elif name[1] in arrays:
            argv += arrays[name[1]]
        else:
            unread.append(name[1])
    return argv, tuple(unread)


def _array(path: Path, text: str, match: re.Match) -> list[str]:
    """The tokens of one `NAME=( ... )` block, up to its closing parenthesis."""
    line = text.count("\n", 0, match.end()) + 1
    lexer = shlex.shlex(text[match.end():], posix=True, punctuation_chars="()")
    lexer.whitespace_split = True
    tokens = []
    try:
        for token in iter(lexer.get_token, None):
            if token == ")":
                return tokens
            tokens.append(token)
    except ValueError as exc:
        raise SpecError(f"{path}:{line}: {match[1]}=(: invalid shell syntax: {exc}") from None
    raise SpecError(f"{path}:{line}: {match[1]}=(: the array is not closed")


def _tokens(path: Path, text: str, first_line: int) -> list[str]:
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    try:
        return list(iter(lexer.get_token, None))
    except ValueError as exc:
        raise SpecError(f"{path}:{first_line}: invalid shell syntax: {exc}") from None


def flag_value(argv: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The value of `flag` in an argv (`--flag VALUE` or `--flag=VALUE`, the last one given), None if absent."""
    found = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif token.startswith(flag + "="):
            found = token.partition("=")[2]
    return found
