"""Invalid training options are refused before any model loads, with the rule and the fix."""

from __future__ import annotations

import pytest

from rlrunbook import cli
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate


@pytest.mark.parametrize("args, match", [
    (["-n", "10", "--num-groups", "4"], "not divisible by --num-groups 4"),
    (["--mode", "debate", "-n", "6", "--num-groups", "2", "--mock-judge"], "is odd"),
    (["--mode", "debate", "-n", "8", "--mock-judge", "--debate-train", "rs_grpo"], "--debate-grpo-reward task"),
    (["--mode", "debate", "-n", "4", "--num-groups", "2", "--mock-judge", "--debate-train", "rs_grpo",
      "--debate-grpo-reward", "task"], "one winner per group"),
    (["--mock-judge"], "apply to --mode debate only"),
    (["--env", "summary", "--reward-fn", "numeric"], "does not apply to --env summary"),
    (["--env", "poetry"], "not a registered task"),
    (["--mode", "monologue"], "not a registered paradigm"),
    (["-n", "1"], "no spread"),
    (["--temperature", "0"], "must be > 0"),
    (["--name", "a/b"], "plain name"),
])
def test_bad_combinations_fail_before_loading(args, match, capsys, monkeypatch, tmp_path):
    from rlrunbook import backend

    monkeypatch.setattr(backend, "create_service_client", lambda **_: pytest.fail("a model was loaded"))
    assert cli.main(["train", "--log-root", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert match in err
    assert not any(tmp_path.iterdir()), "nothing may be written for an invalid configuration"


def test_defaults_fill_the_reward():
    assert validate(TrainConfig(env="summary")).reward_fn == "compression"
    assert validate(TrainConfig(env="qa")).reward_fn == "numeric"
    config = validate(TrainConfig(mode="debate", num_rollouts=8, num_groups=2, mock_judge=True))
    assert config.group_size == 4 and config.run_mode == "rejection"
