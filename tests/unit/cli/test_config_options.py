"""train's options are derived from the config's fields: a field added to the config is an option, with its
help, default and range, and the option's value reaches the config's ``cli`` layer under the field's key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field, create_model

from rlrunbook.cli import app, config_options
from rlrunbook.rl.setup import config as config_module
from rlrunbook.rl.setup.config import LossSettings, TrainConfig

ROOT = Path(__file__).resolve().parents[3]


def _with_fields(monkeypatch, flat: dict | None = None, loss: dict | None = None) -> None:
    """Stand a TrainConfig with extra fields in for the real one, as a contributor adding a field would."""
    loss_model = create_model("GrownLoss", __base__=LossSettings, **(loss or {})) if loss else LossSettings
    grown = create_model("GrownConfig", __base__=TrainConfig, loss=(loss_model, Field(default_factory=loss_model)),
                         **(flat or {}))
    monkeypatch.setattr(config_module, "TrainConfig", grown)


def test_a_field_added_to_the_config_is_an_option_with_its_help(monkeypatch, capsys):
    _with_fields(monkeypatch, flat={"warmup_steps": (int, Field(3, ge=0, description="steps of linear warm-up"))},
                 loss={"clip_ratio": (float, Field(0.2, gt=0, description="the PPO clip range"))})
    args = app.parse_args(["train", "--warmup-steps", "5", "--loss-clip-ratio", "0.3"])
    assert config_options.given_values(args) == {"warmup_steps": 5, "loss.clip_ratio": 0.3}
    with pytest.raises(SystemExit):
        app.parse_args(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--warmup-steps N steps of linear warm-up (default 3; >= 0)" in shown
    assert "--loss-clip-ratio X the PPO clip range (default 0.2; > 0)" in shown


def test_a_true_false_field_takes_both_forms(monkeypatch):
    _with_fields(monkeypatch, flat={"fast_mode": (bool, Field(False, description="go fast"))})
    assert config_options.given_values(app.parse_args(["train", "--fast-mode"]))["fast_mode"] is True
    assert config_options.given_values(app.parse_args(["train", "--no-fast-mode"]))["fast_mode"] is False
    assert "fast_mode" not in config_options.given_values(app.parse_args(["train"]))


def test_a_field_without_an_option_form_is_refused_by_name(monkeypatch):
    _with_fields(monkeypatch, flat={"table": (dict[str, int], Field(default_factory=dict, description="x"))})
    with pytest.raises(TypeError, match="config field table .* NOT_OPTIONS"):
        list(config_options.config_options())


def test_every_field_but_version_and_extra_is_an_option_with_distinct_flags():
    leaves = [name for name, field in TrainConfig.model_fields.items() if name not in ("version", "extra")
              and not hasattr(field.annotation, "model_fields")]
    sections = [f"{name}.{leaf}" for name, field in TrainConfig.model_fields.items()
                if hasattr(field.annotation, "model_fields") for leaf in field.annotation.model_fields]
    options = list(config_options.config_options())
    assert [option.key for option in options] == leaves + sections
    flags = [flag for option in options for flag in option.flags]
    assert len(flags) == len(set(flags))


def test_the_established_flags_set_their_section_keys():
    args = app.parse_args(["train", "-n", "8", "-s", "2", "--kl-coef", "0.1", "--val-every", "2",
                           "--cache-dataset", "--blocklist", "a", "--blocklist", "b", "--backend-dtype", "bfloat16"])
    assert config_options.given_values(args) == {
        "num_rollouts": 8, "steps": 2, "loss.kl_coef": 0.1, "validation.every": 2, "data.cache": True,
        "reward.blocklist": ["a", "b"], "backend.dtype": "bfloat16"}


def test_each_option_value_reaches_the_resolved_config():
    """Every option, given a value of its type, is recorded as a ``cli`` value of its key."""
    from rlrunbook.rl.setup.config_sources import build_config

    for option in config_options.config_options():
        if option.kind is bool:
            argv, expected = [option.flags[-1]], True
        elif option.choices:
            argv, expected = [option.flags[-1], option.choices[-1]], option.choices[-1]
        else:
            continue
        resolved = build_config(cli=config_options.given_values(app.parse_args(["show-config", *argv])))
        node = resolved.config
        for part in option.key.split("."):
            node = getattr(node, part)
        assert node == expected and resolved.sources[option.key] == "cli", option.key


def test_the_reference_table_in_docs_is_current():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_logprob_check_arguments_carry_a_lora_runs_rank_and_no_rank_for_full_training():
    """``show-config --check-logprobs-args``: the rank a LoRA run trains with (16 where the config leaves it null),
    and no ``--lora-rank`` for a full fine-tune, whose config has none."""
    from rlrunbook.cli.train import check_logprobs_arguments
    from rlrunbook.rl.setup.config_sources import build_config

    lora = check_logprobs_arguments(build_config(cli={"model": "tiny"}).config)
    assert lora[:4] == ["--model", "tiny", "--lora-rank", "16"]
    full = check_logprobs_arguments(build_config(cli={"model": "tiny", "finetune": "full"}).config)
    assert full[:3] == ["--model", "tiny", "--temperature"]
