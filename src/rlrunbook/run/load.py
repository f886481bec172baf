"""Read a run directory for the rubric without ever raising.

Each file is loaded once into ``RunFiles``; a file that is missing, unreadable or not valid
JSON becomes a *problem* string naming it, which the presence checks report. The content checks
then look only at what loaded, so one corrupt file fails one check instead of all of them.

The work is proportional to what is on disk, never to the step count ``run_metadata.json`` claims: only
the ``<prefix>_<k>.json`` files present are read, and the steps missing from them are kept as ranges
(:func:`missing_ranges`), so a config claiming a billion steps costs no more than the files it has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlrunbook.run.schema import METADATA_FILE, TRAIN_LOG_FILE, VALIDATION_FILE, rollout_kind


def read_json(path: Path) -> tuple[Any, str | None]:
    """``(document, None)``, or ``(None, problem)`` naming the file and what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, f"{path.name}: missing ({path})"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path.name}: unreadable ({exc})"
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"{path.name}: invalid JSON ({exc})"


@dataclass
class RunFiles:
    """Everything the rubric needs from one run directory, loaded leniently."""

    run_dir: Path
    metadata: dict[str, Any] | None = None
    metadata_problem: str | None = None
    # config["steps"], or None with the reason in steps_problem.
    steps: int | None = None
    steps_problem: str | None = None
    mode: str | None = None
    kind: str | None = None  # rollout file kind: baseline / summary / debate
    train_log_rows: list[dict[str, Any]] = field(default_factory=list)
    train_log_problems: list[str] = field(default_factory=list)
    step_docs: dict[int, dict[str, Any]] = field(default_factory=dict)
    step_problems: list[str] = field(default_factory=list)
    rollout_docs: dict[int, dict[str, Any]] = field(default_factory=dict)
    rollout_problems: list[str] = field(default_factory=list)
    # Steps that dynamic sampling skipped (marked in train_log.jsonl): no datums, no loss, by design.
    skipped_steps: set[int] = field(default_factory=set)
    # validation.jsonl, read only when the config turns validation on.
    validation_rows: list[dict[str, Any]] = field(default_factory=list)
    validation_problems: list[str] = field(default_factory=list)

    @property
    def config(self) -> dict[str, Any]:
        config = (self.metadata or {}).get("config")
        return config if isinstance(config, dict) else {}

    def present_steps(self, prefix: str) -> list[int]:
        """The step numbers of the ``<prefix>_<k>.json`` files present (``k`` written as the writer writes it:
        decimal, no leading zero), sorted; below ``steps`` when it is known."""
        pattern = re.compile(rf"{re.escape(prefix)}_(0|[1-9]\d*)\.json")
        try:
            found = {int(m.group(1)) for p in self.run_dir.glob(f"{prefix}_*.json") if (m := pattern.fullmatch(p.name))}
        except OSError:  # an unreadable directory: every expected file is then reported missing
            found = set()
        return sorted(k for k in found if self.steps is None or k < self.steps)


def _load_metadata(run: RunFiles) -> None:
    doc, problem = read_json(run.run_dir / METADATA_FILE)
    if problem is None and not isinstance(doc, dict):
        problem = f"{METADATA_FILE}: top level is {type(doc).__name__}, not an object"
    if problem is not None:
        run.metadata_problem = run.steps_problem = problem
        return
    run.metadata = doc
    steps = run.config.get("steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        run.steps = steps
    else:
        run.steps_problem = f"{METADATA_FILE}: config.steps is {steps!r}, not a positive int"
    mode, env = run.config.get("mode"), run.config.get("env")
    if mode in ("single_turn", "debate") and isinstance(env, str):
        run.mode, run.kind = mode, rollout_kind(mode, env)


def _load_jsonl(path: Path, rows: list[dict[str, Any]], problems: list[str]) -> None:
    name = path.name
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        problems.append(f"{name}: missing ({path})")
        return
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{name}: unreadable ({exc})")
        return
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:  # typically the last line of a run killed mid-write
            problems.append(f"{name} line {number}: invalid JSON ({exc})")
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            problems.append(f"{name} line {number}: not an object")


def _load_train_log(run: RunFiles) -> None:
    _load_jsonl(run.run_dir / TRAIN_LOG_FILE, run.train_log_rows, run.train_log_problems)
    run.skipped_steps = {row["step"] for row in run.train_log_rows
                         if row.get("skipped") is True and isinstance(row.get("step"), int)}


def missing_ranges(found: Iterable[int], stop: int) -> list[range]:
    """The runs of ``0..stop-1`` that ``found`` leaves out, in order: ``missing_ranges([0, 1, 5], 8)`` is
    ``[range(2, 5), range(6, 8)]``. Costs O(len(found)), whatever ``stop`` is."""
    gaps, at = [], 0
    for step in sorted({k for k in found if 0 <= k < stop}):
        if step > at:
            gaps.append(range(at, step))
        at = step + 1
    return gaps + ([range(at, stop)] if at < stop else [])


def format_steps(gaps: list[range], listed: int = 20) -> str:
    """The steps of ``gaps`` as a list (``[1, 2, 5]``) when they are at most ``listed``, else as ranges
    (``2..999,999,999``; the first five, then a count of the others)."""
    if sum(map(len, gaps)) <= listed:
        return str([k for gap in gaps for k in gap])
    spans = [f"{gap[0]:,}" if len(gap) == 1 else f"{gap[0]:,}..{gap[-1]:,}" for gap in gaps[:5]]
    return ", ".join(spans) + (f" (+{len(gaps) - 5:,} more ranges)" if len(gaps) > 5 else "")


_LISTED_MISSING = 5  # a run of missing files up to this long is named file by file, a longer one as a range


def _missing_files(run: RunFiles, prefix: str, gap: range, found: int) -> list[str]:
    if len(gap) <= _LISTED_MISSING:
        return [f"{prefix}_{k}.json: missing ({run.run_dir / f'{prefix}_{k}.json'})" for k in gap]
    return [(f"{prefix}_<k>.json: missing for steps {gap[0]:,}..{gap[-1]:,} ({len(gap):,} files; config.steps is "
             f"{run.steps:,}, {found:,} such files found)")]


def _load_per_step(run: RunFiles, prefix: str, docs: dict[int, dict[str, Any]], problems: list[str]) -> None:
    """Read the ``<prefix>_<k>.json`` files present; with ``steps`` known, report the absent ones below it, in
    step order with the unreadable ones (long runs of absent files as one range each)."""
    present = run.present_steps(prefix)
    gaps = iter(missing_ranges(present, run.steps) if run.steps is not None else [])
    gap = next(gaps, None)
    for step in present:
        while gap is not None and gap[0] < step:
            problems.extend(_missing_files(run, prefix, gap, len(present)))
            gap = next(gaps, None)
        path = run.run_dir / f"{prefix}_{step}.json"
        doc, problem = read_json(path)
        if problem is None and not isinstance(doc, dict):
            problem = f"{path.name}: top level is {type(doc).__name__}, not an object"
        if problem is None:
            docs[step] = doc
        else:
            problems.append(problem)
    for rest in ([gap] if gap is not None else []) + list(gaps):
        problems.extend(_missing_files(run, prefix, rest, len(present)))


def load_run(run_dir: str | Path) -> RunFiles:
    """Load every artifact the rubric checks; never raises for a malformed directory."""
    run = RunFiles(run_dir=Path(run_dir))
    _load_metadata(run)
    _load_train_log(run)
    if validation_every(run) > 0:
        _load_jsonl(run.run_dir / VALIDATION_FILE, run.validation_rows, run.validation_problems)
    _load_per_step(run, "training_step", run.step_docs, run.step_problems)
    if run.kind is not None:
        _load_per_step(run, run.kind, run.rollout_docs, run.rollout_problems)
    return run


def validation_every(run: RunFiles) -> int:
    """``config.validation.every`` (0 when absent or malformed: validation off)."""
    section = run.config.get("validation")
    every = section.get("every") if isinstance(section, dict) else None
    return every if isinstance(every, int) and not isinstance(every, bool) and every > 0 else 0
