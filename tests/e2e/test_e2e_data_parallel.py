"""`torchrun --nproc_per_node=2 -m rlrunbook train` against the same command in one process.

Each rank samples its block of every step's groups with the groups' global seeds, so the union
batch is the single-process batch token for token: rewards, advantages and lengths are equal
exactly. Sampling logprobs, losses and gradient norms come from float32 forward passes over
other batch shapes (and a summed all-reduce), so they agree within tolerances, not bitwise. Step 0's
loss is ~0 (the importance ratio is 1 and centred advantages sum to 0), hence an absolute bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlrunbook.run import check_run, format_results, rubric_passed
from rlrunbook.testing import ranks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The summary task's compression reward is continuous, so tiny's groups have spread (non-zero advantages).
TRAIN = ["train", "--model", "tiny", "--env", "summary", "--dataset", "cnn_dailymail", "--reward-fn", "compression",
         "-n", "8", "--num-groups", "2", "-s", "2", "--max-tokens", "16", "--name", "dp"]
EXACT = ("reward/", "task_reward/", "advantage/", "completion_length/", "num_datums", "num_trained_tokens")
LOSS_TOL = 1e-4  # measured |difference| 1.6e-6 (step 0) and 1.1e-6 (step 1, |loss| 1.6)
GRAD_NORM_RTOL = 1e-5  # measured 1.1e-6 relative
LOGPROB_TOL = 1e-4  # sampling logprobs of the same tokens in other batch shapes: measured 4.8e-6


def _train(log_root: Path, launcher: list[str]) -> subprocess.CompletedProcess:
    env = ranks.child_env(PYTHONUNBUFFERED="1")
    if torch.cuda.device_count() < 2:  # one process per GPU: fewer than two GPUs, so both runs on CPU with gloo
        env["TINKER_LOCAL_DEVICE"] = "cpu"
    return ranks.run([[sys.executable, *launcher, "-m", "rlrunbook", *TRAIN, "--log-root", str(log_root)]], [env],
                     timeout=300)[0]


def _only_run(log_root: Path) -> Path:
    runs = [p for p in log_root.iterdir()]
    assert len(runs) == 1, f"expected exactly one run directory, got {runs}"
    results = check_run(runs[0])
    assert rubric_passed(results), format_results(results)
    return runs[0]


def _train_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("dp_e2e")
    _train(root / "one", [])
    two = _train(root / "two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])
    assert two.stdout.count("[run] ") == 1, "only rank 0 logs"
    return {1: _only_run(root / "one"), 2: _only_run(root / "two")}


def test_two_processes_leave_one_complete_run_directory(runs):
    meta = json.loads((runs[2] / "run_metadata.json").read_text())
    assert meta["status"] == "completed"
    assert meta["world_size"] == 2
    assert json.loads((runs[1] / "run_metadata.json").read_text())["world_size"] == 1


def test_union_batch_is_the_single_process_batch(runs):
    one, two = _train_log(runs[1]), _train_log(runs[2])
    assert [row["step"] for row in two] == [row["step"] for row in one] == [0, 1]
    for a, b in zip(one, two, strict=True):
        exact = {k: v for k, v in a.items() if k.startswith(EXACT)}
        assert exact and exact == {k: b[k] for k in exact}, f"step {a['step']}"
    for name in ("baseline_0.json", "summary_0.json", "summary_1.json"):
        if (runs[1] / name).exists():
            assert json.loads((runs[2] / name).read_text()) == json.loads((runs[1] / name).read_text()), name


def test_losses_and_grad_norms_match_within_tolerance(runs):
    for a, b in zip(_train_log(runs[1]), _train_log(runs[2]), strict=True):
        assert b["loss/sum"] == pytest.approx(a["loss/sum"], abs=LOSS_TOL), f"step {a['step']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=GRAD_NORM_RTOL), f"step {a['step']}"


def test_step_files_hold_the_union_datums(runs):
    for step in (0, 1):
        one = json.loads((runs[1] / f"training_step_{step}.json").read_text())
        two = json.loads((runs[2] / f"training_step_{step}.json").read_text())
        assert len(two["training_data"]) == len(one["training_data"])
        for a, b in zip(one["training_data"], two["training_data"], strict=True):
            assert {k: v for k, v in b.items() if k != "completion_logprobs"} == \
                {k: v for k, v in a.items() if k != "completion_logprobs"}
            assert b["completion_logprobs"] == pytest.approx(a["completion_logprobs"], abs=LOGPROB_TOL)
        assert two["num_trained_tokens"] == one["num_trained_tokens"]
