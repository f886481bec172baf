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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlrunbook.errors import InputError

REDACTED = "<redacted>"


class _Unjsonable(Exception):
    """Raised deep in a document; collects the key path while unwinding, so paths cost nothing on success."""

    def __init__(self, value: Any, reason: str):
        super().__init__(reason)
        self.value, self.reason, self.path = value, reason, []


def redact_text(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every occurrence of each secret replaced by ``REDACTED``."""
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def _convert(value: Any, secrets: Sequence[str]) -> Any:
    if isinstance(value, str):
        return redact_text(value, secrets) if secrets else value
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Unjsonable(value, "artifacts hold finite numbers only")
        return value
    if isinstance(value, (list, tuple)):
        # Fast path for the token, logprob and advantage arrays that make up most of a step.
        if all(type(x) is int for x in value):
            return list(value)
        if all(type(x) is float for x in value) and all(map(math.isfinite, value)):
            return list(value)
        out = []
        for i, item in enumerate(value):
            try:
                out.append(_convert(item, secrets))
            except _Unjsonable as bad:
                bad.path.insert(0, f"[{i}]")
                raise
        return out
    if isinstance(value, Mapping):
        converted = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Unjsonable(key, f"key of type {type(key).__name__}: JSON keys must be str")
            try:
                converted[key] = _convert(item, secrets)
            except _Unjsonable as bad:
                bad.path.insert(0, f"[{key!r}]")
                raise
        return converted
    # numpy scalars/arrays and torch tensors all have .tolist(), which returns Python scalars or
    # nested lists; duck typing keeps numpy and torch out of this module's imports.
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return _convert(tolist(), secrets)
    if isinstance(value, Path):
        return str(value)
    raise _Unjsonable(
        value,
        f"type {type(value).__name__} has no JSON form; convert it to a number, string, list or dict first",
    )


def to_jsonable(value: Any, where: str = "value", secrets: Sequence[str] = ()) -> Any:
    """A plain-JSON copy of ``value``: numpy/torch scalars and arrays become Python numbers and lists,
    and every occurrence of a string in ``secrets`` is replaced by ``REDACTED``.

    A NaN or infinite number, a non-str key or an object without a JSON form raises ``InputError``
    naming its path, ``where`` (the document) first: ``training_step_3.json['training_data'][0]['loss']``.
    """
    try:
        return _convert(value, secrets)
    except _Unjsonable as bad:
        hint = (
            " (find the step that produced it: a 0/0 mean, an empty batch, an overflow)"
            if isinstance(bad.value, float)
            else ""
        )
        raise InputError(f"{where}{''.join(bad.path)} is {bad.value!r}: {bad.reason}{hint}") from None


def dumps(value: Any, where: str = "value", indent: int | None = None, secrets: Sequence[str] = ()) -> str:
    """Strict JSON text of ``value`` (see ``to_jsonable``)."""
    return json.dumps(to_jsonable(value, where, secrets), indent=indent, allow_nan=False)


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


def atomic_write_json(
    path: Path, value: Any, where: str | None = None, indent: int | None = None, secrets: Sequence[str] = ()
) -> None:
    """Validate ``value`` completely, then write it as JSON atomically.

    ``indent`` suits small documents people read (metadata); leave it None for step files, where
    it would switch ``json`` to its pure-Python encoder and put every token id on its own line.
    """
    # Serialise before opening anything: a NaN deep inside must not leave a temp file.
    text = dumps(value, where or Path(path).name, indent=indent, secrets=secrets)
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
