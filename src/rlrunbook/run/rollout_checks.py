"""Rubric checks of the rollout records: ``baseline_<k>``/``summary_<k>`` (single-turn), ``debate_<k>``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlrunbook.run.checks import CheckResult, is_int, is_number, result
from rlrunbook.run.load import RunFiles
from rlrunbook.run.schema import DEBATE_ROUNDS, DEBATE_SIDES


def rollouts_present(run: RunFiles) -> CheckResult:
    if run.kind is None:
        why = run.metadata_problem or f"config mode {run.config.get('mode')!r}, env {run.config.get('env')!r}"
        return CheckResult("rollouts.present", False, f"cannot tell which rollout files to expect: {why}")
    problems = list(run.rollout_problems)
    if run.steps is None:
        problems.append(f"cannot tell which steps to expect: {run.steps_problem}")
    problems += [
        f"{run.kind}_{k}.json: step field is {doc.get('step')!r}"
        for k, doc in sorted(run.rollout_docs.items())
        if doc.get("step") != k
    ]
    return result("rollouts.present", problems, f"{len(run.rollout_docs)} {run.kind}_<k>.json files")


def _entries(run: RunFiles, key: str, problems: list[str]) -> Iterable[tuple[str, int, Any]]:
    """``(file name, index, entry)`` of every rollout file's ``key`` list; non-lists become problems."""
    for k, doc in sorted(run.rollout_docs.items()):
        name = f"{run.kind}_{k}.json"
        entries = doc.get(key)
        if not isinstance(entries, list) or not entries:
            problems.append(f"{name}: {key} is not a non-empty list")
            continue
        yield from ((name, i, entry) for i, entry in enumerate(entries))


def rollout_records(run: RunFiles) -> CheckResult:
    problems: list[str] = []
    count = 0
    for name, i, record in _entries(run, "records", problems):
        count += 1
        if not isinstance(record, dict) or not is_number(record.get("reward")):
            problems.append(f"{name} record {i}: reward is missing or not a finite number")
            continue
        metrics = record.get("reward_metrics")
        if run.kind == "summary" and not (
            isinstance(metrics, dict) and metrics and all(is_number(v) for v in metrics.values())
        ):
            problems.append(
                f"{name} record {i}: reward_metrics is {metrics!r}, not a non-empty dict of numbers"
            )
    if not run.rollout_docs:
        problems.append(f"no readable {run.kind}_<k>.json")
    return result("rollouts.records", problems, f"{count} records with rewards")


def _round_problems(debate: dict[str, Any]) -> list[str]:
    rounds = debate.get("rounds")
    if not isinstance(rounds, list) or not all(isinstance(r, dict) for r in rounds):
        return ["rounds is not a list of objects"]
    numbers = [r.get("round") for r in rounds]
    problems = (
        []
        if sorted(numbers, key=str) == list(DEBATE_ROUNDS)
        else [f"rounds {numbers}, expected {list(DEBATE_ROUNDS)}"]
    )
    for r in rounds:
        for side in DEBATE_SIDES:
            turn = r.get(side)
            tokens = turn.get("tokens") if isinstance(turn, dict) else None
            if not (isinstance(tokens, list) and tokens and all(is_int(t) for t in tokens)):
                problems.append(f"round {r.get('round')!r} side {side} has no tokens")
    return problems


def debate_rounds(run: RunFiles) -> CheckResult:
    problems: list[str] = []
    count = 0
    for name, i, debate in _entries(run, "debates", problems):
        count += 1
        label = f"{name} debate {debate.get('debate_id', i) if isinstance(debate, dict) else i}"
        issues = _round_problems(debate) if isinstance(debate, dict) else ["not an object"]
        problems += [f"{label}: {p}" for p in issues]
    if not run.rollout_docs:
        problems.append("no readable debate_<k>.json")
    return result("debate.rounds", problems, f"{count} debates with rounds 1-3 on both sides")


def debate_verdicts(run: RunFiles) -> CheckResult:
    problems: list[str] = []
    count = 0
    for name, i, debate in _entries(run, "debates", problems):
        count += 1
        verdict = debate.get("verdict") if isinstance(debate, dict) else None
        winner = verdict.get("winner") if isinstance(verdict, dict) else None
        if winner not in DEBATE_SIDES:
            problems.append(f"{name} debate {i}: verdict {verdict!r} has no winner 'a' or 'b'")
    if not run.rollout_docs:
        problems.append("no readable debate_<k>.json")
    return result("debate.verdicts", problems, f"{count} verdicts")
