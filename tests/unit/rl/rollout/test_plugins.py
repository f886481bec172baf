"""A new task plugs in by registering it: the loop, the CLI and the rubric need no change."""

from __future__ import annotations

import pytest

from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rollout import tasks
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl import Problem, Task, register_task
from rlrunbook.rl.training.loop import run_training
from rlrunbook.run import check_run, format_results, rubric_passed


@pytest.fixture
def toy_task(monkeypatch):
    monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))  # registration stays inside this test

    @register_task
    class DigitsTask(Task):
        """Toy: the reward is the share of digits in the answer."""

        name = "toy_digits"
        reward_fns = ("digit_share",)
        default_dataset = "builtin"

        def load(self) -> list[Problem]:
            return [Problem(f"toy-{i}", {"question": f"Count to {i}."}) for i in range(4)]

        def user_message(self, problem: Problem) -> str:
            return problem.record["question"]

        def reward(self, problem: Problem, completion_text: str) -> RewardResult:
            share = sum(c.isdigit() for c in completion_text) / max(1, len(completion_text))
            return RewardResult(share, {"digit_share": share})

        def dataset_info(self, problems):
            return {"name": "toy", "rows": len(problems)}

    return DigitsTask


def test_registered_task_trains_one_step(toy_task, tmp_path, capsys):
    config = TrainConfig(env="toy_digits", model="tiny", num_rollouts=8, steps=1, max_tokens=16, log_root=str(tmp_path),
                         name="toy")
    run_dir = run_training(config)
    results = check_run(run_dir)
    assert rubric_passed(results), format_results(results)
    assert "_grpo_toy_digits_toy" in run_dir.name
    # Its own dataset_info gives no source or fingerprint: the run still names its data, and says so.
    (announced,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[data] toy_digits")]
    assert announced.startswith("[data] toy_digits data 'builtin': unknown source, ")
    assert announced.endswith(" rows, fingerprint not computed")


def test_unregistered_task_is_refused(tmp_path):
    from rlrunbook.errors import ConfigError

    with pytest.raises(ConfigError, match="not a registered task"):
        run_training(TrainConfig(env="toy_digits", log_root=str(tmp_path)))


def test_constant_reward_stops_the_run_with_the_diagnosis(toy_task, tmp_path, monkeypatch):
    """All-zero advantages in max_skipped_steps steps in a row stop the run, name the cause and the fixes, and
    leave a failed run directory (the steps before are logged as skipped)."""
    from rlrunbook.errors import NoLearningSignalError

    monkeypatch.setattr(toy_task, "reward", lambda self, problem, text: RewardResult(0.5, {}))
    config = TrainConfig(env="toy_digits", model="tiny", num_rollouts=8, steps=3, max_tokens=8,
                         log_root=str(tmp_path), name="flat", dynamic_sampling={"max_rounds": 2,
                                                                                "max_skipped_steps": 2})
    with pytest.raises(NoLearningSignalError, match="All token advantages are 0.0 in 2 steps in a row") as caught:
        run_training(config)
    assert "0 of 1 groups had reward spread after drawing 2 groups" in str(caught.value)
    assert "Increase -n" in str(caught.value)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    results = check_run(run_dir)
    assert not rubric_passed(results)
    assert not next(r for r in results if r.name == "metadata.completed").passed
