"""Limits stated and enforced before any work (issue 24, point 2): numbers a run cannot hold or finish, and
config files whose YAML would exhaust memory or the stack, are refused with the limit named.

The expectations are the limits of ``rlrunbook.rl.setup.limits`` written out by hand (2^63 - 1 for a seed,
65,536 rollouts, ...), so a limit changed or dropped shows here.
"""

from __future__ import annotations

import time

import pytest

from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.config_sources import build_config, load_config_file, parse_override, sweep_grid

# --- numbers of the config --------------------------------------------------------------------------------


@pytest.mark.parametrize("values, match", [
    ({"seed": 10**23}, "--seed (seed) 100000000000000000000000 is above its limit of 2^63 - 1"),
    ({"seed": -1}, "--seed (seed) -1 is below its limit of 0"),
    ({"num_rollouts": 10**20}, "-n (num_rollouts) 100000000000000000000 is above its limit of 65,536"),
    ({"steps": 10**7}, "-s (steps) 10000000 is above its limit of 1,000,000"),
    ({"max_tokens": 2**20 + 1}, "--max-tokens (max_tokens) 1048577 is above its limit of 1,048,576"),
    ({"lora_rank": 16_385}, "--lora-rank (lora_rank) 16385 is above its limit of 16,384"),
    ({"learning_rate": 1e12}, "--learning-rate (learning_rate) 1000000000000.0 is above its limit of 1"),
    ({"env": "summary", "summary_max_words": 0}, "--summary-max-words (summary_max_words) 0 is below its limit of 1"),
    ({"env": "summary", "summary_max_words": -5}, "summary_max_words) -5 is below its limit of 1"),
    ({"validation.every": 1, "validation.samples": 70_000}, "--val-samples (validation.samples) 70000 is above"),
    ({"dynamic_sampling.max_rounds": 65}, "--dynamic-sampling-max-rounds (dynamic_sampling.max_rounds) 65 is above its limit of 64"),
    ({"temperature": 1e6}, "--temperature (temperature) 1000000.0 is above its limit of 100"),
    ({"loss.entropy_coef": 1e6}, "--entropy-coef (loss.entropy_coef) 1000000.0 is above its limit of 10"),
])
def test_a_number_beyond_its_limit_is_refused_naming_the_limit(values, match):
    with pytest.raises(ConfigError) as error:
        validate(build_config(cli=values).config)
    assert match in str(error.value), str(error.value)


def test_the_limits_themselves_are_accepted():
    """The edge values pass: the limits are inclusive, and a refusal is not a blanket ban on big numbers."""
    config = validate(build_config(cli={"seed": 2**63 - 1, "num_rollouts": 65_536, "num_groups": 1,
                                        "learning_rate": 1.0, "max_tokens": 2**20, "temperature": 100.0,
                                        "loss.entropy_coef": 10.0}).config)
    assert (config.seed, config.num_rollouts, config.learning_rate) == (2**63 - 1, 65_536, 1.0)


def test_a_number_of_thousands_of_digits_is_named_by_its_size():
    """``str`` of an int beyond 4,300 digits raises: the message states its size instead of printing it."""
    with pytest.raises(ConfigError, match="a number of about 5,001 digits is above its limit of 2") as error:
        validate(TrainConfig(seed=10**5000))
    assert len(str(error.value)) < 400


@pytest.mark.parametrize("yaml_text, key", [
    ("steps: true\n", "steps"),  # YAML reads true as 1: it used to be one step
    ("num_rollouts: 8.0\n", "num_rollouts"),
    ("deterministic: 1\n", "deterministic"),
    ("learning_rate: false\n", "learning_rate"),
])
def test_a_value_of_the_wrong_type_is_not_coerced(tmp_path, yaml_text, key):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=f"invalid config: {key}: ") as error:
        build_config(file=path)
    assert f"from file:{path}" in str(error.value)


# --- YAML of config files ---------------------------------------------------------------------------------

BILLION_LAUGHS = "\n".join(
    [f"a: &a [{', '.join(['lol'] * 9)}]"]
    + [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)]) + "\n"


def test_an_alias_bomb_is_refused_at_once_without_expanding_it(tmp_path):
    """Nine levels of nine aliases expand to 9^9 + ... values: counted on the composed graph, refused in well
    under a second (expanding it took all the memory there was)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(BILLION_LAUGHS)
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        load_config_file(path)
    assert time.monotonic() - started < 5
    # 9 + 9^2 + ... + 9^9 lists and strings, 9 keys, 9 values of the mapping, the mapping: by hand,
    # sum over levels k=1..9 of (1 + 9 * size(k-1)) with size(0) = 1 gives size(k) = (9^(k+1) - 1) / 8.
    sizes = [1]
    for _ in range(9):
        sizes.append(1 + 9 * sizes[-1])
    expected = 1 + sum(1 + size for size in sizes[1:])  # the mapping, then each key and its list
    assert f"expand to {expected:,} values, more than the limit of 100,000" in str(error.value)


def test_many_aliases_are_refused_before_they_are_counted(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("a: &x 1\nb: [" + ", ".join(["*x"] * 101) + "]\n")
    with pytest.raises(ConfigError, match="more than 100 YAML aliases"):
        load_config_file(path)


def test_an_alias_inside_itself_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("a: &a [1, *a]\n")
    with pytest.raises(ConfigError, match="refers to a collection that contains it"):
        load_config_file(path)


def test_deep_nesting_is_refused_without_a_recursion_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("extra: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested more than 32 deep"):
        load_config_file(path)


def test_an_integer_of_thousands_of_digits_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("seed: " + "9" * 5001 + "\n")
    with pytest.raises(ConfigError, match="an integer of 5,001 digits; no setting holds more than 30"):
        load_config_file(path)


def test_an_override_is_bounded_like_a_file():
    with pytest.raises(ConfigError, match="an integer of 40 digits"):
        parse_override("seed=" + "1" * 40)


def test_a_config_file_larger_than_a_mebibyte_is_refused(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="larger than 1,048,576 bytes"):
        load_config_file(path)


@pytest.mark.parametrize("section, shown", [("sweep:\n  1: [a, b]\n", "the key 1 is a number"),
                                            ("sweep:\n  true: [a, b]\n", "the key True is true/false")])
def test_a_sweep_key_that_is_not_a_name_is_refused(tmp_path, section, shown):
    """It used to end in ``AttributeError: 'int' object has no attribute 'split'``."""
    path = tmp_path / "sweep.yaml"
    path.write_text(section)
    with pytest.raises(ConfigError, match=f"line 2: {shown}, but config keys are names"):
        sweep_grid(path, [])
