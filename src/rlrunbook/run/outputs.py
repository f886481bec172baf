"""Where a command that writes elsewhere may not write: into a run directory's own files.

``eval --out``, ``summarize --out``, ``eval-checkpoints --out`` and ``package --out`` write one file of
their own. Pointed at ``RUN/run_metadata.json`` such a write would replace that run's record without a
word, so :func:`check_not_a_run_file` refuses, before any work, a path inside a run directory (a folder
holding ``run_metadata.json``, found through symbolic links) that is one of the run's files: anything under
its ``checkpoints/``, a name the run writes (its metadata, logs, step and rollout records, report), or any
file already there. A new file of another name beside the run's files stays allowed.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from rlrunbook.errors import ConfigError
from rlrunbook.run.schema import METADATA_FILE, REPORT_FILE, ROLLOUT_KINDS, TRAIN_LOG_FILE, VALIDATION_FILE

# The names a run writes at its top level (checkpoints/ is the run's as a whole).
RUN_FILE_PATTERNS = (METADATA_FILE, TRAIN_LOG_FILE, VALIDATION_FILE, REPORT_FILE, "training_step_*.json",
                     *(f"{kind}_*.json" for kind in ROLLOUT_KINDS), "checkpoints")


def enclosing_run(path: str | os.PathLike[str]) -> Path | None:
    """The nearest folder above ``path`` (symbolic links resolved) that holds ``run_metadata.json``, or None."""
    for folder in Path(os.path.realpath(path)).parents:
        if (folder / METADATA_FILE).is_file():
            return folder
    return None


def check_not_a_run_file(path: str | os.PathLike[str], flag: str = "--out") -> None:
    """``ConfigError`` naming the run and the file when writing ``path`` would replace something of a run."""
    run = enclosing_run(path)
    if run is None:
        return
    target = Path(os.path.realpath(path))
    relative = target.relative_to(run)
    top = relative.parts[0]
    if not (target.exists() or os.path.lexists(path)
            or any(fnmatch.fnmatchcase(top, pattern) for pattern in RUN_FILE_PATTERNS)):
        return
    raise ConfigError(f"{flag} {str(path)!r} is {relative} of the run {run}: writing it would replace that run's "
                      f"own record. Write elsewhere, e.g. {flag} {str(run.parent / (run.name + '_' + target.name))!r}.")
