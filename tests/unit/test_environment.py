"""``env_number``: the one reader of numeric settings from the environment, refusing by the variable's name."""

from __future__ import annotations

import pytest

from rlrunbook.environment import env_number
from rlrunbook.errors import ConfigError


@pytest.mark.parametrize(("raw", "kind", "expected"), [
    (None, int, 7), ("", int, 7), ("   ", float, 7), ("3", int, 3), (" 12 ", int, 12), ("0.25", float, 0.25),
    ("1e-3", float, 0.001),
])
def test_a_number_or_the_default(raw, kind, expected):
    env = {} if raw is None else {"X_SETTING": raw}
    assert env_number(env, "X_SETTING", 7, 0, kind) == expected


@pytest.mark.parametrize(("raw", "kind", "message"), [
    ("two", int, "X_SETTING='two' is not an integer"),
    ("1.5", int, "X_SETTING='1.5' is not an integer"),
    ("abc", float, "X_SETTING='abc' is not a number"),
    ("nan", float, "X_SETTING='nan' is not a finite number"),
    ("inf", float, "X_SETTING='inf' is not a finite number"),
    ("-1", int, "X_SETTING=-1 must be >= 0"),
])
def test_what_the_setting_cannot_take_is_refused_by_name(raw, kind, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        env_number({"X_SETTING": raw}, "X_SETTING", 1, 0, kind)
