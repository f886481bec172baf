"""A shipped preset runs as stated, and a sweep runs one checked run per combination."""

from __future__ import annotations

import json

import pytest

from rlrunbook import cli
from rlrunbook.rl.setup.config_sources import PRESET_DIR
from rlrunbook.run import check_run, format_results, rubric_passed

pytestmark = pytest.mark.e2e


def _runs(root):
    return sorted(p for p in root.iterdir() if p.is_dir())


def test_tiny_smoke_preset_runs_under_strict_config(tmp_path, capsys):
    code = cli.main(["train", "--config-file", "tiny-cpu-smoke", "--strict-config", "--log-root", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    (run,) = _runs(tmp_path)
    assert rubric_passed(check_run(run)), format_results(check_run(run))
    metadata = json.loads((run / "run_metadata.json").read_text())
    preset = f"file:{PRESET_DIR / 'tiny-cpu-smoke.yaml'}"
    assert metadata["config_sources"]["log_root"] == "cli"
    assert {v for k, v in metadata["config_sources"].items() if k != "log_root"} == {preset}
    assert len((run / "train_log.jsonl").read_text().splitlines()) == metadata["config"]["steps"] == 2


def test_sweep_runs_one_checked_run_per_point(tmp_path, capsys):
    code = cli.main(["train", "--config-file", "tiny-cpu-smoke", "steps=1", "checkpoint.every=0",
                     "--sweep", "learning_rate=1e-3,1e-2", "--sweep", "seed=0,1", "--log-root", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    runs = _runs(tmp_path)
    assert len(runs) == 4 and out.count("[sweep] run ") == 4
    points = set()
    for run in runs:
        metadata = json.loads((run / "run_metadata.json").read_text())
        config, sources = metadata["config"], metadata["config_sources"]
        points.add((config["learning_rate"], config["seed"]))
        assert sources["learning_rate"] == sources["seed"] == "sweep" and sources["steps"] == "override"
        assert config["name"] == f"tiny-smoke-learning_rate-{config['learning_rate']}-seed-{config['seed']}"
        assert rubric_passed(check_run(run))
    assert points == {(lr, seed) for lr in (1e-3, 1e-2) for seed in (0, 1)}
    assert "learning_rate-0.01-seed-1" in out.split("[sweep] run 4/4")[-1]  # the closing summary table
