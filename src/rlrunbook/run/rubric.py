"""The runbook's rubrics as checks over a run directory.

``check_run(run_dir)`` returns one ``CheckResult`` per rule; the e2e tests assert they all pass,
and a user on a GPU machine runs the same code (``python -m rlrunbook.run <run_dir>``). The rules,
in order:

- ``metadata.readable``, ``metadata.completed``, ``metadata.fields``: run_metadata.json parses,
  says status "completed" (a half-written run says "running"), has config (mode, env, steps)
  and versions.
- ``train_log``: one row per step 0..steps-1 with the schema's keys.
- ``training_steps.present``: training_step_<k>.json for every step, with accepted datums.
- ``datums.shapes``: non-empty prompt and completion; the four completion arrays and the mask
  have equal lengths.
- ``datums.nonzero_advantages``: every step has a non-zero advantage (else training is a no-op).
- ``datums.mask_advantages``: advantage 0 wherever completion_mask is 0 (opponent tokens are
  never trained).
- ``loss.present``, ``loss.nonzero``: results.metrics["loss:sum"] in every step, not 0 in all.
- ``trained_tokens.positive``: num_trained_tokens > 0 in every step.
- Steps that dynamic sampling skipped (no group with reward spread, no update) are accepted when both
  their train_log.jsonl row (with a ``skip_reason``) and their training_step_<k>.json say so; the
  datum, loss and token checks leave them out, and ``training_steps.present`` fails a run whose every
  step was skipped, or whose two marks disagree.
- ``rollouts.present``: baseline_<k>.json (single-turn qa/math), summary_<k>.json (single-turn
  summary) or debate_<k>.json (debate) for every step.
- single-turn ``rollouts.records``: every record has a reward; summary records have reward metrics.
- debate ``debate.rounds``, ``debate.verdicts``: rounds 1, 2, 3 with tokens on both sides, and a verdict.
- ``validation`` (only with ``validation.every > 0`` in the config): validation.jsonl has the
  scheduled rows with well-formed pass@k / mean-reward numbers, on problems never trained on.
- ``report.png``: present and a whole PNG.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from rlrunbook.run import checks, rollout_checks, step_checks, validation_checks
from rlrunbook.run.checks import CheckResult
from rlrunbook.run.load import RunFiles, load_run, validation_every

Check = Callable[[RunFiles], CheckResult]
COMMON_CHECKS: tuple[Check, ...] = (
    checks.metadata_readable,
    checks.metadata_completed,
    checks.metadata_fields,
    checks.train_log,
    step_checks.training_steps_present,
    step_checks.datum_shapes,
    step_checks.nonzero_advantages,
    step_checks.mask_advantages,
    step_checks.loss_present,
    step_checks.loss_nonzero,
    step_checks.trained_tokens,
    rollout_checks.rollouts_present,
)
MODE_CHECKS: dict[str, tuple[Check, ...]] = {
    "single_turn": (rollout_checks.rollout_records,),
    "debate": (rollout_checks.debate_rounds, rollout_checks.debate_verdicts),
}


def check_run(run_dir: str | Path) -> list[CheckResult]:
    """Apply every rubric rule to ``run_dir``; never raises for a malformed or missing directory."""
    run = load_run(run_dir)
    optional = (validation_checks.validation,) if validation_every(run) > 0 else ()
    selected = COMMON_CHECKS + MODE_CHECKS.get(run.mode or "", ()) + optional + (checks.report_png,)
    return [check(run) for check in selected]


def format_results(results: Iterable[CheckResult]) -> str:
    """One line per check: ``PASS name: detail`` or ``FAIL name: detail``."""
    return "\n".join(f"{'PASS' if r.passed else 'FAIL'} {r.name}: {r.detail}" for r in results)


def rubric_passed(results: Iterable[CheckResult]) -> bool:
    """True when every check passed (and there was at least one)."""
    results = list(results)
    return bool(results) and all(r.passed for r in results)
