"""``RunWriter``: the only code that writes a run directory (schema: see ``rlrunbook.run``).

The training loop hands it plain dicts; the writer validates numbers (finite, JSON-able),
writes every JSON file atomically and appends train-log lines durably, so a run killed at any
point leaves a directory the rubric can read: complete files, a ``"running"`` status.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rlrunbook.errors import InputError
from rlrunbook.run import metadata as meta
from rlrunbook.run.jsonio import atomic_write_json, atomic_write_text, dumps, redact_text, to_jsonable
from rlrunbook.run.liveness import HEARTBEAT_S, process_record
from rlrunbook.run.redaction import redact_argv, redact_config, scrub_credentials, secret_config_values
from rlrunbook.run.schema import (
    FINAL_STATUSES,
    METADATA_FILE,
    REPORT_FILE,
    ROLLOUT_KINDS,
    SCHEMA_VERSION,
    TRAIN_LOG_FILE,
    VALIDATION_FILE,
)
from rlrunbook.run.wandb_sink import WandbSink


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _check_step(step: Any, where: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InputError(f"{where}: step {step!r} must be a non-negative int")
    return step


def _with_step(step: int, payload: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``payload`` with ``"step": step`` first; a payload that names another step is a caller bug."""
    _check_step(step, where)
    if "step" in payload and payload["step"] != step:
        raise InputError(f"{where}: payload says step {payload['step']!r} but was written as step {step}")
    return {"step": step, **{k: v for k, v in payload.items() if k != "step"}}


class RunWriter:
    """Writes the artifact trail of one run into ``run_dir`` (which must exist; see ``new_run_dir``)."""

    def __init__(self, run_dir: str | os.PathLike[str], environ: Mapping[str, str] | None = None,
                 sink: WandbSink | None = None):
        """``sink`` (see ``wandb_sink.from_environ``) mirrors the metadata's config and every logged row."""
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise InputError(f"run directory {self.run_dir} does not exist: create it with new_run_dir()")
        # The environment is read once, here, not deep inside each write.
        self._environ = dict(os.environ if environ is None else environ)
        self._secrets = meta.secret_values(self._environ)
        self._metadata: dict[str, Any] | None = None
        self._sink = sink
        # run_metadata.json is rewritten by the heartbeat thread too: one lock around every change and write.
        self._metadata_lock = threading.Lock()
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def metadata_path(self) -> Path:
        return self.run_dir / METADATA_FILE

    @property
    def train_log_path(self) -> Path:
        return self.run_dir / TRAIN_LOG_FILE

    @property
    def validation_path(self) -> Path:
        return self.run_dir / VALIDATION_FILE

    def _write(self, name: str, payload: Any, indent: int | None = None) -> Path:
        path = self.run_dir / name
        # Secret values are cut out of every document: a prompt or a config echo can carry them too.
        atomic_write_json(path, payload, where=name, indent=indent, secrets=self._secrets)
        return path

    def write_metadata(
        self,
        config: Mapping[str, Any],
        config_sources: Mapping[str, str],
        argv: list[str],
        dataset: Mapping[str, Any],
        resumed_from: Mapping[str, Any] | None = None,
        world_size: int = 1,
    ) -> Path:
        """Write ``run_metadata.json`` with status "running" (see the package docstring for its fields).

        ``resumed_from`` (a resumed run only): the checkpoint it started from, ``{"path", "run", "step"}``.
        """
        # The values of secret config keys (extra.api_key), and config values holding a credential under any key
        # (extra.openai_key=sk-...), are scrubbed from everything written from now on.
        self._secrets = sorted({*self._secrets, *secret_config_values(config)}, key=len, reverse=True)
        self._metadata = {
            "schema_version": SCHEMA_VERSION,
            "status": "running",
            "started_at": _utc_now(),
            "finished_at": None,
            "error": None,
            "config": redact_config(config),
            "config_sources": dict(config_sources),
            "argv": redact_argv(list(argv), self._secrets),
            "versions": meta.package_versions(),
            "git": meta.git_state(),
            "hardware": meta.hardware(),
            "seeds": meta.seeds(config),
            "environment": meta.filtered_environment(self._environ),
            "dataset": redact_config(dataset),
        }
        self._metadata["world_size"] = world_size  # processes of a data-parallel (torchrun) run; 1 otherwise
        if resumed_from is not None:
            self._metadata["resumed_from"] = dict(resumed_from)
        # Who runs it, and a heartbeat: how a reader tells a live run from one killed with kill -9 (run.liveness).
        self._metadata["process"] = process_record()
        self._metadata["heartbeat_at"] = _utc_now()
        path = self._write_metadata_file()
        if self._sink is not None:
            self._sink.start(self.run_dir.name, to_jsonable(self._metadata["config"], "config", self._secrets))
        self._start_heartbeat()
        return path

    def _write_metadata_file(self, **changes: Any) -> Path:
        with self._metadata_lock:
            self._metadata.update(changes)
            return self._write(METADATA_FILE, self._metadata, indent=1)

    def _start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            return

        def beat() -> None:
            while not self._heartbeat_stop.wait(HEARTBEAT_S):
                try:
                    self._write_metadata_file(heartbeat_at=_utc_now())
                except (OSError, InputError):  # the directory went away (a test's tmp dir): nothing left to mark
                    return

        self._heartbeat = threading.Thread(target=beat, name="rlrunbook-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        """Stop refreshing ``heartbeat_at`` (``finish`` does it first, so no beat lands after the final status)."""
        self._heartbeat_stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join()

    def finish(self, status: str, error: str | None = None) -> Path:
        """Mark the run "completed", "failed" or "interrupted" (with ``error``) and stamp ``finished_at``."""
        if status not in FINAL_STATUSES:
            raise InputError(f"finish status {status!r} must be one of {FINAL_STATUSES}")
        self.stop_heartbeat()
        if self._metadata is None:
            # A writer recreated after a crash of the process that started the run.
            try:
                self._metadata = json.loads(self.metadata_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise InputError(
                    f"cannot finish {self.metadata_path}: {exc}; call write_metadata() first"
                ) from exc
        now = _utc_now()
        error = None if error is None else scrub_credentials(error)  # a message can quote a URL with its password
        path = self._write_metadata_file(status=status, finished_at=now, heartbeat_at=now, error=error)
        if self._sink is not None:
            self._sink.finish(status)
        return path

    def record_refused_step(self, record: Mapping[str, Any]) -> Path:
        """Add ``refused_step`` (the step a guard refused: step, quantity, value, cause) to the metadata.

        The run's status stays "running" until ``finish``; the record survives it.
        """
        if self._metadata is None:
            raise InputError("record_refused_step before write_metadata(): the run has no metadata yet")
        _check_step(record.get("step"), "refused_step")
        return self._write_metadata_file(refused_step=dict(record))

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        """Append one row to ``train_log.jsonl`` and fsync it, so a crash loses at most the current step."""
        self._append(self.train_log_path, metrics, prefix="")

    def log_validation(self, metrics: Mapping[str, Any]) -> None:
        """Append one row to ``validation.jsonl`` (``step``: optimizer steps applied before it), durably."""
        self._append(self.validation_path, metrics, prefix="val/")

    def _append(self, path: Path, row: Mapping[str, Any], prefix: str) -> None:
        _check_step(row.get("step"), f"{path.name} row")
        line = dumps(row, f"{path.name} step {row['step']}", secrets=self._secrets)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if self._sink is not None:
            self._sink.log(json.loads(line), step=row["step"], prefix=prefix)

    def write_step(self, step: int, payload: Mapping[str, Any]) -> Path:
        """Write ``training_step_<step>.json``: the step's datums and the trainer's results."""
        name = f"training_step_{step}.json"
        return self._write(name, _with_step(step, payload, name))

    def write_rollouts(self, kind: str, step: int, payload: Mapping[str, Any]) -> Path:
        """Write ``<kind>_<step>.json`` (kind: baseline, summary or debate): the step's rollout records."""
        if kind not in ROLLOUT_KINDS:
            raise InputError(f"rollout kind {kind!r} must be one of {ROLLOUT_KINDS}")
        name = f"{kind}_{step}.json"
        return self._write(name, _with_step(step, payload, name))

    def copy_steps_from(self, source: str | os.PathLike[str], steps: int, kind: str) -> None:
        """Start a resumed run with ``source``'s records of steps ``0..steps-1``: its train-log rows, and its
        ``training_step_<k>.json`` and ``<kind>_<k>.json`` files copied unchanged. ``source`` is only read.

        ``InputError`` if ``source`` lacks any of them or one is unreadable (see :func:`step_records`).
        """
        source = Path(source)
        rows, names = step_records(source, steps, kind)
        for name in names:  # copied with this run's secrets scrubbed, like everything it writes
            atomic_write_text(self.run_dir / name, redact_text((source / name).read_text(encoding="utf-8"),
                                                               self._secrets))
        for step in range(steps):
            self.log_step(rows[step])
        for row in _read_rows(source / self.validation_path.name):  # validations up to the checkpoint
            if row.get("step", steps + 1) <= steps:
                self.log_validation(row)

    def read_train_log(self) -> list[dict[str, Any]]:
        """The rows of ``train_log.jsonl`` written so far."""
        return _read_rows(self.train_log_path)

    def read_validation(self) -> list[dict[str, Any]]:
        """The rows of ``validation.jsonl`` written so far (none when validation is off)."""
        return _read_rows(self.validation_path)

    def write_report(self) -> Path:
        """Plot ``report.png`` from the train log (see ``rlrunbook.run.report``)."""
        from rlrunbook.run.report import plot_report  # matplotlib only when a report is drawn

        path = self.run_dir / REPORT_FILE
        plot_report(self.read_train_log(), path, title=self.run_dir.name, validation_rows=self.read_validation())
        return path


def step_records(source: Path, steps: int, kind: str,
                 complete: bool = True) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The train-log rows of steps ``0..steps-1`` of the run in ``source`` and the names of its step files that a
    resumed run copies. ``InputError`` naming the file (and line) and the fix when one is not UTF-8 or does not
    parse, or (``complete``) is missing: checked before a resumed run starts (``plan_resume``), and again when
    it copies them."""
    rows: dict[int, dict[str, Any]] = {}
    log = source / TRAIN_LOG_FILE
    names = [name for step in range(steps) for name in (f"training_step_{step}.json", f"{kind}_{step}.json")]
    fix = "Resume from an earlier checkpoint, or restore the run's files."
    path = log
    try:
        lines = log.read_text(encoding="utf-8").split("\n") if log.is_file() else []
        for path in (source / name for name in names):
            if path.is_file():
                json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{path}, a record of the steps before {steps}, cannot be read ({error}). {fix}") from None
    except ValueError as error:
        raise InputError(f"{path} is not readable JSON ({error}): a resumed run starts with a copy of it. "
                         f"{fix}") from None
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as error:
                raise InputError(f"{log} line {number} is not readable JSON ({error}): a resumed run starts with "
                                 f"the rows of the steps before {steps}. {fix}") from None
            if isinstance(row, dict):
                rows.setdefault(row.get("step"), row)
    missing = [f"{TRAIN_LOG_FILE} row {s}" for s in range(steps) if s not in rows]
    missing += [name for name in names if not (source / name).is_file()]
    if missing and complete:
        raise InputError(f"{source} lacks the records of steps before {steps} ({', '.join(missing[:3])}): "
                         "a resumed run starts with copies of them. Resume from an earlier checkpoint.")
    return rows, names


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
