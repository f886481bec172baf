"""Strict, atomic JSON for the run directory.

Every artifact is read by the rubric and by people, possibly while the run is still going or
after it was killed. So a file is either absent or complete (temp file in the same directory,
fsync, ``os.replace``), and every number is finite: ``json.dumps`` would happily write ``NaN``,
which is not JSON and which hides the bug that produced it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlrunbook.errors import InputError


def to_jsonable(value: Any, where: str = "value") -> Any:
    """A plain-JSON copy of ``value``; numpy/torch scalars and arrays become Python numbers and lists.

    ``where`` is the path of ``value`` in the enclosing document, used to name the offending key
    when a number is NaN or infinite or a value has no JSON form.
    """
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InputError(f"{where} is {value}: artifacts hold finite numbers only; "
                             "find the step that produced it (a 0/0 mean, an empty batch, an overflow)")
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InputError(f"{where} has key {key!r} of type {type(key).__name__}: JSON keys must be str")
            out[key] = to_jsonable(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item, f"{where}[{i}]") for i, item in enumerate(value)]
    # numpy scalars/arrays and torch tensors all have .tolist(), which returns Python scalars or
    # nested lists; duck typing keeps numpy and torch out of this module's imports.
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return to_jsonable(tolist(), where)
    if isinstance(value, Path):
        return str(value)
    raise InputError(f"{where} has type {type(value).__name__}, which has no JSON form; "
                     "convert it to a number, string, list or dict first")


def dumps(value: Any, where: str = "value", indent: int | None = None) -> str:
    """Strict JSON text of ``value`` (see ``to_jsonable``)."""
    return json.dumps(to_jsonable(value, where), indent=indent, allow_nan=False)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Leave no half-written temp file behind (the rubric and `ls` would see it).
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, value: Any, where: str | None = None) -> None:
    """Validate ``value`` completely, then write it as indented JSON atomically."""
    # Serialise before opening anything: a NaN deep inside must not leave a temp file.
    text = dumps(value, where or Path(path).name, indent=1)
    atomic_write_text(path, text + "\n")


def fsync_dir(directory: Path) -> None:
    """Persist a rename: without it a crash can lose the directory entry of a replaced file."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms without directory fds (Windows): the rename is as durable as it gets
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
