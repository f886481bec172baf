"""The names users import stay where they import them, whichever stage of ``rlrunbook.rl`` defines them."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = [
    ("rlrunbook.rl.tasks", "register_task", "rlrunbook.rl.rollout.tasks"),
    ("rlrunbook.rl.tasks", "Task", "rlrunbook.rl.rollout.tasks"),
    ("rlrunbook.rl.tasks", "Problem", "rlrunbook.rl.rollout.tasks"),
    ("rlrunbook.rl.paradigms", "register_paradigm", "rlrunbook.rl.rollout.paradigms"),
    ("rlrunbook.rl.paradigms", "Paradigm", "rlrunbook.rl.rollout.paradigms"),
    ("rlrunbook.rl.paradigms", "RolloutContext", "rlrunbook.rl.rollout.paradigms"),
    ("rlrunbook.rl.config", "TrainConfig", "rlrunbook.rl.setup.config"),
    ("rlrunbook.rl.rewards.math", "math_reward", "rlrunbook.rl.rewards.math"),
    ("rlrunbook.rl.rewards", "qa_numeric_reward", "rlrunbook.rl.rewards.qa"),
    ("rlrunbook.rl.loop", "run_training", "rlrunbook.rl.training.loop"),
    ("rlrunbook.cli", "main", "rlrunbook.cli"),
]


@pytest.mark.parametrize(("public", "name", "home"), PUBLIC)
def test_public_name_is_the_defining_object(public, name, home):
    assert getattr(importlib.import_module(public), name) is getattr(importlib.import_module(home), name)


def test_a_task_registered_through_the_public_path_is_found_by_the_loop(monkeypatch):
    from rlrunbook.rl import tasks
    from rlrunbook.rl.rollout import tasks as home

    monkeypatch.setattr(home, "TASKS", dict(home.TASKS))

    @tasks.register_task
    class Echo(tasks.Task):
        name = "echo-public-path"

    assert home.get_task_class("echo-public-path") is Echo
