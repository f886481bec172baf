"""Exact resume of ``rlrunbook train`` from checkpoints, including after a process killed mid-save.

Reference: one straight run of 6 steps, checkpoints every 2 (after steps 2, 4, 6). Nothing in a step
depends on the total step count, so its first 4 steps are what a ``-s 4`` run computes.

(a) ``-s 2`` then ``--resume-from <run> -s 4``: train-log rows of steps 2-3 (losses, rewards,
    advantages; timings and memory dropped), sampled tokens and the step-4 adapter equal the straight run's.
(b) a run killed (``os._exit``) inside the save of step 4, after the data files were written and before
    the manifest and the rename, then ``--resume-from <run>``: it restarts from step 2 and ends equal
    to the straight run. The kill is a test-side patch in a driver script, not a hook in the library.

Configuration: qa/test on ``tiny``, 2 groups of 8 rollouts, 32 tokens, lr 1e-3, seed 1. In steps 1 and 2
dynamic sampling replaces tied groups (3 and 4 groups drawn), so the step-2 checkpoint's data cursor is
problem 5, not 2 * 2: a resume that took the step number for the cursor would draw other problems.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlrunbook import cli
from rlrunbook.run import check_run, format_results, rubric_passed
from rlrunbook.run.checkpoint_format import checkpoint_dirs

pytestmark = pytest.mark.e2e

TRAIN = ["--model", "tiny", "--env", "qa", "--dataset", "test", "-n", "16", "--num-groups", "2",
         "--max-tokens", "32", "--learning-rate", "1e-3", "--seed", "1", "--deterministic", "--checkpoint-every", "2"]
VOLATILE = ("time/", "throughput/", "memory/")
CRASH_EXIT = 86
DRIVER = """
import os, sys
from rlrunbook import cli
from rlrunbook.run import checkpoint_format as checkpoints

write_manifest = checkpoints._write_manifest

def die_saving_step_4(folder, checkpoint, names):  # test hook: the data files are written, nothing else
    if checkpoint.step == 4:
        os._exit({code})
    write_manifest(folder, checkpoint, names)

checkpoints._write_manifest = die_saving_step_4
sys.exit(cli.main(sys.argv[1:]))
"""


def train(log_root: Path, *args: str) -> Path:
    before = set(log_root.iterdir()) if log_root.is_dir() else set()
    code = cli.main(["train", "--log-root", str(log_root), *args])
    (run,) = set(log_root.iterdir()) - before
    assert code == 0
    results = check_run(run)
    assert rubric_passed(results), format_results(results)
    return run


def rows(run: Path) -> dict[int, dict]:
    lines = (run / "train_log.jsonl").read_text().splitlines()
    return {row["step"]: {k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in map(json.loads, lines)}


def tokens(run: Path, step: int) -> list[list[int]]:
    return [r["completion_tokens"] for r in json.loads((run / f"baseline_{step}.json").read_text())["records"]]


def adapter(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "adapter.safetensors"))


def assert_same_run(straight: Path, resumed: Path, steps: range, final: int) -> None:
    expected, got = rows(straight), rows(resumed)
    assert set(got) == set(range(final)), "resumed run lacks the copied or the new rows"
    for step in steps:
        assert got[step] == expected[step], f"step {step} differs"
        assert tokens(resumed, step) == tokens(straight, step), f"sampled tokens of step {step} differ"
    a, b = adapter(straight, final), adapter(resumed, final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final adapters differ"


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = train(tmp_path_factory.mktemp("straight"), *TRAIN, "-s", "6")
    assert [step for step, _ in checkpoint_dirs(run)] == [2, 4, 6]
    return run


def test_resume_continues_bit_for_bit(tmp_path, straight):
    first = train(tmp_path / "first", *TRAIN, "-s", "2")
    untouched = digest(first)
    resumed = train(tmp_path / "resumed", "--resume-from", str(first), "-s", "4")
    assert_same_run(straight, resumed, range(2, 4), final=4)
    assert digest(first) == untouched, "the old run directory was modified"
    meta = json.loads((resumed / "run_metadata.json").read_text())
    assert meta["resumed_from"] == {"path": str(first / "checkpoints" / "step_000002"), "run": str(first), "step": 2}
    cursor = json.loads((first / "checkpoints" / "step_000002" / "checkpoint.json").read_text())["data_cursor"]
    assert cursor["next_problem"] > 2 * 2, "no refill before the checkpoint: the cursor is not exercised"
    assert meta["config"]["steps"] == 4 and meta["config_sources"]["steps"] == "cli"
    assert meta["config_sources"]["learning_rate"].startswith("checkpoint:")
    assert rows(resumed)[0] == rows(first)[0]


def test_resume_refuses_another_option(tmp_path, straight, capsys):
    code = cli.main(["train", "--resume-from", str(straight), "-s", "8", "--learning-rate", "1e-2",
                     "--log-root", str(tmp_path)])
    assert code == 2
    assert "learning_rate is 0.01 here but 0.001 in the checkpoint" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "a refused resume must not create a run directory"


@pytest.mark.slow
def test_kill_during_save_resumes_from_previous_checkpoint(tmp_path, straight):
    driver = tmp_path / "crash_driver.py"
    driver.write_text(DRIVER.format(code=CRASH_EXIT))
    logs = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(cli.__file__).parents[2]),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(driver), "train", "--log-root", str(logs), *TRAIN, "-s", "6"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == CRASH_EXIT, done.stderr[-2000:]
    (killed,) = logs.iterdir()
    assert [step for step, _ in checkpoint_dirs(killed)] == [2], "only the step-2 checkpoint is complete"
    temps = [p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith(".tmp-step_000004")]
    assert temps, "the killed save left its temp folder"
    assert json.loads((killed / "run_metadata.json").read_text())["status"] == "running"

    resumed = train(tmp_path / "resumed", "--resume-from", str(killed))
    assert json.loads((resumed / "run_metadata.json").read_text())["resumed_from"]["step"] == 2
    assert_same_run(straight, resumed, range(2, 6), final=6)
    assert (killed / "checkpoints" / temps[0]).is_dir(), "the old run is only read, its temp folder stays"
