"""Config files, presets, dotted overrides, strictness, value sources and sweeps."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from rlrunbook import cli
from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.config import CONFIG_VERSION, TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.config_sources import (
    PRESET_DIR,
    build_config,
    leaf_keys,
    list_presets,
    parse_override,
    parse_sweep,
    parse_value,
    sweep_grid,
    sweep_name,
)

SHIPPED_PRESETS = {"tiny-cpu-smoke", "smollm2-cpu-mini", "gpu-4b-lora", "gpu-8b-lora-4bit", "h100-rlvr",
                   "h100-rlvr-full"}


def _write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_the_six_presets_ship():
    assert SHIPPED_PRESETS <= set(list_presets())


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
def test_every_shipped_preset_is_complete_and_valid(preset):
    """Each preset states every field (passes --strict-config) and passes the run's cross-field rules."""
    resolved = build_config(file=preset, strict=True)
    assert set(resolved.sources.values()) == {f"file:{PRESET_DIR / (preset + '.yaml')}"}
    config = validate(resolved.config)
    assert config.version == CONFIG_VERSION


def test_rlvr_preset_carries_the_run_notes_figures():
    config = build_config(file="h100-rlvr").config
    assert (config.learning_rate, config.loss.kl_coef, config.loss.kl_estimator) == (1e-6, 0.001, "low_var_kl")
    assert (config.reward.verify_weight, config.reward.format_weight, config.reward.reflect_weight) == (1.0, 0.5, 0.5)
    assert (config.temperature, config.group_size, config.num_groups) == (0.6, 4, 64)
    assert (config.data.max_prompt_tokens, config.max_tokens, config.steps) == (1024, 1536, 220)
    assert config.checkpoint.every == 50 and config.validation.every == 50


def test_the_full_rlvr_preset_is_the_rlvr_run_with_every_weight_trained():
    """h100-rlvr-full is h100-rlvr as its run notes trained it: full fine-tuning in bf16 with activation
    checkpointing; every other value is the LoRA preset's."""
    lora, full = (validate(build_config(file=name, strict=True).config) for name in ("h100-rlvr", "h100-rlvr-full"))
    assert (full.finetune, full.lora_rank, full.train_unembed) == ("full", None, None)
    assert (full.backend.dtype, full.backend.activation_checkpointing) == ("bfloat16", "on")
    assert (full.learning_rate, full.loss.kl_coef, full.loss.kl_estimator) == (1e-6, 0.001, "low_var_kl")
    assert full.model == "Qwen/Qwen2.5-Math-1.5B"
    same = {"finetune", "lora_rank", "train_unembed", "name", "backend"}
    assert {k: v for k, v in full.to_dict().items() if k not in same} == \
        {k: v for k, v in lora.to_dict().items() if k not in same}


def test_layers_override_in_order_and_record_their_source(tmp_path):
    path = _write(tmp_path, {"steps": 2, "seed": 5, "learning_rate": 1e-3, "loss": {"kl_coef": 0.1}})
    resolved = build_config(file=path, overrides=["steps=3", "loss.kl_coef=0.2", "loss.entropy_coef=0.01"],
                            cli={"steps": 4, "loss.kl_coef": 0.3})
    config, sources = resolved.config, resolved.sources
    assert (config.steps, config.seed, config.learning_rate) == (4, 5, 1e-3)
    assert (config.loss.kl_coef, config.loss.entropy_coef) == (0.3, 0.01)
    assert sources["steps"] == "cli" and sources["loss.kl_coef"] == "cli"
    assert sources["seed"] == f"file:{path}" and sources["learning_rate"] == f"file:{path}"
    assert sources["loss.entropy_coef"] == "override"
    assert sources["temperature"] == "default" and sources["checkpoint.every"] == "default"
    assert set(sources) >= set(leaf_keys())


@pytest.mark.parametrize("text, value", [("4", 4), ("1e-4", 1e-4), ("3.5E+2", 350.0), ("true", True),
                                         ("null", None), ("abc", "abc"), ("[a, b]", ["a", "b"])])
def test_values_parse_as_yaml(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_an_unquoted_on_or_off_switch_reads_as_the_word():
    """YAML 1.1 reads ``on`` and ``off`` as true and false; the checkpointing switch takes them as written (the knob
    that memory refusals name: ``backend.activation_checkpointing=on``)."""
    for word in ("on", "off", "auto"):
        config = build_config(overrides=[f"backend.activation_checkpointing={word}"]).config
        assert config.backend.activation_checkpointing == word
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        build_config(overrides=["backend.activation_checkpointing=sometimes"])


def test_override_syntax_errors_name_the_form():
    assert parse_override("loss.kl_coef=0.05") == ("loss.kl_coef", 0.05)
    for bad in ("steps", "=3"):
        with pytest.raises(ConfigError, match="key.sub=value"):
            parse_override(bad)


@pytest.mark.parametrize("file_data, overrides, match", [
    ({"stepz": 3}, [], "unknown config key 'stepz'.*Did you mean 'steps'"),
    ({"loss": {"kl_coeff": 0.1}}, [], "unknown config key 'loss.kl_coeff'.*'loss.kl_coef'"),
    ({}, ["checkpoint.evry=2"], r"unknown config key 'checkpoint.evry' \(override\).*'checkpoint.every'"),
    ({"steps": "four"}, [], "steps: .*integer.*'four', from file:"),
    ({}, ["loss.kl_coef=-1"], r"loss.kl_coef: .*greater than or equal to 0.*from override"),
    ({"loss": 3}, [], "'loss' is a section, not a value.*loss.kl_coef"),
    ({}, ["steps.sub=1"], "unknown config key 'steps.sub'"),
])
def test_bad_keys_and_types_are_refused_by_name(tmp_path, file_data, overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(file=_write(tmp_path, file_data), overrides=overrides)


def test_missing_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="not a preset. Presets: .*tiny-cpu-smoke"):
        build_config(file="no-such-preset")


@pytest.mark.parametrize("text, match", [("- 1\n- 2\n", "must be a mapping"), ("steps: [1\n", "not valid YAML")])
def test_malformed_files_are_refused(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        build_config(file=path)


def test_strict_refuses_fields_the_file_leaves_to_defaults(tmp_path):
    full = TrainConfig().to_dict()
    assert build_config(file=_write(tmp_path, full), strict=True).config == TrainConfig()
    del full["loss"]["kl_coef"], full["seed"]
    with pytest.raises(ConfigError, match=r"2 field\(s\) fell back .*: seed, loss.kl_coef"):
        build_config(file=_write(tmp_path, full), strict=True)
    # A value given on the command line did not fall back to a default.
    assert build_config(file=_write(tmp_path, full), strict=True, overrides=["seed=1"],
                        cli={"loss.kl_coef": 0.0}).config.seed == 1
    with pytest.raises(ConfigError, match="no config file"):
        build_config(strict=True)


def test_another_schema_version_is_refused(tmp_path):
    config = build_config(file=_write(tmp_path, {"version": 2})).config
    with pytest.raises(ConfigError, match="config version 2 is not supported"):
        validate(config)


def test_sweep_expands_to_every_combination(tmp_path):
    path = _write(tmp_path, {"name": "base", "sweep": {"learning_rate": [1e-4, 3e-4]}})
    points = sweep_grid(path, ["seed=0,1,2"])
    assert len(points) == 6
    assert {(p["learning_rate"], p["seed"]) for p in points} == {(a, b) for a in (1e-4, 3e-4) for b in (0, 1, 2)}
    assert sweep_name("base", points[0]) == "base-learning_rate-0.0001-seed-0"
    assert sweep_grid(None, []) == [{}]
    assert parse_sweep("loss.kl_coef=[0.0, 0.1]") == ("loss.kl_coef", [0.0, 0.1])
    with pytest.raises(ConfigError, match="unknown config key 'sead'"):
        sweep_grid(None, ["sead=1,2"])
    with pytest.raises(ConfigError, match="must map keys to non-empty lists"):
        sweep_grid(_write(tmp_path, {"sweep": {"seed": 3}}, "bad.yaml"), [])


def test_loss_fn_config_sends_only_what_applies():
    assert TrainConfig().loss_fn_config() == {}
    assert TrainConfig(loss_fn="ppo").loss_fn_config() == {}  # the loss's own defaults (0.8, 1.2)
    ppo = TrainConfig(loss_fn="ppo", loss={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    assert ppo.loss_fn_config() == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    regularised = TrainConfig(loss={"kl_coef": 0.01, "entropy_coef": 0.001, "kl_estimator": "k1"})
    assert regularised.loss_fn_config() == {"kl_coef": 0.01, "kl_estimator": "k1", "entropy_coef": 0.001}


@pytest.mark.parametrize("args, match", [
    (["loss.kl_coef=oops"], "loss.kl_coef: .*valid number"),
    (["--config-file", "nope"], "not a preset"),
    (["--loss-fn", "ppo", "loss.clip_low_threshold=1.5", "loss.clip_high_threshold=1.2"], "must be below"),
    (["--truncate-prompts"], "needs --max-prompt-tokens"),
    (["--reject-blocklisted"], "empty blocklist"),
    (["--sweep", "steps=1,0"], "must all be >= 1"),
    (["--strict-config"], "strict-config"),
])
def test_bad_config_input_fails_before_loading(args, match, capsys, monkeypatch, tmp_path):
    from rlrunbook import backend

    monkeypatch.setattr(backend, "create_service_client", lambda **_: pytest.fail("a model was loaded"))
    assert cli.main(["train", "--log-root", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert not any(tmp_path.iterdir()), "nothing may be written for an invalid configuration"


def test_show_config_prints_the_resolved_values_and_sources(capsys):
    assert cli.main(["show-config", "--config-file", "tiny-cpu-smoke", "steps=5", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    document = yaml.safe_load(out.split("---")[0])
    assert (document["steps"], document["seed"], document["model"]) == (5, 3, "tiny")
    assert "#   steps: override" in out and "#   seed: cli" in out


def test_run_metadata_records_every_value_and_its_source(tmp_path):
    path = _write(tmp_path, {"model": "tiny", "env": "qa", "dataset": "test", "num_rollouts": 8, "num_groups": 2,
                             "max_tokens": 8, "learning_rate": 1e-3}, "cfg.yaml")
    logs = tmp_path / "logs"
    cli.main(["train", "--config-file", str(path), "name=meta", "--seed", "1", "--log-root", str(logs)])
    (run_dir,) = logs.iterdir()
    metadata = json.loads((run_dir / "run_metadata.json").read_text())
    sources = metadata["config_sources"]
    assert sources["model"] == f"file:{path}" and sources["name"] == "override" and sources["seed"] == "cli"
    assert sources["steps"] == "default" and sources["loss.kl_coef"] == "default"
    assert metadata["config"]["seed"] == 1 and metadata["config"]["name"] == "meta"
    assert metadata["config"]["loss"]["kl_coef"] == 0.0


def test_overrides_may_sit_anywhere_among_the_flags():
    args = cli.parse_args(["train", "steps=3", "--seed", "2", "loss.kl_coef=0.1", "--name", "x", "validation.every=2"])
    assert args.overrides == ["steps=3", "loss.kl_coef=0.1", "validation.every=2"]
    assert (args.seed, args.name) == (2, "x")
    with pytest.raises(SystemExit):
        cli.parse_args(["train", "--seed", "2", "--bogus"])
    assert cli.main(["show-config", "--seed", "2", "not-an-override"]) == 2  # "not of the form key.sub=value"


def test_trainer_regularisers_reach_the_train_log(tmp_path):
    """--kl-coef / --entropy-coef / --loss-fn ppo: every row logs the loss split and the diagnostics."""
    code = cli.main(["train", "--config-file", "tiny-cpu-smoke", "checkpoint.every=0", "--kl-coef", "0.05",
                     "--entropy-coef", "0.001", "--loss-fn", "ppo", "--grad-clip-norm", "1.0",
                     "--log-root", str(tmp_path)])
    assert code == 0
    (run,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["loss/sum"] == pytest.approx(row["loss_pg"] + row["loss_kl"] + row["loss_entropy"], rel=1e-5)
        assert row["kl_divergence"] >= 0 and row["entropy"] > 0 and 0 <= row["clip_fraction"] <= 1
        assert row["mismatch/abs_logprob_diff"] < 1e-4  # sampler and trainer agree in fp32 (1e-4 gate)
    assert rows[0]["kl_divergence"] == pytest.approx(0.0, abs=1e-7)  # the fresh adapter is the reference
    assert rows[1]["kl_divergence"] > 0  # one step later the policy has moved off it
