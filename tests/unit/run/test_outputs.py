"""Nothing of a run is overwritten by a command that writes elsewhere (issue 24, point 6): ``eval --out``,
``summarize --out``, ``eval-checkpoints --out`` and ``package --out`` pointed at a run's own files or
checkpoints are refused, naming the path, before any work; the run's files are byte for byte unchanged.
Found as ``eval --out RUN/run_metadata.json`` replacing the run's metadata without a word.
"""

from __future__ import annotations

import json
import os

import pytest

from rlrunbook import cli
from rlrunbook.errors import ConfigError
from rlrunbook.run.outputs import check_not_a_run_file, enclosing_run


@pytest.fixture
def no_model_load(monkeypatch):
    from rlrunbook.models import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the output path was refused")

    monkeypatch.setattr(loading, "load_causal_lm", refuse)
    monkeypatch.setattr(loading, "load_tokenizer", refuse)


def make_run(root, name="20260101-000000_grpo_qa_run"):
    """A run directory's files as a run writes them (their content does not matter here)."""
    run = root / name
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "run_metadata.json").write_text(json.dumps({"status": "completed", "config": {}}))
    (run / "train_log.jsonl").write_text('{"step": 0}\n')
    (run / "training_step_0.json").write_text("{}")
    (run / "baseline_0.json").write_text("{}")
    (run / "report.png").write_bytes(b"\x89PNG")
    (run / "checkpoints" / "step_000001" / "checkpoint.json").write_text("{}")
    (run / "notes.txt").write_text("the user's own")
    return run


def snapshot(run):
    return {path: path.read_bytes() for path in sorted(run.rglob("*")) if path.is_file()}


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path)


def refused(capsys, argv) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and "\n" not in err, err
    return err


@pytest.mark.parametrize("target", ["run_metadata.json", "train_log.jsonl", "training_step_0.json",
                                    "baseline_0.json", "report.png", "notes.txt",
                                    "checkpoints/step_000001/checkpoint.json", "checkpoints/new.json",
                                    "training_step_7.json", "validation.jsonl"])
def test_eval_out_into_a_run_is_refused(run, target, capsys, no_model_load):
    before = snapshot(run)
    err = refused(capsys, ["eval", "--model", "tiny", "--out", str(run / target)])
    assert f"--out {str(run / target)!r} is {target} of the run {run}" in err
    assert "would replace that run's own record. Write elsewhere" in err
    assert snapshot(run) == before and not (run / "checkpoints" / "new.json").exists()


def test_summarize_out_into_a_run(run, capsys):
    before = snapshot(run)
    err = refused(capsys, ["summarize", str(run), "--out", str(run / "train_log.jsonl")])
    assert "is train_log.jsonl of the run" in err and snapshot(run) == before


def test_eval_checkpoints_out_into_a_checkpoint(run, capsys, no_model_load):
    before = snapshot(run)
    target = run / "checkpoints" / "step_000001" / "table.csv"
    err = refused(capsys, ["eval-checkpoints", str(run), "--out", str(target)])
    assert "is checkpoints/step_000001/table.csv of the run" in err and snapshot(run) == before


def test_package_out_into_another_run(tmp_path, capsys):
    other = make_run(tmp_path, "20260102-000000_grpo_qa_other")
    run = make_run(tmp_path)
    before = snapshot(other)
    err = refused(capsys, ["package", str(run), "--out", str(other / "run_metadata.json"), "--overwrite"])
    assert f"is run_metadata.json of the run {other}" in err and snapshot(other) == before


def test_a_link_into_a_run_is_followed(run, tmp_path, capsys, no_model_load):
    (tmp_path / "link").symlink_to(run)
    err = refused(capsys, ["eval", "--model", "tiny", "--out", str(tmp_path / "link" / "run_metadata.json")])
    assert f"of the run {run}" in err


def test_a_new_file_beside_a_runs_files_and_files_elsewhere_are_allowed(run, tmp_path):
    check_not_a_run_file(run / "eval_results.json")  # a name the run does not write, not there yet
    check_not_a_run_file(tmp_path / "table.csv")
    assert enclosing_run(tmp_path / "table.csv") is None
    assert enclosing_run(run / "checkpoints" / "step_000001" / "x") == run


def test_the_message_suggests_a_path_outside_the_run(run):
    with pytest.raises(ConfigError) as caught:
        check_not_a_run_file(run / "run_metadata.json", "--out")
    suggestion = str(run.parent / f"{run.name}_run_metadata.json")
    assert f"e.g. --out {suggestion!r}" in str(caught.value)
    assert enclosing_run(suggestion) is None and not os.path.exists(suggestion)
