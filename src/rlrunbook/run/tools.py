"""Tools over finished (or killed) run directories: summary tables, packaging with checksums, secret scans.

All of them only read the run directory. A malformed directory is reported, never raised on:
``summarize_runs`` gives it a row with status "unreadable" and the reason, ``verify_package`` and
``find_secrets`` return problem strings. Symlinks are never followed (a run directory written by
``RunWriter`` holds none, so one is foreign and may point anywhere), and the writer's atomic-write
temp files (``.<name>.*.tmp``) are left out of packages: they are half-written by definition.
"""

from __future__ import annotations

import csv
import fnmatch
import hashlib
import io
import json
import math
import os
import re
import stat
import tarfile
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlrunbook.errors import ConfigError, InputError
from rlrunbook.run.jsonio import atomic_write_text, fsync_dir
from rlrunbook.run.liveness import liveness
from rlrunbook.run.load import RunFiles, _load_metadata, _load_train_log
from rlrunbook.run.redaction import MIN_SCRUB_LENGTH, is_secret_key, is_secret_name
from rlrunbook.run.secret_scan import redact_name, scan_file, scan_name

MANIFEST_FILE = "MANIFEST.sha256"
# Fixed column order, so tables of different sweeps line up and diff cleanly.
COLUMNS = ("run", "status", "mode", "env", "model", "seed", "steps", "steps_logged",
           "reward_first", "reward_last", "task_reward_first", "task_reward_last", "task_reward_best",
           "loss_last", "trained_tokens", "step_time_mean_s", "dataset_fingerprint",
           "started_at", "finished_at", "problems")
TERMINAL_COLUMNS = ("run", "status", "mode", "env", "model", "steps_logged", "reward_first", "reward_last",
                    "task_reward_best", "loss_last", "trained_tokens", "step_time_mean_s", "dataset_fingerprint",
                    "problems")
# What the terminal table prints under itself: its two kinds of empty cell.
TERMINAL_LEGEND = ("-: not recorded (no step logged it); problems: what reading the run found wrong (a stale "
                   "process, the run's error, unreadable log lines), none: nothing; fingerprints cut to 12 characters")
CREDENTIAL_FILE_PATTERNS = (".netrc", "_netrc", "credentials*", "*.pem", "*.key", "*.p12", "*.pfx", "*.ppk", ".env",
                            ".env.*", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".git-credentials", ".npmrc",
                            ".pypirc", ".pgpass", ".htpasswd", ".dockercfg", "*.keystore", "*.jks", "*.kdbx")
# Files whose name alone says nothing but whose place does: a tool's login store (Docker keeps registry passwords
# base64-encoded in .docker/config.json; kubectl keeps tokens and keys in .kube/config).
CREDENTIAL_FILE_PLACES = ("*/.docker/config.json", ".docker/config.json", "*/.kube/config", ".kube/config")
# A file named for a token (`token`, `.hf_token`, `api-token.txt`), not for token ids (`tokens.json`, `tokenizer.json`).
_TOKEN_FILE = re.compile(r"(?:.*[._-])?token", re.IGNORECASE)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a file swapped for a symlink after the walk is refused


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    values = (row.get(key) for row in rows)
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def summarize_run(run_dir: Path) -> dict[str, Any]:
    """One table row for ``run_dir`` (keys: ``COLUMNS``); status "unreadable" plus the reason if broken."""
    run_dir = Path(run_dir)
    row: dict[str, Any] = {**dict.fromkeys(COLUMNS), "run": run_dir.absolute().name}
    run = RunFiles(run_dir=run_dir)
    _load_metadata(run)  # the rubric's lenient loader: a missing or broken file becomes a problem string
    metadata = run.metadata
    if metadata is None:
        return {**row, "status": "unreadable", "problems": run.metadata_problem}
    _load_train_log(run)
    rows, problems = run.train_log_rows, list(run.train_log_problems)
    dataset = metadata.get("dataset")
    row.update({key: run.config.get(key) for key in ("mode", "env", "model", "seed", "steps")})
    status, why = liveness(metadata)  # "stale" for a "running" run whose process is gone (kill -9)
    if why:
        problems.insert(0, f"stale: {why}")
    row.update(status=status, started_at=metadata.get("started_at"),
               finished_at=metadata.get("finished_at"), steps_logged=len(rows),
               dataset_fingerprint=dataset.get("fingerprint") if isinstance(dataset, dict) else None)
    for name in ("reward", "task_reward"):
        values = _series(rows, f"{name}/mean")
        row[f"{name}_first"], row[f"{name}_last"] = (values[0], values[-1]) if values else (None, None)
    task, losses, times = (_series(rows, k) for k in ("task_reward/mean", "loss/sum", "time/step_s"))
    row.update(task_reward_best=max(task, default=None), loss_last=losses[-1] if losses else None,
               trained_tokens=int(sum(_series(rows, "num_trained_tokens"))) if rows else None,
               step_time_mean_s=sum(times) / len(times) if times else None)
    if metadata.get("error"):
        problems.insert(0, f"error: {metadata['error']}")
    row["problems"] = "; ".join(problems) or None
    return row


def summarize_runs(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """One row per run directory, in the order given (see ``COLUMNS`` and ``summarize_run``)."""
    return [summarize_run(Path(d)) for d in run_dirs]


def _cell(value: Any, precise: bool) -> str:
    if value is None:
        return "" if precise else "-"
    if isinstance(value, float):
        return repr(value) if precise else f"{value:.4g}"
    return str(value)


def _terminal_cell(row: Mapping[str, Any], column: str) -> str:
    value = row.get(column)
    if column == "problems" and not value:
        return "none"
    if column == "dataset_fingerprint" and isinstance(value, str):
        return value[:12]
    return _cell(value, precise=False)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] = TERMINAL_COLUMNS) -> str:
    """An aligned plain-text table of ``rows`` (numbers to 4 significant digits) for the terminal."""
    cells = [list(columns)] + [[_terminal_cell(row, c) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in cells)
    return "\n".join(line.rstrip() for line in lines)


def write_table(rows: Sequence[Mapping[str, Any]], out: Path, columns: Sequence[str] | None = None) -> Path:
    """Write ``rows`` atomically as CSV, TSV (``.tsv``) or a Markdown table (``.md``), by ``out``'s suffix.

    Columns: ``columns`` if given, else ``COLUMNS`` (the run summary's) first, then any other keys sorted.
    CSV/TSV keep full float precision.
    """
    out, suffix = Path(out), Path(out).suffix.lower()
    if columns is None:
        columns = list(COLUMNS) + sorted({key for row in rows for key in row} - set(COLUMNS))
    if suffix in (".csv", ".tsv"):
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter="\t" if suffix == ".tsv" else ",", lineterminator="\n")
        writer.writerows([columns] + [[_cell(row.get(c), precise=True) for c in columns] for row in rows])
        text = buffer.getvalue()
    elif suffix == ".md":
        def line(values: Sequence[str]) -> str:
            return "| " + " | ".join(v.replace("|", "\\|").replace("\n", " ") for v in values) + " |"

        body = [line([_cell(row.get(c), precise=False) for c in columns]) for row in rows]
        text = "\n".join([line(columns), line(["---"] * len(columns)), *body]) + "\n"
    else:
        raise ConfigError(f"table file {out} has suffix {out.suffix!r}: use .csv, .tsv or .md")
    atomic_write_text(out, text)
    return out


def _walk(root: Path) -> list[tuple[str, os.stat_result]]:
    """``(relative posix path, lstat)`` of every entry under ``root``, sorted by path (a directory before
    its contents); symlinked directories are listed, not entered."""
    paths = [Path(current) / name for current, dirs, files in os.walk(root) for name in dirs + files]
    return sorted((path.relative_to(root).as_posix(), path.lstat()) for path in paths)


def package_run(run_dir: Path, out: Path | None = None, overwrite: bool = False) -> Path:
    """Archive ``run_dir`` as ``<run_dir>.tar.gz`` (or ``out``) with a ``MANIFEST.sha256`` inside.

    The manifest (sorted relative paths, ``<sha256>  <size>  <path>`` per file) goes into the
    archive's copy of the directory only; ``run_dir`` is not modified. Symlinks and other non-regular
    files are left out with a warning, temp files silently. The archive is written to a temp file and
    renamed, so ``out`` is absent or complete; an existing ``out`` is kept unless ``overwrite``.
    """
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise InputError(f"run directory {run_dir} does not exist or is not a directory")
    out = Path(out).resolve() if out is not None else run_dir.with_name(run_dir.name + ".tar.gz")
    if out.is_relative_to(run_dir):
        raise ConfigError(f"archive {out} lies inside the run directory it packages: put it elsewhere")
    if out.is_dir():  # --overwrite would try to replace a directory with the archive
        raise ConfigError(f"--out {out} is a directory; it names the archive file. Pass a file path, e.g. "
                          f"--out {out / (run_dir.name + '.tar.gz')}.")
    exists = ConfigError(f"archive {out} already exists: pass overwrite=True (--overwrite) or another --out")
    if out.exists() and not overwrite:
        raise exists
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w:gz") as tar:
                manifest = _add_tree(tar, run_dir).encode("utf-8")
                info = tarfile.TarInfo(f"{run_dir.name}/{MANIFEST_FILE}")
                info.size, info.mode = len(manifest), 0o644
                tar.addfile(info, io.BytesIO(manifest))
            raw.flush()
            os.fsync(raw.fileno())
        if overwrite:
            os.replace(tmp, out)
        else:
            try:
                os.link(tmp, out)  # fails if out appeared meanwhile: no check-then-replace race
            except OSError:  # that, or a file system without hard links
                if out.exists():
                    raise exists from None
                os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_dir(out.parent)
    return out


def _add_tree(tar: tarfile.TarFile, run_dir: Path) -> str:
    """Add the directories and regular files of ``run_dir`` to ``tar``; return the manifest text."""
    tar.add(run_dir, arcname=run_dir.name, recursive=False)
    lines = []
    for rel, info in _walk(run_dir):
        name = Path(rel).name
        if stat.S_ISDIR(info.st_mode):
            tar.add(run_dir / rel, arcname=f"{run_dir.name}/{rel}", recursive=False)
        elif not stat.S_ISREG(info.st_mode):
            warnings.warn(f"{run_dir / rel}: a symlink or special file, left out", stacklevel=3)
        elif not (name.startswith(".") and name.endswith(".tmp")) and rel != MANIFEST_FILE:  # old one: redone
            with open(os.open(run_dir / rel, os.O_RDONLY | _NOFOLLOW), "rb") as handle:
                member = tar.gettarinfo(fileobj=handle, arcname=f"{run_dir.name}/{rel}")
                data = handle.read()  # read once: hash and archive the same bytes, even of a growing file
            member.size, member.uname, member.gname = len(data), "", ""
            tar.addfile(member, io.BytesIO(data))
            lines.append(f"{hashlib.sha256(data).hexdigest()}  {len(data)}  {rel}\n")
    return "".join(lines)


def verify_package(archive: Path) -> list[str]:
    """Extract ``archive`` to a temp dir and check it against its manifest; the problems (empty: ok)."""
    with tempfile.TemporaryDirectory(prefix="rlrunbook-verify-") as tmp:
        try:
            with tarfile.open(archive, mode="r:gz") as tar:
                members = tar.getmembers()
                tops = {m.name.split("/")[0] for m in members}
                if len(tops) != 1:
                    return [f"{archive}: expected one top-level run directory, found {sorted(tops)}"]
                unsafe = [m.name for m in members if not (m.isfile() or m.isdir()) or _escapes(m.name)]
                if unsafe:
                    return [f"{name}: unsafe member (link, device, absolute or '..' path)" for name in unsafe]
                if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12: a second guard on top of the check
                    tar.extractall(tmp, filter="data")
                else:
                    tar.extractall(tmp)
        except (OSError, tarfile.TarError, EOFError) as exc:
            return [f"{archive}: cannot be read as a .tar.gz ({exc.__class__.__name__}: {exc})"]
        return _check_manifest(Path(tmp) / tops.pop())


def _escapes(rel: str) -> bool:
    return rel.startswith("/") or ".." in rel.split("/")


def _check_manifest(root: Path) -> list[str]:
    try:
        lines = (root / MANIFEST_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{MANIFEST_FILE}: missing or unreadable ({exc})"]
    problems, listed = [], set()
    for number, line in enumerate(lines, start=1):
        digest, size, rel = [*line.split("  ", 2), "", ""][:3]
        if len(digest) != 64 or not size.isdigit() or not rel or _escapes(rel):
            problems.append(f"{MANIFEST_FILE} line {number}: not '<sha256>  <size>  <path>': {line!r}")
            continue
        listed.add(rel)
        if not (root / rel).is_file():
            problems.append(f"{rel}: listed in the manifest but missing from the archive")
            continue
        data = (root / rel).read_bytes()
        if len(data) != int(size):
            problems.append(f"{rel}: size {len(data)} differs from {size} in the manifest")
        if hashlib.sha256(data).hexdigest() != digest:
            problems.append(f"{rel}: sha256 differs from the manifest (modified after packaging)")
    problems += [f"{rel}: in the archive but not in the manifest" for rel, info in _walk(root)
                 if stat.S_ISREG(info.st_mode) and rel != MANIFEST_FILE and rel not in listed]
    return problems


def is_credentials_file(name: str) -> bool:
    """Whether a file name is one that holds credentials: ``CREDENTIAL_FILE_PATTERNS`` (``.netrc``, ``*.pem``,
    ``.git-credentials``, ``.npmrc``, ``.pypirc``, PuTTY's ``*.ppk``, ...), a name for a token (``token``,
    ``.hf_token``, ``api-token.txt``), or a secret-named stem (``api_key.txt``, ``client_secret.json``)."""
    lower = name.lower()
    stem = lower.lstrip(".").split(".", 1)[0]
    return (any(fnmatch.fnmatch(lower, pattern) for pattern in CREDENTIAL_FILE_PATTERNS)
            or _TOKEN_FILE.fullmatch(stem) is not None or is_secret_key(stem.replace("-", "_")))


def find_secrets(run_dir: Path, environ: Mapping[str, str]) -> list[str]:
    """Files of ``run_dir`` holding a secret: named like credentials (:func:`is_credentials_file`), holding the
    value of a secret-named variable, or holding a private key, an API-token-shaped string or a URL with a
    password (``run.secret_scan``, by line), as plain text or compressed, base64 or UTF-16 (``run.secret_forms``);
    and files, directories (the run directory too) and links whose *name* holds such a value or shape
    (``run.secret_scan.scan_name``): an archive would carry the name in its member list and its manifest.

    Secret names and the minimum value length are the writer's (``*_KEY``, ``*_TOKEN``, ``*SECRET*``,
    ``*PASSWORD*``, ``*CREDENTIAL*``, any case). A finding is ``<relative path>: <VARIABLE>``,
    ``<relative path>: credentials file``, ``<relative path>:<line>: <kind>`` or ``<relative path>: <kind> in
    its name``, never the value: a path is shown with the secrets in its names redacted (``<redacted>.txt``).
    Values are also sought JSON-escaped: JSON writes non-ASCII as ``\\uXXXX`` and a quote as ``\\"``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return [f"{run_dir}: not a directory, nothing scanned"]
    needles = {name: {value.encode("utf-8"), json.dumps(value)[1:-1].encode("utf-8")}
               for name, value in environ.items() if is_secret_name(name) and len(value) >= MIN_SCRUB_LENGTH}
    top = run_dir.resolve().name  # the archive's top-level folder
    findings = [f"{redact_name(top, needles)} (the run directory): {kind} in its name"
                for kind in scan_name(top, needles)]
    shown: dict[str, str] = {"": ""}  # relative path -> the same with secret names redacted; parents come first
    for rel, info in _walk(run_dir):
        parent, _, name = rel.rpartition("/")
        kinds = scan_name(name, needles)
        shown[rel] = at = (shown[parent] + "/" if parent else "") + (redact_name(name, needles) if kinds else name)
        findings += [f"{at}: {kind} in its name" for kind in kinds]
        if is_credentials_file(name) or any(fnmatch.fnmatch(rel, place) for place in CREDENTIAL_FILE_PLACES):
            findings.append(f"{at}: credentials file")
        if stat.S_ISREG(info.st_mode):
            try:
                if needles:
                    findings += [f"{at}: {variable}" for variable in sorted(_scan(run_dir / rel, needles))]
                findings += [str(finding) for finding in scan_file(run_dir / rel, at, needles)]
            except OSError as exc:  # the reason only: the error's own text repeats the path, unredacted
                findings.append(f"{at}: not scanned ({exc.__class__.__name__}: {exc.strerror or 'unreadable'})")
    return findings


def _scan(path: Path, needles: Mapping[str, set[bytes]], chunk: int = 1 << 20) -> set[str]:
    """Names whose value occurs in ``path``, read in chunks that overlap by the longest value's length."""
    found: set[str] = set()
    tail, overlap = b"", max(len(form) for forms in needles.values() for form in forms)
    with open(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as handle:
        while block := handle.read(chunk):
            window = tail + block
            found.update(name for name, forms in needles.items() if any(form in window for form in forms))
            tail = window[-overlap:]
    return found
