"""Rubric check of ``validation.jsonl``, applied when the run's config has ``validation.every > 0``.

``validation``: one row per scheduled validation (``schema.validation_schedule``: steps 0, every
multiple of ``every``, and the last), in order; each with its problem and sample counts matching
the config, a finite mean reward with an ordered interval, ``pass@k`` in [0, 1] with an ordered
interval for k in ``validation_ks(samples)``, and held-out ``problem_ids`` that no training step
or rollout file mentions (held out means never trained on).
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from rlrunbook.run.checks import CheckResult, is_int, is_number, result
from rlrunbook.run.load import RunFiles, validation_every
from rlrunbook.run.schema import (
    VALIDATION_FILE,
    VALIDATION_FLOAT_KEYS,
    VALIDATION_INT_KEYS,
    iter_validation_schedule,
    validation_ks,
    validation_schedule,
    validation_schedule_length,
)


def _interval_ok(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(map(is_number, value)) and value[0] <= value[1]


def _on_schedule(got: list[Any], steps: int, every: int) -> bool:
    """Whether ``got`` is exactly the schedule; reads at most ``len(got)`` of its steps."""
    return len(got) == validation_schedule_length(steps, every) and all(
        is_int(step) and step == due for step, due in zip(got, iter_validation_schedule(steps, every), strict=False))


def _schedule_text(steps: int, every: int, listed: int = 20) -> str:
    """The schedule as a list, or (longer than ``listed``) its first steps, its last and its length."""
    length = validation_schedule_length(steps, every)
    if length <= listed:
        return str(validation_schedule(steps, every))
    first = ", ".join(f"{k:,}" for k in islice(iter_validation_schedule(steps, every), 5))
    return f"[{first}, ..., {steps:,}] ({length:,} rows)"


def _trained_problem_ids(run: RunFiles) -> set[str]:
    """Problem ids named by the training datums and the rollout records of every loaded step."""
    ids = set()
    for doc in run.step_docs.values():
        for datum in doc.get("training_data") or []:
            if isinstance(datum, dict) and isinstance(datum.get("metadata"), dict):
                ids.add(datum["metadata"].get("problem_id"))
    for doc in run.rollout_docs.values():
        for record in (doc.get("records") or []) + (doc.get("debates") or []):
            if isinstance(record, dict):
                ids.add(record.get("problem_id"))
    ids.discard(None)
    return ids


def _row_problems(row: dict[str, Any], settings: dict[str, Any], trained: set[str]) -> list[str]:
    where = f"{VALIDATION_FILE} step {row.get('step')!r}"
    problems = [f"{where}: {k} is not an int" for k in VALIDATION_INT_KEYS if not is_int(row.get(k))]
    problems += [f"{where}: {k} is not a finite number" for k in VALIDATION_FLOAT_KEYS if not is_number(row.get(k))]
    for key in ("num_problems", "samples"):
        logged = row.get("samples_per_problem" if key == "samples" else key)
        if is_int(settings.get(key)) and logged != settings[key]:
            problems.append(f"{where}: {logged!r} {key.replace('_', ' ')}, config says {settings[key]}")
    if not _interval_ok(row.get("mean_ci")):
        problems.append(f"{where}: mean_ci is not an ordered [low, high] pair")
    samples = settings.get("samples")
    for k in validation_ks(samples) if is_int(samples) and samples > 0 else ():
        value = row.get(f"pass@{k}")
        if not (is_number(value) and 0.0 <= value <= 1.0):
            problems.append(f"{where}: pass@{k} is {value!r}, not a number in [0, 1]")
        if not _interval_ok(row.get(f"pass@{k}_ci")):
            problems.append(f"{where}: pass@{k}_ci is not an ordered [low, high] pair")
    ids = row.get("problem_ids")
    if not isinstance(ids, list) or not ids:
        problems.append(f"{where}: problem_ids is not a non-empty list")
    elif set(ids) & trained:
        shared = sorted(set(ids) & trained, key=str)
        problems.append(f"{where}: held-out problems were trained on: {shared[:5]}")
    return problems


def validation(run: RunFiles) -> CheckResult:
    every = validation_every(run)
    settings = run.config.get("validation") or {}
    problems = list(run.validation_problems)
    got = [row.get("step") for row in run.validation_rows]
    if run.steps is None:
        problems.append(f"cannot tell which validations to expect: {run.steps_problem}")
    elif not _on_schedule(got, run.steps, every):
        shown = f"{got[:20]}{'...' if len(got) > 20 else ''}"
        problems.append(f"{VALIDATION_FILE}: expected rows at steps {_schedule_text(run.steps, every)} "
                        f"(validation.every {every}, {run.steps:,} steps), got {len(got):,} rows {shown}")
    trained = _trained_problem_ids(run)
    for row in run.validation_rows:
        problems += _row_problems(row, settings, trained)
    return result("validation", problems, f"{len(got)} validations at steps {got[:20]}"
                                          f"{'...' if len(got) > 20 else ''}, held out of "
                                          f"{len(trained)} trained problems")
