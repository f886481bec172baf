"""The names users import come from ``rlrunbook.rl`` itself, whichever stage defines them."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = [
    ("rlrunbook.rl", "register_task", "rlrunbook.rl.rollout.tasks"),
    ("rlrunbook.rl", "Task", "rlrunbook.rl.rollout.tasks"),
    ("rlrunbook.rl", "Problem", "rlrunbook.rl.rollout.tasks"),
    ("rlrunbook.rl", "register_paradigm", "rlrunbook.rl.rollout.paradigms"),
    ("rlrunbook.rl", "Paradigm", "rlrunbook.rl.rollout.paradigms"),
    ("rlrunbook.rl", "RolloutContext", "rlrunbook.rl.rollout.paradigms"),
    ("rlrunbook.rl", "TrainConfig", "rlrunbook.rl.setup.config"),
    ("rlrunbook.rl.rewards.math", "math_reward", "rlrunbook.rl.rewards.math"),
    ("rlrunbook.rl.rewards", "qa_numeric_reward", "rlrunbook.rl.rewards.qa"),
    ("rlrunbook.rl", "run_training", "rlrunbook.rl.training.loop"),
    ("rlrunbook.cli", "main", "rlrunbook.cli"),
]


@pytest.mark.parametrize(("public", "name", "home"), PUBLIC)
def test_public_name_is_the_defining_object(public, name, home):
    assert getattr(importlib.import_module(public), name) is getattr(importlib.import_module(home), name)


def test_a_task_registered_through_the_public_path_is_found_by_the_loop(monkeypatch):
    from rlrunbook import rl
    from rlrunbook.rl.rollout import tasks as home

    monkeypatch.setattr(home, "TASKS", dict(home.TASKS))

    @rl.register_task
    class Echo(rl.Task):
        name = "echo-public-path"

    assert home.get_task_class("echo-public-path") is Echo


def test_every_public_name_of_the_package_resolves_and_loads_only_its_stage():
    """``rlrunbook.rl``'s names load their own stage on first use: importing the package loads no stage."""
    import subprocess
    import sys

    from rlrunbook import rl

    for name in rl.__all__:
        assert getattr(rl, name) is getattr(importlib.import_module(rl._HOMES[name]), name), name
    probe = "import sys, rlrunbook.rl; print(sorted(m for m in sys.modules if m.startswith('rlrunbook.rl.')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    with pytest.raises(AttributeError, match="no attribute 'register_tsk'"):
        rl.register_tsk  # noqa: B018
