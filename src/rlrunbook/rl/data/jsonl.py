"""Reading JSONL data files against a small schema, with errors that point at the bad line.

A schema maps each required field to the type it must have: a plain type (``str``), ``list[str]``
for a list whose items all have one type, or a tuple of these meaning "any of" (``(str, int)``).
Fields not named in the schema are allowed and kept. ``bool`` never passes for ``int`` or
``float`` although Python makes it a subclass: ``"answer": true`` in a data file is a mistake.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rlrunbook.rl.data.errors import DatasetError
from rlrunbook.rl.data.limits import MAX_INT_DIGITS, MAX_JSON_DEPTH, MAX_LINE_BYTES

# Values are a type, ``list[X]`` (a types.GenericAlias, not a `type`) or a tuple of these; typed
# as Any because no annotation says "a type or a generic alias" on Python 3.10.
Schema = Mapping[str, Any]


def read_jsonl(path: str | Path, schema: Schema) -> list[dict]:
    """Every row of the JSONL file ``path``, each checked against ``schema``; blank lines are skipped.

    Raises ``DatasetError`` naming the file (and the 1-based line) when the file is missing or is
    a directory, holds no rows, a line is not JSON, a row is not an object, or a field is
    missing or has the wrong type.
    """
    return [row for _, row in read_jsonl_lines(path, schema)]


def read_jsonl_lines(path: str | Path, schema: Schema) -> list[tuple[int, dict]]:
    """Like ``read_jsonl`` but each row comes with its 1-based line number, for later checks to cite."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file. Check the path, or pass a hub name such as "
                           "'openai/gsm8k' with the 'data' extra installed.")
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory, expected a .jsonl file. Pass the file inside it.")
    if not path.is_file():  # a FIFO would block the read until something writes to it; a device never ends
        raise DatasetError(f"{path}: is not a regular file (a pipe, socket or device), expected a .jsonl file. "
                           "Write the rows to a file and pass its path.")
    rows = list(iter_rows(path))
    if not rows:
        raise DatasetError(f"{path}: contains no rows. Expected one JSON object per line with "
                           f"fields {describe_schema(schema)}.")
    for line_no, row in rows:
        check_row(row, schema, where=f"{path}: line {line_no}")
    return rows


def iter_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """The 1-based line number and the object of each non-blank line of ``path``, read one line at a time.

    Lines end at ``\\n`` (or ``\\r\\n``) only: U+2028 and U+0085 are characters of a JSON string, not line
    breaks. ``DatasetError`` naming the line for a line that is too long, not UTF-8, not JSON, not an object,
    nested too deep or holding too large an integer (the limits of :mod:`rlrunbook.rl.data.limits`).
    """
    try:
        with path.open("rb") as file:
            line_no = 0
            while raw := file.readline(MAX_LINE_BYTES + 1):
                line_no += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise DatasetError(f"{path}: line {line_no}: longer than {MAX_LINE_BYTES:,} bytes, the limit "
                                       "of one row. A JSONL file holds one JSON object per line: check that this "
                                       "is the data file, or split the row.")
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DatasetError(f"{path}: line {line_no}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                                       f"column {exc.start + 1}). Save the file as UTF-8 JSONL.") from None
                if line.strip():
                    yield line_no, parse_row(line, f"{path}: line {line_no}")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot be read ({exc.strerror or exc}). Pass a readable UTF-8 JSONL "
                           "file, one JSON object per line.") from None


class _TooLarge(ValueError):
    """An integer literal of more than ``MAX_INT_DIGITS`` digits (raised from inside ``json.loads``)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.digits = len(text.lstrip("-"))


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _TooLarge(text)
    return int(text)


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_row(line: str, where: str) -> dict:
    """One JSONL line as a JSON object; ``DatasetError`` prefixed by ``where`` when it is not one or passes
    a limit of :mod:`rlrunbook.rl.data.limits`."""
    try:
        row = json.loads(line, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: is not valid JSON ({exc.msg} at column {exc.colno}). Each line must "
                           "hold one complete JSON object.") from None
    except _TooLarge as exc:
        raise DatasetError(f"{where}: holds an integer of {exc.digits:,} digits, above the limit of "
                           f"{MAX_INT_DIGITS} (64 bits); ids and counts need fewer. Fix the row.") from None
    except RecursionError:
        depth = MAX_JSON_DEPTH + 1  # deeper than Python's JSON reader goes, far beyond the limit
    else:
        depth = _depth(row)
    if depth > MAX_JSON_DEPTH:
        raise DatasetError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep (arrays or objects inside one "
                           "another), the limit of a row; these data sets nest two. Fix the row.")
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: is {_describe_value(row)}, expected a JSON object such as "
                           "{\"question\": ..., \"answer\": ...}.")
    return row


def first_row(path: Path) -> dict | None:
    """The first row of ``path``; None when it has none or its first line is malformed (the loader then
    reports that line). Reads one line, within the limits."""
    try:
        return next(iter_rows(path), (0, None))[1]
    except DatasetError:
        return None


def check_row(row: Mapping[str, Any], schema: Schema, *, where: str) -> None:
    """Raise ``DatasetError`` (prefixed by ``where``) if ``row`` lacks a schema field or has a wrong type."""
    for name, expected in schema.items():
        if name not in row:
            present = ", ".join(sorted(map(repr, row))) or "none"
            raise DatasetError(f"{where}: missing field {name!r} (fields present: {present}). "
                               f"Every row needs {describe_schema(schema)}.")
        value = row[name]
        if not _matches(value, expected):
            raise DatasetError(f"{where}: field {name!r} is {_describe_value(value)}, expected "
                               f"{_type_name(expected)}. Fix the row or pass the right data set.")


def describe_schema(schema: Schema) -> str:
    """``{"question": str, "answer": list[str]}`` as ``'question' (str), 'answer' (list of str)``."""
    return ", ".join(f"{name!r} ({_type_name(t)})" for name, t in schema.items())


def _matches(value: Any, expected: Any) -> bool:
    if isinstance(expected, tuple):
        return any(_matches(value, option) for option in expected)
    if typing.get_origin(expected) is list:
        (item_type,) = typing.get_args(expected)
        return isinstance(value, list) and all(_matches(item, item_type) for item in value)
    if isinstance(value, bool) and expected is not bool:
        return False
    return isinstance(value, expected)


def _type_name(expected: Any) -> str:
    if isinstance(expected, tuple):
        return " or ".join(_type_name(option) for option in expected)
    if typing.get_origin(expected) is list:
        return f"list of {_type_name(typing.get_args(expected)[0])}"
    return _JSON_NAMES.get(expected, getattr(expected, "__name__", repr(expected)))


def _describe_value(value: Any) -> str:
    shown = json.dumps(value, ensure_ascii=False)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    kind = _json_kind(value)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({shown})"


_JSON_NAMES = {str: "str", int: "int", float: "float", bool: "bool", list: "list", dict: "object",
               type(None): "null"}


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    for python_type, name in ((str, "string"), (int, "int"), (float, "float"), (list, "list"),
                              (dict, "object"), (type(None), "null")):
        if isinstance(value, python_type):
            return name
    return type(value).__name__
