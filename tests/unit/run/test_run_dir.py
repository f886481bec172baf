"""Tests of the run directory: log root and run-dir naming, RunWriter, report.png.

The writer's promises are checked from the outside: no temp file survives a write or a failed
write, a failed write leaves the previous file intact, NaN never reaches disk, and no secret value
from the environment appears in any file of the run directory.
"""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import torch

import rlrunbook
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.run import RunWriter, log_root, new_run_dir, plot_report
from rlrunbook.run.metadata import REDACTED, git_state
from rlrunbook.run.schema import PNG_IEND, PNG_SIGNATURE

NOW = datetime(2025, 3, 4, 5, 6, 7)


def _row(step: int, **extra) -> dict:
    return {
        "step": step,
        "reward/mean": 0.1 * step,
        "reward/min": 0.0,
        "reward/max": 0.2 * step + 0.1,
        "loss/sum": 1.0 - 0.1 * step,
        "completion_length/mean": 10 + step,
        **extra,
    }


def _stray_files(run_dir: Path) -> list[str]:
    return [p.name for p in run_dir.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]


# --- paths -----------------------------------------------------------------------------------------


def test_log_root_precedence():
    both = {"RLRUNBOOK_LOG_ROOT": "/a", "TINKER_DEBATE_LOG_ROOT": "/b"}
    assert log_root("/cli", both) == Path("/cli")
    assert log_root(None, both) == Path("/a")
    assert log_root(None, {"TINKER_DEBATE_LOG_ROOT": "/dev/shm/logs"}) == Path("/dev/shm/logs")
    assert log_root(None, {}) == Path("logs")
    # An empty value is unset, not "the current directory".
    assert log_root("", {"RLRUNBOOK_LOG_ROOT": "", "TINKER_DEBATE_LOG_ROOT": "/b"}) == Path("/b")


def test_new_run_dir_name_and_never_reuses(tmp_path):
    first = new_run_dir(tmp_path / "logs", "debate", "qa", "smoke", now=NOW)
    assert first == tmp_path / "logs" / "20250304-050607_debate_qa_smoke" and first.is_dir()
    second = new_run_dir(tmp_path / "logs", "debate", "qa", "smoke", now=NOW)
    third = new_run_dir(tmp_path / "logs", "debate", "qa", "smoke", now=NOW)
    assert (second.name, third.name) == (
        "20250304-050607_debate_qa_smoke-2",
        "20250304-050607_debate_qa_smoke-3",
    )
    (tmp_path / "logs" / "20250304-050607_debate_qa_other").mkdir()  # made by someone else
    assert new_run_dir(tmp_path / "logs", "debate", "qa", "other", now=NOW).name.endswith("_other-2")


@pytest.mark.parametrize("bad", ["a/b", "..", "", "  ", "a\\b", "x\0y"])
def test_new_run_dir_rejects_path_like_names(tmp_path, bad):
    with pytest.raises(ConfigError, match="run name"):
        new_run_dir(tmp_path, "debate", "qa", bad, now=NOW)
    with pytest.raises(ConfigError, match="run env"):
        new_run_dir(tmp_path, "debate", bad, "ok", now=NOW)
    assert list(tmp_path.iterdir()) == []


# --- writer ----------------------------------------------------------------------------------------


@pytest.fixture
def writer(tmp_path) -> RunWriter:
    return RunWriter(new_run_dir(tmp_path, "single_turn", "qa", "t", now=NOW), environ={})


def test_metadata_fields(writer):
    config = {
        "mode": "single_turn",
        "env": "qa",
        "steps": 3,
        "seed": 7,
        "sampling": {"seed": 3, "stop_token": 2},
    }
    writer.write_metadata(
        config, {"steps": "cli", "seed": "default"}, ["rlrunbook", "train"], {"sha256": "ab"}
    )
    meta = json.loads(writer.metadata_path.read_text())
    assert meta["schema_version"] == 1 and meta["status"] == "running"
    assert datetime.fromisoformat(meta["started_at"]).utcoffset() == timezone.utc.utcoffset(None)
    assert meta["config"] == config  # stop_token is no secret: config keys use the narrow patterns
    assert meta["config_sources"]["steps"] == "cli" and meta["argv"] == ["rlrunbook", "train"]
    assert meta["seeds"] == {"seed": 7, "sampling.seed": 3}
    assert set(meta["versions"]) == {
        "python",
        "torch",
        "transformers",
        "peft",
        "tinker",
        "rlrunbook",
        "numpy",
        "torch_build",
    }
    # the distribution's version may lack the build's local tag (2.11.0 vs 2.11.0+cu130 on a CUDA image)
    assert meta["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert meta["versions"]["torch_build"] == torch.__version__
    assert (
        meta["hardware"]["cpu_count"] >= 1
        and meta["hardware"]["torch_cuda_available"] == torch.cuda.is_available()
    )
    assert meta["dataset"] == {"sha256": "ab"}


def _git_head(cwd: Path) -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


@pytest.mark.parametrize("where", ["source", "tmp"])
def test_git_state_matches_git(tmp_path, where):
    directory = Path(rlrunbook.__file__).resolve().parent if where == "source" else tmp_path
    head, state = _git_head(directory), git_state(directory)
    if head is None:
        assert state is None
    else:
        assert state is not None and state["commit"] == head and isinstance(state["dirty"], bool)


def test_finish_rewrites_status(writer):
    writer.write_metadata({"steps": 1}, {}, [], {})
    writer.finish("failed", error="CUDA out of memory")
    meta = json.loads(writer.metadata_path.read_text())
    assert (meta["status"], meta["error"]) == ("failed", "CUDA out of memory") and meta["finished_at"]
    # A writer re-created after a crash finishes from the file on disk.
    RunWriter(writer.run_dir, environ={}).finish("completed")
    meta = json.loads(writer.metadata_path.read_text())
    assert (meta["status"], meta["error"], meta["config"]) == ("completed", None, {"steps": 1})
    with pytest.raises(InputError, match="finish status"):
        writer.finish("done")


def test_secrets_never_reach_the_run_dir(tmp_path, monkeypatch):
    secrets = {
        "MY_API_KEY": "sk-live-0123456789abcdef",
        "HF_TOKEN": "hf_SeCrEtToKeNvAlUe42",
        "DB_PASSWORD": "correct-horse-battery",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_HOME", "/cache/hf")
    run_dir = new_run_dir(tmp_path, "single_turn", "qa", "secrets", now=NOW)
    writer = RunWriter(run_dir)
    argv = [
        "train",
        "--api-key",
        secrets["MY_API_KEY"],
        f"--hf-token={secrets['HF_TOKEN']}",
        "--pad-token",
        "0",
    ]
    config = {
        "mode": "single_turn",
        "steps": 1,
        "api_key": secrets["MY_API_KEY"],
        "note": f"password is {secrets['DB_PASSWORD']}",
    }
    writer.write_metadata(config, {}, argv, {"url": f"https://x:{secrets['DB_PASSWORD']}@host/data"})
    writer.log_step(_row(0, note=secrets["HF_TOKEN"]))
    writer.write_rollouts("baseline", 0, {"records": [{"completion_text": f"key {secrets['MY_API_KEY']}"}]})
    writer.write_report()
    writer.finish("completed")

    for path in run_dir.iterdir():
        data = path.read_bytes()
        for value in secrets.values():
            assert value.encode() not in data, f"{value} leaked into {path.name}"
    meta = json.loads(writer.metadata_path.read_text())
    assert meta["environment"]["HF_TOKEN"] == REDACTED and meta["environment"]["HF_HOME"] == "/cache/hf"
    assert "MY_API_KEY" not in meta["environment"]  # outside the recorded prefixes altogether
    assert meta["argv"] == ["train", "--api-key", REDACTED, f"--hf-token={REDACTED}", "--pad-token", "0"]
    assert meta["config"]["api_key"] == REDACTED and meta["config"]["note"] == f"password is {REDACTED}"


def test_writes_are_atomic_and_leave_no_temp_files(writer, monkeypatch):
    good = {"training_data": [{"completion_logprobs": [-0.5]}], "results": {"metrics": {"loss:sum": 1.0}}}
    writer.write_metadata({"steps": 1}, {}, [], {})
    path = writer.write_step(0, good)
    writer.write_rollouts("summary", 0, {"records": []})
    before = path.read_text()
    assert json.loads(before)["step"] == 0 and _stray_files(writer.run_dir) == []

    # A NaN deep inside is an error naming its key; the previous file stays whole.
    bad = {"training_data": [{"completion_logprobs": [-0.5, float("nan")]}]}
    with pytest.raises(
        InputError, match=r"training_step_0.json\['training_data'\]\[0\]\['completion_logprobs'\]\[1\]"
    ):
        writer.write_step(0, bad)
    # A crash between write and rename (here: the rename itself fails) removes the temp file.
    monkeypatch.setattr("os.replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        writer.write_step(0, {"training_data": []})
    assert path.read_text() == before and _stray_files(writer.run_dir) == []


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -float("inf"), np.float32("nan"), torch.tensor(float("inf"))]
)
def test_non_finite_metric_is_an_error(writer, value):
    writer.log_step(_row(0))
    with pytest.raises(InputError, match=r"reward/mean"):
        writer.log_step(_row(1, **{"reward/mean": value}))
    assert [r["step"] for r in writer.read_train_log()] == [0]


def test_numpy_and_torch_values_become_json_numbers(writer):
    writer.log_step(
        {
            "step": 0,
            "a": np.float32(0.5),
            "b": np.int64(3),
            "c": torch.tensor(2.0),
            "d": np.array([1, 2]),
            "e": torch.tensor([[1.5]]),
            "f": np.bool_(True),
        }
    )
    line = writer.train_log_path.read_text()
    assert json.loads(line) == {"step": 0, "a": 0.5, "b": 3, "c": 2.0, "d": [1, 2], "e": [[1.5]], "f": True}
    with pytest.raises(InputError, match="JSON keys must be str"):
        writer.log_step({"step": 1, 3: 1.0})
    with pytest.raises(InputError, match="no JSON form"):
        writer.log_step({"step": 1, "x": object()})


def test_step_and_kind_are_validated(writer):
    with pytest.raises(InputError, match="step 1 but was written as step 0"):
        writer.write_step(0, {"step": 1})
    with pytest.raises(InputError, match="rollout kind"):
        writer.write_rollouts("judge", 0, {})
    with pytest.raises(InputError, match="non-negative int"):
        writer.log_step({"loss": 1.0})
    with pytest.raises(InputError, match="does not exist"):
        RunWriter(writer.run_dir / "missing")


# --- report ----------------------------------------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and data.endswith(PNG_IEND)
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR width, height


@pytest.mark.parametrize("steps", [1, 5])
def test_report_png_for_one_and_many_steps(writer, steps):
    for step in range(steps):
        writer.log_step(_row(step))
    path = writer.write_report()
    width, height = _png_size(path)
    assert width > 2 * height and _stray_files(writer.run_dir) == []


def test_report_adds_a_panel_for_the_advantage_fraction(tmp_path):
    three = plot_report([_row(0), _row(1)], tmp_path / "three.png")
    four = plot_report([_row(0, **{"advantage/nonzero_fraction": 0.5}), _row(1)], tmp_path / "four.png")
    assert _png_size(four)[0] > _png_size(three)[0]
    with pytest.raises(InputError, match="no train-log rows"):
        plot_report([], tmp_path / "empty.png")
