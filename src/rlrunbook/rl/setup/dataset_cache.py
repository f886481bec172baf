"""``--cache-dataset``: a normalised, fingerprinted JSONL copy of a task's problems that later runs train from.

The first run with ``data.cache`` loads the source (file, hub set or generator) as usual, writes
the normalised records to ``<cache dir>/<source key>-<fingerprint>.jsonl`` atomically, reads that
file back and trains on what it read. Later runs with the same source and options find the file
by its source key and never touch the source again: it may change, move or vanish, and the run
still gets the same problems and the same fingerprint. The cache pins the data; to pick up a
changed source, delete the file.

- **Source key**: the first 16 hex digits of the sha256 of ``{format, env, dataset, seed, options}``
  (a dataset that is a path is made absolute). Seed and options are always part of it, although
  only some tasks' data depend on them (``qa test``): a needless miss costs one load, a wrong hit
  would train on other data.
- **Fingerprint**: ``fingerprint_records`` of the records, the same number ``run_metadata.json``
  records for an uncached run.
- **File**: a header line ``{"rlrunbook_dataset_cache": 1, "fingerprint", "source_fingerprint",
  "rows", "source"}``, then one record per line (``{"kind": "QARecord", "id", "question",
  "answers", "solution"}`` or ``{"kind": "SummaryRecord", "id", "document", "highlights"}``),
  each checked against its schema with errors naming the line.
- **A damaged cache is refused, not rebuilt**: if the records no longer hash to the fingerprint in
  the file's name and header, loading raises ``DatasetError`` naming the file; delete it and
  the next run rebuilds it from the source. Rebuilding silently would change the data of a run
  that asked for pinned data.

The default directory is ``datasets/`` under the model cache (``$RLRUNBOOK_CACHE_DIR``, else
``~/.cache/rlrunbook``); ``data.cache_dir`` replaces it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rlrunbook.errors import ConfigError, InputError
from rlrunbook.models.cache import default_cache_dir
from rlrunbook.rl.data import DatasetError, QARecord, SummaryRecord, fingerprint_records
from rlrunbook.rl.data.jsonl import Schema, check_row, read_jsonl_lines
from rlrunbook.rl.rollout.tasks import Problem, Task
from rlrunbook.rl.setup.config import DataSettings
from rlrunbook.run.jsonio import atomic_write_text

CACHE_FORMAT = 1
HEADER_KEY = "rlrunbook_dataset_cache"
HEADER_SCHEMA: Schema = {HEADER_KEY: int, "fingerprint": str, "source_fingerprint": str, "rows": int}
RECORD_TYPES: dict[str, tuple[type, Schema]] = {
    "QARecord": (QARecord, {"kind": str, "id": str, "question": str, "answers": list[str], "solution": str}),
    "SummaryRecord": (SummaryRecord, {"kind": str, "id": str, "document": str, "highlights": str}),
}


def cache_dir(settings: DataSettings) -> Path:
    """Where cached data sets live: ``data.cache_dir``, else ``<model cache>/datasets``."""
    if settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    return default_cache_dir() / "datasets"


def source_description(task: Task) -> dict[str, Any]:
    """What identifies a task's problems before they are loaded: task, data set, seed and options."""
    dataset = task.dataset
    if os.sep in dataset or dataset.endswith(".jsonl") or Path(dataset).expanduser().exists():
        dataset = os.path.abspath(os.path.expanduser(dataset))
    return {"format": CACHE_FORMAT, "env": task.name, "dataset": dataset, "seed": task.seed,
            "options": task.options}


def source_key(description: dict[str, Any]) -> str:
    text = json.dumps(description, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _record_row(problem: Problem) -> dict[str, Any]:
    record = problem.record
    if type(record).__name__ not in RECORD_TYPES or not dataclasses.is_dataclass(record):
        raise ConfigError(f"data.cache stores QARecord and SummaryRecord problems; this task's records are "
                          f"{type(record).__name__}. Drop --cache-dataset for this task.")
    if problem.id != record.id:
        raise ConfigError(f"data.cache needs problem ids equal to record ids (problem {problem.id!r} holds "
                          f"record {record.id!r}). Drop --cache-dataset for this task.")
    return {"kind": type(record).__name__, **dataclasses.asdict(record)}


def write_cache(path: Path, problems: list[Problem], source: dict[str, Any], loaded_from: str | None = None) -> None:
    """Write ``problems`` as a cache file (header + one record per line), atomically. ``loaded_from``: where the
    task read them (``Task.loaded_from``), kept so that a run served from the cache names the same source."""
    rows = [_record_row(p) for p in problems]
    fingerprint = fingerprint_records([p.record for p in problems])
    header = {HEADER_KEY: CACHE_FORMAT, "fingerprint": fingerprint, "source_fingerprint": fingerprint,
              "rows": len(rows), "source": source}
    if loaded_from is not None:
        header["loaded_from"] = loaded_from
    lines = [json.dumps(row, ensure_ascii=False, sort_keys=True) for row in (header, *rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n")


def read_cache(path: Path) -> tuple[list[Problem], dict[str, Any]]:
    """The problems of a cache file and its header; ``DatasetError`` naming the line or the damage."""
    lines = read_jsonl_lines(path, {})
    header_line, header = lines[0]
    check_row(header, HEADER_SCHEMA, where=f"{path}: line {header_line} (header)")
    if header[HEADER_KEY] != CACHE_FORMAT:
        raise DatasetError(f"{path}: cache format {header[HEADER_KEY]}, this rlrunbook reads {CACHE_FORMAT}. "
                           "Delete the file; the next run with --cache-dataset rebuilds it.")
    problems = []
    for line_no, row in lines[1:]:
        where = f"{path}: line {line_no}"
        kind = row.get("kind")
        if kind not in RECORD_TYPES:
            raise DatasetError(f"{where}: field 'kind' is {kind!r}, expected one of {sorted(RECORD_TYPES)}. "
                               "Delete the file; the next run with --cache-dataset rebuilds it.")
        record_type, schema = RECORD_TYPES[kind]
        check_row(row, schema, where=where)
        fields = {f.name: row[f.name] for f in dataclasses.fields(record_type)}
        if record_type is QARecord:
            fields["answers"] = tuple(fields["answers"])
        try:
            record = record_type(**fields)
        except InputError as exc:
            raise DatasetError(f"{where}: {exc}") from exc
        problems.append(Problem(record.id, record))
    actual = fingerprint_records([p.record for p in problems])
    named = path.stem.rpartition("-")[2]
    if actual != header["fingerprint"] or actual != named or len(problems) != header["rows"]:
        raise DatasetError(
            f"{path}: its {len(problems)} records have fingerprint {actual}, but the cache was written with "
            f"{header['rows']} records of fingerprint {header['fingerprint']} (file name: {named}): the file was "
            "edited or damaged. Delete it; the next run with --cache-dataset rebuilds it from the source.")
    return problems, header


def load_problems(task: Task, settings: DataSettings) -> list[Problem]:
    """``task.load()``, or with ``settings.cache`` the cached copy (written first if absent).

    Sets ``task.cache_info`` (recorded under ``dataset.cache`` in run_metadata.json): the cache
    file, whether this run ``wrote`` or ``loaded`` it, and the fingerprints of the source's
    records and of the records read from the file.
    """
    if not settings.cache:
        return task.load()
    source = source_description(task)
    key = source_key(source)
    root = cache_dir(settings)
    found = sorted(root.glob(f"{key}-*.jsonl")) if root.is_dir() else []
    if len(found) > 1:
        raise DatasetError(f"{root}: {len(found)} cache files for one source ({', '.join(p.name for p in found)}). "
                           "Delete all but one (or all: the next run rebuilds the cache).")
    if found:
        path, status = found[0], "loaded"
    else:
        loaded = task.load()
        if task.embedded_source is not None:  # a stand-in for data it could not reach: never pinned as that data
            task.notices.append(f"--cache-dataset: not caching {task.embedded_source}; a later run with the "
                                "real data set must not be served this one.")
            return loaded
        path, status = root / f"{key}-{fingerprint_records([p.record for p in loaded])}.jsonl", "written"
        write_cache(path, loaded, source, task.loaded_from)
    problems, header = read_cache(path)  # a fresh cache is read back too: both runs train on the file
    if isinstance(header.get("loaded_from"), str):
        task.loaded_from = header["loaded_from"]
    task.cache_info = {"path": str(path), "status": status, "source_key": key,
                       "source_fingerprint": header["source_fingerprint"],
                       "cached_fingerprint": fingerprint_records([p.record for p in problems])}
    return problems
