"""Protobuf text format for Triton's ``config.pbtxt``: quoting strings, and a schema-less reader.

``clika_runtime.triton`` parses configs with Triton's own schema (tritonclient's
``model_config_pb2``) when tritonclient is installed. This reader is the fallback, so that the
library never needs tritonclient at run time: it knows no schema, so every field maps to the list of
its values in order (a message is a dict of the same form, a number an int or float, an enum name
or ``true``/``false`` a str). It reads what ``clika_runtime.triton`` writes and the usual hand-written
forms (``key: value``, ``key { ... }``, ``key: [ ... ]``, ``#`` comments).
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import text_encoding

Tree = dict[str, list[Any]]

_TOKEN = re.compile(
    r"""(?P<skip>\s+|\#[^\n]*)
      | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
      | (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)
      | (?P<word>[A-Za-z_][\w.]*)
      | (?P<punct>[{}\[\]:,;<>])""",
    re.VERBOSE,
)
_CLOSE = {"{": "}", "<": ">"}


def quote(text: str) -> str:
    """``text`` as a text-format string literal (quotes and backslashes escaped, UTF-8 kept)."""
    return '"' + text_encoding.CEscape(text, as_utf8=True) + '"'


def parse(text: str) -> Tree:
    """Parse a text-format message into ``{field: [values]}``; ``ValueError`` names the line."""
    tokens = _Tokens(text)
    return _message(tokens, end=None)


class _Tokens:
    def __init__(self, text: str) -> None:
        self._items: list[tuple[str, str, int]] = []
        position, line = 0, 1
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None:
                raise ValueError(f"line {line}: unexpected character {text[position]!r}")
            if match.lastgroup != "skip":
                self._items.append((match.lastgroup, match.group(), line))
            line += match.group().count("\n")
            position = match.end()
        self._next = 0

    def peek(self) -> str | None:
        return self._items[self._next][1] if self._next < len(self._items) else None

    def take(self, expected: str | None = None) -> tuple[str, str, int]:
        """The next token as (kind, text, line); ``expected``: the text it must be."""
        if self._next == len(self._items):
            raise ValueError(f"unexpected end of text{f', expected {expected!r}' if expected else ''}")
        kind, value, line = self._items[self._next]
        if expected is not None and value != expected:
            raise ValueError(f"line {line}: expected {expected!r}, got {value!r}")
        self._next += 1
        return kind, value, line

    def accept(self, value: str) -> bool:
        if self.peek() == value:
            self._next += 1
            return True
        return False


def _message(tokens: _Tokens, end: str | None) -> Tree:
    fields: Tree = {}
    while tokens.peek() != end:
        kind, name, line = tokens.take()
        if kind != "word":
            raise ValueError(f"line {line}: expected a field name, got {name!r}")
        tokens.accept(":")  # optional before a message
        fields.setdefault(name, []).extend(_values(tokens))
        if not tokens.accept(","):  # fields may end with ',' or ';'
            tokens.accept(";")
    if end is not None:
        tokens.take(end)
    return fields


def _values(tokens: _Tokens) -> list[Any]:
    if not tokens.accept("["):
        return [_value(tokens)]
    items: list[Any] = []
    while not tokens.accept("]"):
        items.append(_value(tokens))
        if tokens.peek() != "]":
            tokens.take(",")
    return items


def _value(tokens: _Tokens) -> Any:
    kind, text, line = tokens.take()
    if text in _CLOSE:
        return _message(tokens, _CLOSE[text])
    if kind == "string":
        return text_encoding.CUnescape(text[1:-1]).decode("utf-8")
    if kind == "number":
        return float(text) if any(c in text for c in ".eE") else int(text)
    if kind == "word":
        return text
    raise ValueError(f"line {line}: expected a value, got {text!r}")
