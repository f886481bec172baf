"""Reading JSONL data files against a small schema, with errors that point at the bad line.

A schema maps each required field to the type it must have: a plain type (``str``), ``list[str]``
for a list whose items all have one type, or a tuple of these meaning "any of" (``(str, int)``).
Fields not named in the schema are allowed and kept. ``bool`` never passes for ``int`` or
``float`` although Python makes it a subclass: ``"answer": true`` in a data file is a mistake.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rlrunbook.rl.data.errors import DatasetError

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
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot be read as UTF-8 text ({exc}). "
                           "Pass a UTF-8 JSONL file, one JSON object per line.") from exc
    rows = list(_parse_lines(path, text.splitlines()))
    if not rows:
        raise DatasetError(f"{path}: contains no rows. Expected one JSON object per line with "
                           f"fields {describe_schema(schema)}.")
    for line_no, row in rows:
        check_row(row, schema, where=f"{path}: line {line_no}")
    return rows


def _parse_lines(path: Path, lines: Iterable[str]) -> Iterator[tuple[int, dict]]:
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: line {line_no}: is not valid JSON ({exc.msg} at column "
                               f"{exc.colno}). Each line must hold one complete JSON object.") from exc
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: line {line_no}: is {_describe_value(row)}, expected a JSON "
                               "object such as {\"question\": ..., \"answer\": ...}.")
        yield line_no, row


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
