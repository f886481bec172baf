"""Hostile input through the installed ``rlrunbook`` command, as users type it (issue 24, points 2 and 3):
each case ends in exit 2 with one ``error:`` paragraph naming the limit or the rule, no traceback, in bounded
time, and no run directory. Before these limits ``-n 100000000000000000000`` sampled until killed, the alias
bomb exhausted memory, and ``--seed 10^23`` ended in ``OverflowError``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rlrunbook.testing.commands import installed_rlrunbook

TRAIN = ["train", "--model", "tiny", "--env", "qa", "--dataset", "test", "-n", "8", "--num-groups", "2"]
BOMB = "\n".join([f"a: &a [{', '.join(['lol'] * 9)}]"]
                 + [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)])


def _command() -> str:
    return installed_rlrunbook()


def _refused(tmp_path: Path, *args: str) -> str:
    """Run the command; assert exit 2 with one error paragraph, no traceback, no run directory; the message."""
    logs = tmp_path / "logs"
    done = subprocess.run([_command(), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "RLRUNBOOK_LOG_ROOT": str(logs)})
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, err[-2000:])
    assert "Traceback" not in err and err.count("error:") == 1, err[-2000:]
    assert not logs.exists() or not any(logs.iterdir()), "nothing may be written for refused input"
    return err


@pytest.mark.parametrize("args, match", [
    (["-n", "100000000000000000000"], "-n (num_rollouts) 100000000000000000000 is above its limit of 65,536"),
    (["--seed", "100000000000000000000000"], "--seed (seed) 100000000000000000000000 is above its limit of "
                                             "2^63 - 1"),
    (["extra.test_size=abc"], "extra.test_size='abc' is a string, but it must be an integer"),
    (["--judge-model", "tiny"], "--judge-model (judge_model) 'tiny' has no effect in this run"),
    (["--name", "two\nlines"], "--name 'two\\nlines' must be a plain name"),
])
def test_train_refuses(tmp_path, args, match):
    err = _refused(tmp_path, *TRAIN, *args)
    assert match in err, err


def test_an_alias_bomb_in_a_config_file_is_refused_quickly(tmp_path):
    (tmp_path / "bomb.yaml").write_text(BOMB + "\n")
    err = _refused(tmp_path, "train", "--config-file", str(tmp_path / "bomb.yaml"))
    assert "its aliases expand to" in err and "more than the limit of 100,000" in err, err


def test_a_data_file_with_a_huge_integer_is_refused(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"question": "q", "answer": "#### 4", "id": ' + "9" * 5001 + "}\n")
    err = _refused(tmp_path, *TRAIN[:5], "--dataset", str(tmp_path / "d.jsonl"), "-n", "8", "--num-groups", "2")
    assert "d.jsonl: line 1: holds an integer of 5,001 digits" in err, err


def test_eval_refuses_a_sample_count_beyond_its_limit(tmp_path):
    done = subprocess.run([_command(), "eval", "--model", "tiny", "--samples", "100000000000000000000"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --samples: 100000000000000000000 is outside 1..65,536" in done.stderr, done.stderr


def test_package_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    err = _refused(tmp_path, "package", str(tmp_path / "notes"), "--out", str(tmp_path / "n.tar.gz"))
    assert "is not a run directory: it holds no run_metadata.json" in err, err
    assert not (tmp_path / "n.tar.gz").exists()
