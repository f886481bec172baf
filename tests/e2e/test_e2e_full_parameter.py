"""`rlrunbook train ... finetune=full`: full-parameter runs on ``tiny``, one process and two torchrun ranks.

Each run must pass ``check-run``. Sampler and trainer compute with the same gathered weights, so the logged
sampler-trainer mismatch is exactly 0 at every step. Two ranks sample the one-process batch token for token
(each its block of groups, with the groups' global seeds), so rewards and advantages are equal exactly; the
losses come from the ranks' summed gradients, so they agree within float32 tolerances. A two-rank run resumed
from its step-2 checkpoint continues exactly as the straight run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlrunbook.run import check_run, format_results, rubric_passed
from rlrunbook.run.checkpoint_format import checkpoint_dirs, load_checkpoint
from rlrunbook.testing import ranks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRAIN = ["train", "--model", "tiny", "--env", "summary", "--dataset", "cnn_dailymail", "--reward-fn", "compression",
         "-n", "8", "--num-groups", "2", "--max-tokens", "16", "--learning-rate", "1e-3", "--checkpoint-every", "1",
         "--deterministic", "--name", "full", "finetune=full"]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
EXACT = ("reward/", "task_reward/", "advantage/", "completion_length/", "num_datums", "num_trained_tokens")
VOLATILE = ("time/", "throughput/", "memory/")
LOSS_TOL = 1e-4


def _train(log_root: Path, launcher: list[str], *extra: str) -> Path:
    """Run ``rlrunbook train`` (under ``launcher``) into a fresh ``log_root``; the one run directory it made."""
    env = ranks.child_env(PYTHONUNBUFFERED="1", TINKER_LOCAL_DEVICE="cpu")
    before = set(log_root.iterdir()) if log_root.is_dir() else set()
    ranks.run([[sys.executable, *launcher, "-m", "rlrunbook", *TRAIN, *extra, "--log-root", str(log_root)]], [env],
              timeout=400)
    (run,) = set(log_root.iterdir()) - before
    results = check_run(run)
    assert rubric_passed(results), format_results(results)
    return run


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def _stable(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith(VOLATILE)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("full_e2e")
    one = _train(root / "one", [], "-s", "3")
    two = _train(root / "two", TORCHRUN, "-s", "3")
    first = _train(root / "resumed", TORCHRUN, "-s", "2")
    resumed = _train(root / "resumed", TORCHRUN, "--resume-from", str(first), "-s", "3")
    in_one = _train(root / "in_one", [], "--resume-from", str(first), "-s", "3")
    return {"one": one, "two": two, "first": first, "resumed": resumed, "in_one": in_one}


def test_sampler_and_trainer_agree_exactly_at_every_step(runs):
    for name in ("one", "two"):
        rows = _rows(runs[name])
        assert len(rows) == 3
        for row in rows:
            assert row["mismatch/abs_logprob_diff"] == 0.0, (name, row["step"])


def test_every_weight_is_checkpointed_and_moves(runs):
    (step1, first), (step3, last) = checkpoint_dirs(runs["one"])[0], checkpoint_dirs(runs["one"])[-1]
    assert (step1, step3) == (1, 3)
    before, after = load_file(str(first / "adapter.safetensors")), load_file(str(last / "adapter.safetensors"))
    assert before.keys() == after.keys()
    assert not any("lora_" in name for name in before), "full training checkpoints the model's own weights"
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= before.keys()
    assert all(value.dtype == torch.float32 for value in after.values())  # the float32 master weights
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(moved) == len(before), sorted(set(before) - set(moved))


def test_two_ranks_equal_one_process(runs):
    for one, two in zip(_rows(runs["one"]), _rows(runs["two"]), strict=True):
        for key in one:
            if key.startswith(EXACT):
                assert two[key] == one[key], (one["step"], key)
        assert two["loss/sum"] == pytest.approx(one["loss/sum"], abs=LOSS_TOL)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    meta = json.loads((runs["two"] / "run_metadata.json").read_text())
    assert meta["world_size"] == 2 and meta["config"]["finetune"] == "full"


def test_two_ranks_checkpoint_their_own_shards(runs):
    """Each rank writes its shards (about half the state each); joined, they are the one-process checkpoint's
    weights within the ranks' float32 reduction order."""
    folder = checkpoint_dirs(runs["two"])[-1][1]
    files = {path.name: path.stat().st_size for path in folder.iterdir()}
    assert "adapter.safetensors" not in files and "optimizer.pt" not in files
    halves = [files["shard_00000_of_00002.safetensors"], files["shard_00001_of_00002.safetensors"]]
    assert abs(halves[0] - halves[1]) <= 0.05 * sum(halves), halves
    joined = load_checkpoint(folder).adapter
    single = load_checkpoint(checkpoint_dirs(runs["one"])[-1][1]).adapter
    assert joined.keys() == single.keys()
    distance = sum(float((joined[k] - single[k]).double().norm() ** 2) for k in single) ** 0.5
    assert distance <= 1e-5 * sum(float(single[k].double().norm() ** 2) for k in single) ** 0.5


def test_a_resumed_two_rank_run_continues_exactly(runs):
    straight, resumed = _rows(runs["two"]), _rows(runs["resumed"])
    assert [row["step"] for row in resumed][-1] == straight[-1]["step"]
    assert _stable(resumed[-1]) == _stable(straight[-1])
    last = load_checkpoint(checkpoint_dirs(runs["two"])[-1][1])
    again = load_checkpoint(checkpoint_dirs(runs["resumed"])[-1][1])
    assert all(torch.equal(last.adapter[name], again.adapter[name]) for name in last.adapter)
    assert all(torch.equal(last.optimizer["state"][name][key], again.optimizer["state"][name][key])
               for name in last.optimizer["state"] for key in last.optimizer["state"][name])


def test_a_two_rank_checkpoint_resumes_in_one_process(runs):
    """At another world size the shards are joined: one process continues the two-rank run's step 3 with the
    same samples and rewards, and weights equal to the ranks' within the float32 reduction order."""
    straight, in_one = _rows(runs["two"])[-1], _rows(runs["in_one"])[-1]
    for key in straight:
        if key.startswith(EXACT):
            assert in_one[key] == straight[key], key
    last = load_checkpoint(checkpoint_dirs(runs["two"])[-1][1]).adapter
    mine = load_checkpoint(checkpoint_dirs(runs["in_one"])[-1][1]).adapter
    distance = sum(float((last[k] - mine[k]).double().norm() ** 2) for k in last) ** 0.5
    assert distance <= 1e-5 * sum(float(last[k].double().norm() ** 2) for k in last) ** 0.5
    meta = json.loads((runs["in_one"] / "run_metadata.json").read_text())
    assert meta["world_size"] == 1 and meta["resumed_from"]["step"] == 2
