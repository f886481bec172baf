"""No option without effect (issue 24, point 3): an option the run's mode, loss or setting would not read is
refused naming the setting that reads it; ``extra.*`` keys are checked against what the task declares;
legal-type nonsense, self-contradicting sweeps and unprintable names are refused.

Each case builds the config through the same layers as ``train`` (``build_config`` + ``validate``), which is
where the refusal happens before any model loads; ``tests/unit/cli/test_input_limits.py`` runs the installed command.
"""

from __future__ import annotations

import pytest

from rlrunbook.errors import ConfigError
from rlrunbook.rl.rollout.task_options import TaskOption, check_extra
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.config_sources import build_config, sweep_grid
from rlrunbook.run.paths import new_run_dir


def _validated(overrides=(), **cli):
    return validate(build_config(overrides=list(overrides), cli=cli).config)


# --- options that the chosen setting ignores ----------------------------------------------------------------

@pytest.mark.parametrize("cli, overrides, match", [
    ({"judge_model": "tiny"}, (), "--judge-model (judge_model) 'tiny' has no effect in this run: it applies only to "
                                  "debates judged by a model (--mode debate without --mock-judge), but the mode is "
                                  "single_turn"),
    ({"mode": "debate", "num_rollouts": 8, "num_groups": 2, "mock_judge": True, "judge_model": "tiny"}, (),
     "but --mock-judge is set, and the mock judge reads no model"),
    ({"summary_max_words": 100}, (), "--summary-max-words (summary_max_words) 100 has no effect in this run: it "
                                     "applies only to the tasks that read it (--env summary), but --env is qa"),
    ({}, ("loss.clip_low_threshold=0.5",), "--loss-clip-low-threshold (loss.clip_low_threshold) 0.5 has no "
                                           "effect in this run: it applies only to the clipped losses (--loss-fn ppo, cispo or gspo), but --loss-fn is "
                                           "importance_sampling"),
    ({"loss_fn": "dro"}, ("loss.clip_high_threshold=1.5",), "but --loss-fn is dro"),
    ({"loss.kl_estimator": "k3"}, (), "--kl-estimator (loss.kl_estimator) 'k3' has no effect in this run: it applies "
                                 "only with the KL term on (--kl-coef above 0), but loss.kl_coef is 0"),
    ({"validation.samples": 8}, (), "--val-samples (validation.samples) 8 has no effect in "
                                                          "this run: it applies only with validation on"),
    ({}, ("validation.threshold=0.5",), "--validation-threshold (validation.threshold) 0.5 has no effect"),
    ({}, ("mismatch.cap=3",), "--mismatch-cap (mismatch.cap) 3.0 has no effect in this run: it applies only with "
                              "mismatch.correction truncate, but mismatch.correction is none"),
    ({}, ("mismatch.correction=truncate", "mismatch.mask_low=0.2"), "but mismatch.correction is truncate"),
    ({}, ("reward.verify_weight=2",), "--reward-verify-weight (reward.verify_weight) 2.0 has no effect in this "
                                      "run: it applies only with --reward-fn multi_signal, but this run has --dataset test with --reward-fn "
                                      "numeric"),
    ({}, ("data.cache_dir=/tmp/x",), "--data-cache-dir (data.cache_dir) '/tmp/x' has no effect in this run"),
    ({"finetune": "full", "lora_rank": 64}, (), "--lora-rank (lora_rank) 64 has no effect in this run: it applies "
                                                "only to LoRA training (finetune: lora), but finetune is full"),
    ({"finetune": "full"}, ("train_unembed=false",), "--train-unembed (train_unembed) False has no effect"),
])
def test_an_option_the_run_ignores_is_refused(cli, overrides, match):
    with pytest.raises(ConfigError) as error:
        _validated(overrides, **cli)
    assert match in str(error.value), str(error.value)


def test_an_option_that_applies_gets_its_documented_default():
    """Null until it applies; then the default configuration.md states, which run_metadata.json records."""
    plain = _validated()
    assert (plain.loss.kl_estimator, plain.validation.samples, plain.summary_max_words, plain.mismatch.cap) == \
        (None, None, None, None)
    assert _validated(["loss.kl_coef=0.01"]).loss.kl_estimator == "low_var_kl"
    validating = _validated(["validation.every=2"])
    assert (validating.validation.samples, validating.validation.num_problems,
            validating.validation.threshold) == (4, 16, 1.0)
    assert _validated(env="summary").summary_max_words == 150
    assert _validated(["mismatch.correction=mask"]).mismatch.model_dump() == {
        "warn": 0.01, "max": 0.03, "correction": "mask", "cap": None, "mask_low": 0.125, "mask_high": 8.0}
    weights = _validated(reward_fn="multi_signal").reward
    assert (weights.verify_weight, weights.format_weight, weights.reflect_weight) == (1.0, 0.5, 0.5)
    assert _validated(mode="debate", num_rollouts=8, num_groups=2).judge_model is None  # the base model
    assert (plain.finetune, plain.lora_rank, plain.train_unembed) == ("lora", 16, True)
    full = _validated(finetune="full")
    assert (full.lora_rank, full.train_unembed) == (None, None)


def test_a_stored_config_of_an_older_run_reads_its_ignored_defaults_as_null():
    """Run records made before these options became null hold their old defaults where nothing read them
    (``kl_estimator: low_var_kl`` with the KL off); resume and eval-checkpoints must still read them."""
    old = TrainConfig().model_dump(mode="json")
    old.update(summary_max_words=150)
    old["loss"]["kl_estimator"] = "low_var_kl"
    old["validation"].update(samples=4, num_problems=16, threshold=1.0)
    old["reward"].update(verify_weight=1.0, format_weight=0.5, reflect_weight=0.5)
    stored = TrainConfig.from_stored(old)
    assert validate(stored) == validate(TrainConfig())


# --- extra.* against what the task declares -------------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    (["extra.test_size=abc"], "extra.test_size='abc' is a string, but it must be an integer: the number of "
                              "generated arithmetic problems (default 256; at least 1 and at most 1,000,000). Pass "
                              "e.g. extra.test_size=256."),
    (["extra.test_size=0"], "extra.test_size=0 is out of range"),
    (["extra.test_size=2.5"], "extra.test_size=2.5 is a number, but it must be an integer"),
    (["extra.test_sise=3"], "extra.test_sise is not an option of --env qa with --mode single_turn, so it would have "
                            "no effect. Did you mean extra.test_size? The options it reads: extra.test_size, "
                            "extra.format_bonus."),
    (["extra.format_bonus=1"], "extra.format_bonus=1 is out of range"),
    (["extra.format_bonus=0.2", "reward_fn=text"], "extra.format_bonus has no effect in this run: --env qa with "
                                                   "--mode single_turn reads it only with --reward-fn numeric"),
    (["extra.summary_max_words=10", "env=summary"], "extra.summary_max_words is set by the config field "
                                                    "summary_max_words"),
    (["extra.math_timeout_s=0", "env=math", "dataset=x.jsonl"], "extra.math_timeout_s=0 is out of range"),
])
def test_extra_keys_are_checked_against_the_declared_options(overrides, match):
    with pytest.raises(ConfigError) as error:
        _validated(overrides)
    assert match in str(error.value), str(error.value)


def test_declared_extra_options_are_accepted():
    assert _validated(["extra.test_size=8", "extra.format_bonus=0.25"]).extra == {"test_size": 8,
                                                                                   "format_bonus": 0.25}


def test_a_plug_in_declares_what_it_reads():
    declared = {"kinds": TaskOption(str, "tf", "letters"), "size": TaskOption(int, 3, "rows", low=1)}
    check_extra({"kinds": "tt", "size": 2}, declared, "--env plug", dataset="d", reward_fn="r")
    with pytest.raises(ConfigError, match=r"extra.kind is not an option of --env plug.* Did you mean extra.kinds\?"):
        check_extra({"kind": "tt"}, declared, "--env plug", dataset="d", reward_fn="r")
    with pytest.raises(ConfigError, match=r"extra.size=True is true or false, but it must be an integer"):
        check_extra({"size": True}, declared, "--env plug", dataset="d", reward_fn="r")


# --- legal types, nonsense values ---------------------------------------------------------------------------

@pytest.mark.parametrize("cli, match", [
    ({"learning_rate": 0.0}, "--learning-rate 0.0 must be > 0"),
    ({"learning_rate": 1e12}, "is above its limit of 1"),
    ({"seed": -3}, "--seed (seed) -3 is below its limit of 0"),
    ({"env": "summary", "summary_max_words": 0}, "below its limit of 1"),
    ({"num_rollouts": -8}, "must all be >= 1"),
])
def test_legal_type_nonsense_is_refused(cli, match):
    with pytest.raises(ConfigError) as error:
        _validated(**cli)
    assert match in str(error.value), str(error.value)


# --- sweeps and overrides that repeat themselves ------------------------------------------------------------

def test_a_sweep_value_listed_twice_is_refused():
    with pytest.raises(ConfigError, match=r"sweep 'seed' \(--sweep seed=1,2,1\) lists the value 1 twice "
                                          r"\(positions 1 and 3\)"):
        sweep_grid(None, ["seed=1,2,1"])


def test_a_sweep_key_given_twice_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"sweep key 'seed' is given twice \(--sweep seed=1,2 and --sweep seed=3\)"):
        sweep_grid(None, ["seed=1,2", "seed=3"])
    path = tmp_path / "s.yaml"
    path.write_text("sweep:\n  seed: [1, 2]\n")
    with pytest.raises(ConfigError, match=f"given twice \\(the sweep: of {path} and --sweep seed=3\\)"):
        sweep_grid(path, ["seed=3"])


def test_an_override_given_twice_is_refused():
    with pytest.raises(ConfigError, match=r"override 'steps' is given twice \(steps=2 and 'steps=3'\)"):
        build_config(overrides=["steps=2", "steps=3"])


@pytest.mark.parametrize("sweep, points", [
    ("name=a,b", "1 ({'name': 'a'}) and 2 ({'name': 'b'})"),
    ("reward_fn=numeric,null", "1 ({'reward_fn': 'numeric'}) and 2 ({'reward_fn': None})"),  # null: the first
])
def test_sweep_points_that_are_one_config_are_refused(sweep, points, capsys, tmp_path):
    """Points whose values differ but whose resolved configs do not would train the same run twice."""
    from rlrunbook import cli

    code = cli.main(["train", "--model", "tiny", "--log-root", str(tmp_path), "--sweep", sweep])
    err = capsys.readouterr().err
    assert code == 2 and f"sweep points {points} give the same config apart from the run name" in err, err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_sweep_of_more_than_a_thousand_runs_is_refused():
    with pytest.raises(ConfigError, match=r"the sweep makes 1,024 runs \(32 x 32\), above the limit of 1,000"):
        sweep_grid(None, [f"seed={','.join(map(str, range(32)))}",
                          f"temperature={','.join(str(1 + i / 100) for i in range(32))}"])


# --- names that cannot be one line --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a\nb", "a\rb", "tab\there", "bell\x07"])
def test_a_name_with_a_control_character_is_refused(name, tmp_path):
    with pytest.raises(ConfigError, match="no newline or other control character"):
        _validated(name=name)
    with pytest.raises(ConfigError, match="contains a newline or another control character"):
        new_run_dir(tmp_path, "grpo", "qa", name)
    assert not any(tmp_path.iterdir())
