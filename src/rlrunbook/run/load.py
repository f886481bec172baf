"""Read a run directory for the rubric without ever raising.

Each file is loaded once into ``RunFiles``; a file that is missing, unreadable or not valid
JSON becomes a *problem* string naming it, which the presence checks report. The content checks
then look only at what loaded, so one corrupt file fails one check instead of all of them.
"""

from __future__ import annotations

import json
import re
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

    def expected_steps(self, prefix: str) -> list[int]:
        """0..steps-1, or (``steps`` unknown) the step numbers of the ``<prefix>_<k>.json`` files present."""
        if self.steps is not None:
            return list(range(self.steps))
        pattern = re.compile(rf"{re.escape(prefix)}_(\d+)\.json")
        found = (pattern.fullmatch(p.name) for p in self.run_dir.glob(f"{prefix}_*.json"))
        return sorted(int(m.group(1)) for m in found if m)


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


def _load_per_step(run: RunFiles, prefix: str, docs: dict[int, dict[str, Any]], problems: list[str]) -> None:
    for step in run.expected_steps(prefix):
        path = run.run_dir / f"{prefix}_{step}.json"
        doc, problem = read_json(path)
        if problem is None and not isinstance(doc, dict):
            problem = f"{path.name}: top level is {type(doc).__name__}, not an object"
        if problem is None:
            docs[step] = doc
        else:
            problems.append(problem)


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
