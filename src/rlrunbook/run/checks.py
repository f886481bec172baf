"""Rubric checks of the run-level files (metadata, train log, report) and the helpers all checks share.

The per-step checks are in ``step_checks``, the rollout checks in ``rollout_checks``; the list
and its order are in ``rlrunbook.run.rubric``.

Each check is a pure function of ``RunFiles`` returning one ``CheckResult``. Presence checks
report missing and corrupt files; content checks look only at what loaded, so a failure names
one rule and the files/steps that broke it. A content check that finds nothing to look at fails:
a rubric never passes vacuously.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rlrunbook.run.liveness import liveness
from rlrunbook.run.load import RunFiles, format_steps, missing_ranges
from rlrunbook.run.schema import (
    METADATA_FILE,
    PNG_IEND,
    PNG_SIGNATURE,
    REPORT_FILE,
    SKIPPED_ROW_FLOAT_KEYS,
    SKIPPED_ROW_INT_KEYS,
    TRAIN_LOG_FILE,
    TRAIN_LOG_FLOAT_KEYS,
    TRAIN_LOG_INT_KEYS,
)

_MAX_LISTED = 5  # problems named in a detail; the rest are counted


@dataclass(frozen=True)
class CheckResult:
    """One rubric rule applied to a run directory; ``detail`` names the files/steps at fault."""

    name: str
    passed: bool
    detail: str


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (``json.loads`` accepts ``NaN``, so finiteness is checked here too)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def result(name: str, problems: list[str], ok_detail: str) -> CheckResult:
    """Pass with ``ok_detail`` when there are no problems; otherwise fail listing the first few."""
    if not problems:
        return CheckResult(name, True, ok_detail)
    listed = "; ".join(problems[:_MAX_LISTED])
    more = f" (+{len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
    return CheckResult(name, False, listed + more)


# --- run_metadata.json, train_log.jsonl, report.png -------------------------------------------------------


def metadata_readable(run: RunFiles) -> CheckResult:
    problems = [run.metadata_problem] if run.metadata_problem else []
    version = (run.metadata or {}).get("schema_version")
    return result("metadata.readable", problems, f"{METADATA_FILE} parsed (schema_version {version})")


def metadata_completed(run: RunFiles) -> CheckResult:
    if run.metadata is None:
        return CheckResult("metadata.completed", False, f"cannot read status: {run.metadata_problem}")
    status, error = run.metadata.get("status"), run.metadata.get("error")
    problems = []
    if status != "completed":
        judged, stale = liveness(run.metadata)
        why = {"running": " (unfinished: the run is still going)",
               "interrupted": " (stopped by Ctrl-C or SIGTERM; --resume-from continues it from its last checkpoint)",
               }.get(status, "")
        if stale:
            why = f" but it is {judged}: {stale}. --resume-from continues it from its last checkpoint"
        problems.append(
            f"{METADATA_FILE}: status is {status!r}{why}" + (f"; error: {error}" if error else "")
        )
    return result("metadata.completed", problems, "status completed")


def metadata_fields(run: RunFiles) -> CheckResult:
    if run.metadata is None:
        return CheckResult("metadata.fields", False, f"cannot read fields: {run.metadata_problem}")
    problems = [
        f"{METADATA_FILE}: {key} is missing or not an object"
        for key in ("config", "versions")
        if not isinstance(run.metadata.get(key), dict)
    ]
    if run.steps_problem and isinstance(run.metadata.get("config"), dict):
        problems.append(run.steps_problem)
    mode, env = run.config.get("mode"), run.config.get("env")
    if mode not in ("single_turn", "debate"):
        problems.append(f"{METADATA_FILE}: config.mode is {mode!r}, not 'single_turn' or 'debate'")
    if not isinstance(env, str) or not env:
        problems.append(f"{METADATA_FILE}: config.env is {env!r}, not a name")
    return result("metadata.fields", problems, f"mode {mode}, env {env}, {run.steps} steps")


def train_log(run: RunFiles) -> CheckResult:
    """One row per step 0..steps-1, in order, each with the schema's keys as finite numbers. The work is in
    the rows found, not in ``steps``: missing steps are named as ranges."""
    problems = list(run.train_log_problems)
    got = [row.get("step") for row in run.train_log_rows]
    if run.steps is None:
        problems.append(f"cannot check step coverage: {run.steps_problem}")
    elif not (len(got) == run.steps and all(is_int(s) and s == k for k, s in enumerate(got))):
        missing = missing_ranges((s for s in got if is_int(s)), run.steps)
        counts = Counter(repr(s) for s in got)  # repr: a step may be a list or an object
        extra = {repr(s): s for s in got if not (is_int(s) and 0 <= s < run.steps) or counts[repr(s)] > 1}
        shown = sorted(extra.values(), key=str)[:20]
        problems.append(
            f"{TRAIN_LOG_FILE}: expected steps 0..{run.steps - 1:,} once each in order, "
            f"found {len(got):,} rows, got {got[:20]}{'...' if len(got) > 20 else ''}"
            + (f"; missing {format_steps(missing)}" if missing else "")
            + (f"; extra or repeated {shown}{'...' if len(extra) > 20 else ''}" if extra else "")
        )
    for row in run.train_log_rows:
        skipped = row.get("skipped") is True  # dynamic sampling skipped it: no loss, no trained tokens
        int_keys, float_keys = ((SKIPPED_ROW_INT_KEYS, SKIPPED_ROW_FLOAT_KEYS) if skipped
                                else (TRAIN_LOG_INT_KEYS, TRAIN_LOG_FLOAT_KEYS))
        absent = [k for k in int_keys + float_keys if k not in row]
        bad = [k for k in int_keys if k in row and not is_int(row[k])] + [
            k for k in float_keys if k in row and not is_number(row[k])
        ]
        if skipped and not (isinstance(row.get("skip_reason"), str) and row["skip_reason"]):
            absent.append("skip_reason")
        if absent or bad:
            problems.append(
                f"{TRAIN_LOG_FILE} step {row.get('step')!r}: "
                + (f"missing {absent}" if absent else "")
                + (" " if absent and bad else "")
                + (f"not finite numbers / ints: {bad}" if bad else "")
            )
    return result("train_log", problems, f"{len(run.train_log_rows)} rows, steps 0..{len(got) - 1}")


def report_png(run: RunFiles) -> CheckResult:
    path = run.run_dir / REPORT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return CheckResult("report.png", False, f"{REPORT_FILE}: missing ({path})")
    except OSError as exc:
        return CheckResult("report.png", False, f"{REPORT_FILE}: unreadable ({exc})")
    problems = []
    if not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        problems.append(f"{REPORT_FILE}: not a PNG (no signature and IHDR header; {len(data)} bytes)")
    elif not data.endswith(PNG_IEND):
        problems.append(f"{REPORT_FILE}: truncated PNG (no IEND chunk at the end; {len(data)} bytes)")
    return result("report.png", problems, f"{REPORT_FILE}: valid PNG, {len(data)} bytes")
