"""eval-checkpoints without a model: held-out selection and the errors raised before anything loads."""

from __future__ import annotations

import pytest
import torch

from rlrunbook import cli
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.rl.evaluation.checkpoint_eval import (
    EvalOptions,
    evaluate_checkpoints,
    held_out_problems,
    table_columns,
)
from rlrunbook.rl.rollout.tasks import Problem
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.data_order import problem_order
from rlrunbook.run.checkpoint_format import Checkpoint, capture_rng, save_checkpoint


def test_held_out_problems_are_those_training_never_drew():
    problems = [Problem(f"p{i}", None) for i in range(10)]
    config = TrainConfig(num_rollouts=4, num_groups=2, steps=3, seed=5)
    order = problem_order(problems, 5)
    held = held_out_problems(config, problems)
    assert [p.id for p in held] == [problems[i].id for i in order[6:]]
    assert held_out_problems(config.replace(steps=5), problems) == []  # 10 draws cover all 10


def test_table_columns():
    assert table_columns([4, 1]) == ["step", "mean_reward", "mean_ci_low", "mean_ci_high",
                                     "pass@1", "pass@1_ci_low", "pass@1_ci_high",
                                     "pass@4", "pass@4_ci_low", "pass@4_ci_high"]


def test_run_without_checkpoints_is_refused(tmp_path, capsys):
    assert cli.main(["eval-checkpoints", str(tmp_path)]) == 2
    assert "has no checkpoints" in capsys.readouterr().err


def _run_with_checkpoint(tmp_path, steps=2):
    config = TrainConfig(env="qa", dataset="test", num_rollouts=4, steps=steps).to_dict()
    return save_checkpoint(tmp_path, Checkpoint(2, config, {"w": torch.ones(2)}, None, capture_rng()))


def test_corrupted_checkpoint_is_refused_before_a_model_loads(tmp_path):
    folder = _run_with_checkpoint(tmp_path)
    (folder / "rng.json").write_text("{}")

    def no_service(config):
        raise AssertionError("a model was about to load")

    with pytest.raises(InputError, match="rng.json does not match"):
        evaluate_checkpoints(tmp_path, service_factory=no_service)


def test_k_above_samples_is_refused_before_a_model_loads(tmp_path):
    _run_with_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="larger than the 4 samples"):
        evaluate_checkpoints(tmp_path, EvalOptions(samples=4, ks=(1, 8)), service_factory=None)


def test_no_held_out_problem_is_refused(tmp_path):
    _run_with_checkpoint(tmp_path, steps=300)  # 300 steps x 1 group cover the 256 built-in problems
    with pytest.raises(ConfigError, match="none is held out. Pass --dataset"):
        evaluate_checkpoints(tmp_path, service_factory=None)


def test_another_data_set_drops_the_options_of_the_generated_one(tmp_path):
    """extra.test_size sized the run's generated set; on a file given by --dataset nothing reads it, and
    the check of extra options must not refuse the evaluation for what the run rightly held."""
    config = TrainConfig(env="qa", dataset="test", num_rollouts=4, extra={"test_size": 8}).to_dict()
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run", Checkpoint(1, config, {"w": torch.ones(2)}, None, capture_rng()))
    data = tmp_path / "held.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n{"question": "2 + 2?", "answer": "#### 4"}\n')
    seen = []

    def service(config):
        seen.append((config.dataset, config.extra))
        raise RuntimeError("the model would load here")

    with pytest.raises(RuntimeError, match="the model would load here"):
        evaluate_checkpoints(tmp_path / "run", EvalOptions(samples=2, ks=(1,), dataset=str(data)),
                             service_factory=service)
    assert seen == [(str(data), {})]
