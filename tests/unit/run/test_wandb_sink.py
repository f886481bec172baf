"""The W&B mirror: on only with WANDB_PROJECT, fed by RunWriter with redacted config, fail-fast without wandb.

A real training run with a fake ``wandb`` module is in test_validation.py (rows, steps, finish).
"""

from __future__ import annotations

import sys

import pytest
from fake_wandb import FakeWandb

from rlrunbook import cli
from rlrunbook.errors import ConfigError
from rlrunbook.run import RunWriter, wandb_sink


def test_writer_mirrors_metadata_rows_and_status(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    environ = {"WANDB_PROJECT": "proj", "OPENAI_API_KEY": "sk-secret-value-123"}
    writer = RunWriter(tmp_path, environ=environ, sink=wandb_sink.from_environ(environ))
    # openai_key's value is in no variable and its name is not secret: the credential in it is what W&B must not get
    writer.write_metadata({"env": "qa", "api_key": "sk-secret-value-123", "note": "key sk-secret-value-123",
                           "openai_key": "sk-only-in-config-42", "loss": {"kl_coef": 0.1}}, {}, [], {})
    writer.log_step({"step": 0, "loss/sum": 1.5, "num_datums": 4})
    writer.log_validation({"step": 1, "pass@1": 0.25, "pass@1_ci": [0.0, 0.5], "problem_ids": ["a"], "seed": 3})
    writer.finish("failed", error="boom")
    assert fake.calls == [
        ("init", (), {"project": "proj", "name": tmp_path.name,
                      "config": {"env": "qa", "api_key": "<redacted>", "note": "<redacted>",
                                 "openai_key": "<redacted>", "loss": {"kl_coef": 0.1}}}),
        ("log", ({"loss/sum": 1.5, "num_datums": 4},), {"step": 0}),
        ("log", ({"val/pass@1": 0.25, "val/pass@1_ci_low": 0.0, "val/pass@1_ci_high": 0.5, "val/seed": 3},),
         {"step": 1}),
        ("finish", (), {"exit_code": 1}),
    ]


def test_nothing_is_imported_without_wandb_project(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` would raise ImportError
    assert wandb_sink.from_environ({}) is None
    assert wandb_sink.from_environ({"WANDB_PROJECT": "  "}) is None
    with pytest.raises(ConfigError, match="pip install wandb"):
        wandb_sink.from_environ({"WANDB_PROJECT": "proj"})


def test_missing_wandb_fails_before_any_model_or_run_directory(tmp_path, monkeypatch, capsys):
    from rlrunbook import backend

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    monkeypatch.setattr(backend, "create_service_client", lambda **_: pytest.fail("a model was loaded"))
    code = cli.main(["train", "--model", "tiny", "--env", "qa", "-n", "4", "--log-root", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 2 and "pip install wandb" in err and "WANDB_PROJECT='proj'" in err
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())
