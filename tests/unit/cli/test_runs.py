"""The run tools on a real (tiny) run: summarize, package, eval, check-run."""

from __future__ import annotations

import json

import pytest

from rlrunbook import cli


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("logs")
    assert cli.main(["train", "--model", "tiny", "-n", "8", "-s", "2", "--max-tokens", "12",
                     "--log-root", str(root), "--name", "tools"]) == 0
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return run


def test_check_run_and_summarize(tiny_run, tmp_path, capsys):
    assert cli.main(["check-run", str(tiny_run)]) == 0
    out = tmp_path / "table.csv"
    assert cli.main(["summarize", str(tiny_run), "--out", str(out)]) == 0
    header, row = out.read_text().splitlines()[:2]
    assert "task_reward_last" in header and "completed" in row and tiny_run.name in row
    broken = tmp_path / "not_a_run"
    broken.mkdir()
    assert cli.main(["summarize", str(tiny_run), str(broken)]) == 1
    assert "unreadable" in capsys.readouterr().out


def test_package_verifies_and_refuses_overwrite(tiny_run, tmp_path, capsys):
    archive = tmp_path / "run.tar.gz"
    assert cli.main(["package", str(tiny_run), "--archive", "--out", str(archive)]) == 0
    assert "verified" in capsys.readouterr().out and archive.is_file()
    assert cli.main(["package", str(tiny_run), "--out", str(archive)]) == 2
    assert "exist" in capsys.readouterr().err


def test_package_refuses_a_run_holding_a_secret(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MY_SERVICE_API_KEY", "s3cr3t-value-123")
    (tiny_run / "notes.txt").write_text("key=s3cr3t-value-123\n")
    try:
        assert cli.main(["package", str(tiny_run), "--out", str(tmp_path / "x.tar.gz")]) == 1
        err = capsys.readouterr().err
        assert "MY_SERVICE_API_KEY" in err and "s3cr3t-value-123" not in err
    finally:
        (tiny_run / "notes.txt").unlink()


def test_eval_reports_pass_at_k_with_intervals(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--model", "tiny", "--env", "qa", "--dataset", "test", "--num-problems", "4",
                     "--samples", "4", "--ks", "1", "4", "--threshold", "0.1", "--max-tokens", "8",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pass@1:" in printed and "pass@4:" in printed and "bootstrap CI" in printed
    document = json.loads(out.read_text())
    assert len(document["rewards"]) == 4 and all(len(r) == 4 for r in document["rewards"])
    assert document["pass@1"] <= document["pass@4"]


def test_eval_warns_when_no_sample_can_reach_the_threshold(capsys):
    assert cli.main(["eval", "--model", "tiny", "--env", "qa", "--dataset", "test", "--num-problems", "2",
                     "--samples", "2", "--ks", "1", "--threshold", "5", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "pass@1: 0.0000" in captured.out
    (warning,) = [line for line in captured.err.splitlines() if line.startswith("warning: no sample reached")]
    assert "--threshold 5 (the highest reward was" in warning


def test_eval_refuses_k_above_samples_before_loading(capsys, monkeypatch):
    from rlrunbook import backend

    monkeypatch.setattr(backend, "create_service_client", lambda **_: pytest.fail("a model was loaded"))
    assert cli.main(["eval", "--samples", "2", "--ks", "1", "4"]) == 2
    assert "4" in capsys.readouterr().err
