"""Asynchronous RL (``off_policy`` = K > 0): the schedule is the config's, not the timing's.

The same seed and K give the same losses, tokens, validation rows and adapter bit for bit however fast either
side runs (shown by slowing the sampler in one run and the trainer in the other); each step logs the lag it
was scheduled to have; a resumed run equals the straight one; K = 0 is the synchronous loop (its numbers are
pinned by tests/unit/rl/training/test_pinned_tiny_run.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.training.lag_schedule import mean_abs_gap, sampling_step, staleness
from rlrunbook.rl.training.loop import run_training
from rlrunbook.rl.training.plan import check_off_policy

K = 2
STEPS = 4
VOLATILE = ("time/", "throughput/", "memory/", "async/sample_s", "async/wait_s")


def _config(root: Path, name: str, **changes) -> TrainConfig:
    return TrainConfig(model="tiny", env="summary", num_rollouts=4, num_groups=1, steps=STEPS, max_tokens=16,
                       seed=0, learning_rate=0.05, off_policy=K, log_root=str(root), name=name,
                       checkpoint={"every": 2}, validation={"every": 2, "num_problems": 2, "samples": 2},
                       **changes)


def _rows(run: Path, name: str = "train_log.jsonl") -> list[dict]:
    rows = [json.loads(line) for line in (run / name).read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE) and k != "time/validation_s"}
            for row in rows]


def _tokens(run: Path) -> list[list[list[int]]]:
    return [[d["completion_tokens"] for d in json.loads((run / f"training_step_{s}.json").read_text())["training_data"]]
            for s in range(STEPS)]


def _final_bytes(run: Path) -> dict[str, bytes]:
    folder = run / "checkpoints" / f"step_{STEPS:06d}"
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors")) if not p.name.startswith("rng")}


def _slow(monkeypatch, side: str, seconds: float) -> None:
    """Make one side slow: every sampling engine call, or every optimizer step, waits ``seconds`` first."""
    from rlrunbook.backend.sampling_client import LocalSamplingClient
    from rlrunbook.backend.trainer import Trainer

    owner, name = (LocalSamplingClient, "_sample_batch") if side == "sampling" else (Trainer, "optim_step")
    original = getattr(owner, name)

    def slowed(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, slowed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of one config: the sampler slowed in one, the trainer in the other; and a resume of the first."""
    root = tmp_path_factory.mktemp("async")
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        _slow(patch, "sampling", 0.4)
        out["slow_sampler"] = run_training(_config(root / "a", "async"), log=lambda *_: None)
    with pytest.MonkeyPatch.context() as patch:
        _slow(patch, "training", 1.0)
        out["slow_trainer"] = run_training(_config(root / "b", "async"), log=lambda *_: None)
    checkpoint = out["slow_sampler"] / "checkpoints" / "step_000002"
    out["resumed"] = run_training(_config(root / "c", "async"), log=lambda *_: None, resume_from=checkpoint)
    return out


@pytest.mark.slow
def test_the_same_run_however_fast_each_side_runs(runs):
    a, b = runs["slow_sampler"], runs["slow_trainer"]
    assert _rows(a) == _rows(b), "losses, rewards, advantages or mismatch differ with the timing"
    assert _tokens(a) == _tokens(b), "sampled tokens differ with the timing"
    assert _rows(a, "validation.jsonl") == _rows(b, "validation.jsonl")
    assert _final_bytes(a) == _final_bytes(b), "the trained adapter differs with the timing"


def test_each_step_logs_its_scheduled_staleness_and_the_lag_apart_from_the_mismatch(runs):
    rows = _rows(runs["slow_trainer"])
    assert [r["async/staleness"] for r in rows] == [min(step, K) for step in range(STEPS)]
    logged = [json.loads(line) for line in (runs["slow_trainer"] / "train_log.jsonl").read_text().splitlines()]
    assert all("memory/minor_faults" in r and "time/system_cpu_s" in r for r in logged)
    assert rows[0]["async/lag_abs_logprob_diff"] == 0.0 and "async/mismatch_total" not in rows[0]
    trained = [row for row in rows[1:] if not row.get("skipped")]
    assert trained, "no stale batch was trained: the test shows nothing"
    for row in trained:
        assert row["async/lag_abs_logprob_diff"] > 1e-3, "the weights moved: a stale batch must show a lag"
        assert row["async/mismatch_total"] > 1e-3
        assert row["mismatch/abs_logprob_diff"] < 1e-4, "at equal weights fp32 numerics agree to ~1e-6"
    metadata = json.loads((runs["slow_trainer"] / "run_metadata.json").read_text())
    assert metadata["config"]["mismatch"]["correction"] == "truncate", "K > 0 corrects by default"
    assert metadata["config"]["off_policy"] == K


def test_a_resumed_asynchronous_run_equals_the_straight_one(runs):
    straight, resumed = runs["slow_sampler"], runs["resumed"]
    assert _rows(resumed) == _rows(straight)
    assert _tokens(resumed) == _tokens(straight)
    assert _final_bytes(resumed) == _final_bytes(straight)
    assert (straight / "checkpoints" / "step_000002" / "sampler_adapters.safetensors").is_file()


def test_asynchronous_runs_pass_the_rubric(runs):
    from rlrunbook.run.rubric import check_run

    for run in runs.values():
        failed = [r for r in check_run(run) if not r.passed]
        assert not failed, f"{run.name}: {failed}"


def test_an_asynchronous_debate_trains_on_its_scheduled_lag(tmp_path):
    config = TrainConfig(model="tiny", mode="debate", env="qa", dataset="test", mock_judge=True, num_rollouts=4,
                         num_groups=1, steps=3, max_tokens=8, seed=0, off_policy=1, learning_rate=0.01,
                         log_root=str(tmp_path), name="debate")
    run = run_training(config, log=lambda *_: None)
    rows = _rows(run)
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in rows)
    assert (run / "debate_2.json").is_file()


def test_a_failure_on_the_rollout_thread_stops_the_run_with_its_error(tmp_path, monkeypatch):
    from rlrunbook.rl.training import off_policy

    original = off_policy.sample_batch

    def failing(plan, step, *args, **kwargs):
        if step == 2:
            raise RuntimeError("the reward server went away")
        return original(plan, step, *args, **kwargs)

    monkeypatch.setattr(off_policy, "sample_batch", failing)
    config = TrainConfig(model="tiny", env="summary", num_rollouts=4, steps=4, max_tokens=8, off_policy=1,
                         log_root=str(tmp_path), name="fails")
    with pytest.raises(RuntimeError, match="the reward server went away"):
        run_training(config, log=lambda *_: None)
    (run,) = tmp_path.iterdir()
    metadata = json.loads((run / "run_metadata.json").read_text())
    assert metadata["status"] == "failed" and "reward server" in metadata["error"]


def test_the_schedule_is_a_function_of_the_step_and_k():
    assert [sampling_step(i, 2) for i in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [staleness(i, 2) for i in range(6)] == [0, 1, 2, 2, 2, 2]
    assert [sampling_step(i, 0) for i in range(4)] == [0, 1, 2, 3]  # K = 0: on-policy
    assert mean_abs_gap([[0.0, -1.0, -2.0]], [[0.0, -1.5, -1.0]], [[False, True, True]]) == 0.75


def test_k_zero_is_the_synchronous_loop(tmp_path):
    config = validate(TrainConfig(model="tiny", env="summary", num_rollouts=4, steps=1, max_tokens=8,
                                  log_root=str(tmp_path), name="sync"))
    assert config.off_policy == 0 and config.mismatch.correction == "none"
    run = run_training(config, log=lambda *_: None)
    (row,) = _rows(run)
    assert not any(key.startswith("async/") for key in row)
    (logged,) = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert logged["memory/minor_faults"] >= 0 and logged["time/system_cpu_s"] >= 0.0  # the step's growth


@pytest.mark.parametrize("changes, backend, world, message", [
    ({"off_policy": 1}, "local", 2, "under torchrun"),
    ({"off_policy": 1}, "api", 1, "TINKER_BACKEND=api"),
    ({"off_policy": 4}, "local", 1, "not below -s 4"),
])
def test_what_an_asynchronous_run_cannot_do_yet_is_refused_by_name(changes, backend, world, message):
    config = TrainConfig(steps=4, **changes)
    with pytest.raises(ConfigError, match=message):
        check_off_policy(config, backend, world)
