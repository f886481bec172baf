"""The command line's error boundary: what a command can anticipate becomes one paragraph, a bug a traceback.

Most user errors are refused where they are made, as an :class:`~rlrunbook.errors.RlrunbookError` naming the
value, the reason and the fix. This module is the net under them, for the classes a command can anticipate
but not always check first: the file system (a read-only or missing folder, a file in the way, a full disk),
text that is not UTF-8 or holds lone surrogates, JSON that does not parse, a corrupted safetensors file, the
network, memory. :func:`describe` turns each into one paragraph naming the cause, the path where the error
carries one (and the environment variable that chose it) and the fix: exit 2. Anything else is a bug:
:func:`report_bug` prints its traceback and one line saying where to report it: exit 70 (``EX_SOFTWARE``).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import traceback
from pathlib import Path

USER_ERROR = 2  # the exit status of a refused command (docs/cli.md)
BUG = 70  # sysexits' EX_SOFTWARE: an internal error, not a refusal

# Variables that choose where rlrunbook writes: an error under one of them names it.
PATH_VARIABLES = ("TINKER_LOCAL_STORAGE", "RLRUNBOOK_CACHE_DIR", "RLRUNBOOK_LOG_ROOT", "HF_HOME", "HF_DATASETS_CACHE",
                  "TMPDIR")
# Exceptions of these libraries' own modules are network failures (their names vary across versions).
_NETWORK_MODULES = ("httpx", "httpcore", "requests", "urllib3", "aiohttp")

_OS_REASONS = {
    errno.EACCES: ("permission denied", "make it writable (or readable) for this user, or choose another path"),
    errno.EPERM: ("operation not permitted", "make it writable for this user, or choose another path"),
    errno.EROFS: ("read-only file system", "choose a path on a writable file system"),
    errno.ENOSPC: ("no space left on the device", "free some space or choose a folder on another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free some space or choose a folder on another disk"),
    errno.ENOENT: ("no such file or directory", "check the path"),
    errno.EISDIR: ("it is a directory where a file was expected", "pass a file path"),
    errno.ENAMETOOLONG: ("the name is too long for the file system", "choose a shorter name or path"),
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n) or run fewer processes at once"),
}


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest ancestor of ``path`` that exists and is not a directory (a file where a folder must be)."""
    for candidate in Path(os.path.abspath(path)).parents:
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def _chosen_by(path: str) -> str:
    """`` (it lies under NAME=VALUE)`` when an environment variable of :data:`PATH_VARIABLES` chose ``path``."""
    absolute = os.path.abspath(path)
    for name in PATH_VARIABLES:
        value = os.environ.get(name)
        if value and (absolute == os.path.abspath(value) or absolute.startswith(os.path.abspath(value) + os.sep)):
            return f" (it lies under {name}={value}; set {name} to a usable folder)"
    return ""


def _describe_os_error(error: OSError) -> str | None:
    """A paragraph for a file-system error that names its path; None without one (then: network or a bug)."""
    path = error.filename
    if path is None:  # a write or read of an open file: the reason alone, where it is one of the anticipated
        if error.errno not in _OS_REASONS or error.errno in (errno.ENOENT, errno.EISDIR):
            return None
        reason, fix = _OS_REASONS[error.errno]
        return f"a file could not be written or read: {reason} ({error}). Fix: {fix}."
    path = os.fsdecode(path) if isinstance(path, bytes) else str(path)
    in_the_way = _file_in_the_way(Path(path))
    if error.errno in (errno.ENOTDIR, errno.EEXIST) and in_the_way is not None:
        reason, fix = f"{in_the_way} is a file, not a folder", "move that file or choose another path"
    elif error.errno == errno.ENOTDIR:
        reason, fix = "a part of the path is a file, not a folder", "choose another path"
    elif error.errno == errno.EEXIST:
        reason, fix = "it exists already", "remove it or choose another path"
    else:
        reason, fix = _OS_REASONS.get(error.errno, (error.strerror or type(error).__name__, "check the path"))
    return f"cannot use {path!r}: {reason}{_chosen_by(path)}. Fix: {fix}."


def _describe_unicode(error: UnicodeError) -> str:
    if isinstance(error, UnicodeDecodeError):
        byte = error.object[error.start:error.start + 1]
        return (f"text that is not UTF-8 ({error.encoding} cannot decode byte 0x{byte.hex()} at offset {error.start}: "
                f"{error.reason}). Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or pass another one.")
    if isinstance(error, UnicodeEncodeError) and "surrogates" in error.reason:
        bad = error.object[error.start:error.end]
        return (f"a value holds characters that are not valid Unicode (lone surrogates {bad!r} in "
                f"{error.object[:60]!r}): it usually comes from a command-line argument, file name or environment "
                "variable whose bytes are not UTF-8. Pass the value as UTF-8 text.")
    return f"text that cannot be encoded or decoded ({error}). Pass UTF-8 text."


def _is_network(error: BaseException) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    module = type(error).__module__.split(".")[0]
    if module in _NETWORK_MODULES:
        return True
    return module == "socket" or type(error).__name__ in ("gaierror", "herror")


def _describe_library(error: BaseException) -> str | None:
    """Errors of the libraries that load models, checkpoints and data: safetensors, tinker, Hugging Face."""
    kind, module = type(error).__name__, type(error).__module__.split(".")[0]
    if kind == "SafetensorError":
        return (f"a .safetensors file is corrupted or not a safetensors file ({error}). Fix: rebuild or re-download "
                "the model folder, or resume from another checkpoint.")
    if module == "tinker":
        return (f"the Tinker service (TINKER_BACKEND=api) failed: {kind}: {error}. Fix: check TINKER_API_KEY, "
                "TINKER_BASE_URL and the network, or unset TINKER_BACKEND to train on this machine.")
    if module == "tinker_cookbook" and kind == "ConfigurationError":  # a recipe's own check of its arguments
        return f"{error} Fix: change that recipe argument (its name=value on the command line)."
    if module == "huggingface_hub":
        return (f"the Hugging Face Hub could not give what was asked ({kind}: {error}). Fix: pass a local folder or "
                "file, or give network access (unset HF_HUB_OFFLINE) or fill the cache with `hf download`.")
    if kind in ("OutOfMemoryError",):
        return (f"the device ran out of memory ({error}). Fix: lower TINKER_LOCAL_MICRO_BATCH_TOKENS, the rows per "
                "step (-n) or --max-tokens; `rlrunbook show-config --memory-plan` predicts the peak.")
    return None


def describe(error: BaseException) -> str | None:
    """One paragraph naming the cause and the fix of an anticipated ``error``; None for a bug."""
    from rlrunbook.errors import RlrunbookError

    if isinstance(error, RlrunbookError):
        return str(error)
    library = _describe_library(error)
    if library is not None:
        return library
    if isinstance(error, OSError) and not _is_network(error):
        return _describe_os_error(error)
    if _is_network(error):
        return (f"a network call failed ({type(error).__name__}: {error}). Fix: check the network and the address "
                "it names, or work offline (local files, HF_HUB_OFFLINE=1, TINKER_BACKEND=local).")
    if isinstance(error, UnicodeError):
        return _describe_unicode(error)
    if isinstance(error, json.JSONDecodeError):
        return (f"a JSON file or value does not parse ({error.msg} at line {error.lineno}, column {error.colno}): "
                "it is truncated or not JSON. Fix: restore the file (a run's files are rewritten only whole).")
    if isinstance(error, RecursionError):
        return ("a value is nested too deeply to be read (RecursionError), e.g. a JSON or YAML document with "
                "thousands of nested lists. Fix: flatten the data, or check that the file is the one meant.")
    if isinstance(error, MemoryError):
        return ("this machine ran out of memory (MemoryError). Fix: use a smaller data set, fewer rows per step "
                "(-n) or shorter --max-tokens, or a machine with more memory.")
    return None


def issue_tracker() -> str:
    """Where bugs go: the package's ``Issues`` URL where its metadata names one, else the repository's tracker."""
    try:
        from importlib.metadata import metadata

        for entry in metadata("rlrunbook").get_all("Project-URL") or []:
            label, _, url = entry.partition(",")
            if label.strip().lower() in ("issues", "bug tracker", "tracker"):
                return url.strip()
    except Exception:  # noqa: BLE001 - no metadata (a source checkout) must not hide the bug being reported
        pass
    return "the rlrunbook repository's issue tracker"


def report_bug(error: BaseException) -> int:
    """Print ``error``'s traceback and one line saying it is a bug and where to report it; the exit status."""
    from rlrunbook import __version__

    try:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        print(f"This is a bug in rlrunbook {__version__} ({type(error).__name__}), not a mistake of yours: report "
              f"it with the command and this traceback at {issue_tracker()}.", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr is gone (a closed terminal): the exit status still says it
    return BUG


def refuse(message: str, prefix: str = "error") -> int:
    """Print ``message`` as the command's one ``error:`` paragraph; the exit status (2)."""
    try:
        print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    return USER_ERROR
