"""A run's options validated and its data set loaded: every user error surfaces here, before any model loads.

:func:`prepare` is the first half of a run's plan (the training loop's ``plan_run`` adds the checks of the
surroundings, the resume point and the schedules); the commands that evaluate without training use it alone.
"""

from __future__ import annotations

from typing import NamedTuple

from rlrunbook.errors import ConfigError
from rlrunbook.rl.data.quality import check_references
from rlrunbook.rl.rollout.paradigms import Paradigm, get_paradigm
from rlrunbook.rl.rollout.tasks import Problem, Task, get_task_class
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.data_order import check_held_out
from rlrunbook.rl.setup.dataset_cache import load_problems


class Prepared(NamedTuple):
    """The validated config (defaults filled), the paradigm, the task and its problems as loaded."""

    config: TrainConfig
    paradigm: Paradigm
    task: Task
    problems: list[Problem]


def task_options(config: TrainConfig) -> dict:
    """The options a task is built with: those it declares with a config field (``summary_max_words``,
    ``reward.verify_weight``, ...) where the field is set, then ``extra``."""
    options = {}
    for name, option in get_task_class(config.env).declared_options.items():
        if option.field is not None:
            value = config
            for part in option.field.split("."):
                value = getattr(value, part)
            if value is not None:
                options[name] = value
    return {**options, **config.extra}


def prepare(config: TrainConfig) -> Prepared:
    """Validate options and load the data set: every user error surfaces here, before any model loads."""
    config = validate(config)
    if config.mismatch.correction != "none":
        from rlrunbook.backend import backend_name

        if backend_name() != "local":
            raise ConfigError(f"mismatch.correction={config.mismatch.correction} is a local-backend extension; the "
                              "hosted service (TINKER_BACKEND=api) does not know it. Drop it or train locally.")
    paradigm = get_paradigm(config.mode)
    task = get_task_class(config.env)(config.dataset, config.reward_fn, config.seed, task_options(config))
    problems = load_problems(task, config.data)  # task.load(), or its --cache-dataset copy
    if task.uses_references():
        check_references(task.dataset, problems, task.reference, config.reward_fn)
    check_held_out(config.validation, len(problems))
    if config.expected_dataset_hash is not None:
        actual = task.dataset_info(problems).get("fingerprint")
        if actual != config.expected_dataset_hash:
            raise ConfigError(
                f"data set {task.dataset!r} has fingerprint {actual}, not the expected {config.expected_dataset_hash}: "
                "it changed since that hash was recorded. Use the recorded data, or drop --expected-dataset-hash "
                "to accept the new one (run_metadata.json records it)."
            )
    return Prepared(config, paradigm, task, problems)


def dataset_record(task: Task, problems: list[Problem]) -> tuple[dict, list[str]]:
    """What ``run_metadata.json`` records of the data set (with ``warnings`` when there are any), and the
    lines to log: the data set's source, rows and fingerprint, the task's notices (a fallback data set), then
    duplicate rows, shared ids and empty prompts (see :mod:`rlrunbook.rl.data.quality`)."""
    from rlrunbook.rl.data.quality import data_warnings

    warnings = [*task.notices, *data_warnings(task.dataset, problems, task.user_message,
                                              duplicates_expected=task.repeats_by_design(),
                                              reference_of=task.reference if task.uses_references() else None)]
    info = task.dataset_info(problems)
    lines = [task.announcement(problems), *(f"notice: {n}" for n in task.notices),
             *(f"warning: {w}" for w in warnings[len(task.notices):])]
    return ({**info, "warnings": warnings} if warnings else info), lines
