"""``validate`` runs every check of a config once: a config it returned comes back at once, anything else is
checked in full."""

from __future__ import annotations

import pytest

from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup import config_checks as validation
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import is_validated, validate


def _counting_checks(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = validation.check_limits

    def counted(config):
        calls.append(1)
        return real(config)

    monkeypatch.setattr(validation, "check_limits", counted)
    return calls


def test_a_validated_config_is_not_checked_again(monkeypatch):
    calls = _counting_checks(monkeypatch)
    config = validate(TrainConfig(num_rollouts=4))
    assert calls == [1] and is_validated(config)
    assert validate(config) is config and validate(validate(config)) is config
    assert calls == [1]


def test_an_equal_config_made_another_way_is_checked_in_full(monkeypatch):
    validated = validate(TrainConfig(num_rollouts=4))
    calls = _counting_checks(monkeypatch)
    copy = TrainConfig.model_validate(validated.to_dict())
    assert copy == validated and not is_validated(copy)
    assert validate(copy) == validated and calls == [1]


def test_validation_fills_once_and_the_result_is_a_fixed_point():
    first = validate(TrainConfig(mode="debate", num_rollouts=4, mock_judge=True))
    assert first.debate_train == "rejection" and first.reward_fn == "numeric"
    again = validate(TrainConfig.model_validate(first.to_dict()))
    assert again == first


def test_a_changed_copy_of_a_validated_config_is_checked(monkeypatch):
    config = validate(TrainConfig(num_rollouts=4))
    with pytest.raises(ConfigError, match="not divisible by --num-groups 3"):
        validate(config.replace(num_groups=3))
