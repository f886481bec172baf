"""The same seed gives the same run; a drifted data set is refused before any model loads."""

from __future__ import annotations

import json

import pytest

from rlrunbook import cli
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.training.loop import run_training

VOLATILE = ("time/", "throughput/", "memory/")


def _log(run_dir):
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def _step_tokens(run_dir, step):
    data = json.loads((run_dir / f"training_step_{step}.json").read_text())["training_data"]
    return [d["completion_tokens"] for d in data]


@pytest.fixture
def restore_determinism():
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)  # --deterministic is process-wide; keep it inside this test


def test_same_seed_same_train_log_and_tokens(tmp_path, restore_determinism):
    def run(seed, root):
        config = TrainConfig(model="tiny", env="summary", num_rollouts=8, steps=2, max_tokens=48, seed=seed,
                             deterministic=True, log_root=str(tmp_path / root), name="repro")
        return run_training(config, log=lambda *_: None)

    a, b, c = run(0, "a"), run(0, "b"), run(1, "c")
    assert _log(a) == _log(b), "same seed, same losses, rewards and advantages"
    assert _step_tokens(a, 1) == _step_tokens(b, 1), "same sampled tokens after an optimizer step"
    assert _log(a) != _log(c) and _step_tokens(a, 0) != _step_tokens(c, 0)


def test_expected_dataset_hash_refuses_drift(tmp_path, capsys, monkeypatch):
    from rlrunbook import backend

    data = tmp_path / "gsm.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "What is 2 + 2?", "answer": "#### 4"}\n')
    from rlrunbook.rl.setup.prepare import prepare

    _, _, task, problems = prepare(TrainConfig(env="qa", dataset=str(data), num_rollouts=4))
    recorded = task.dataset_info(problems)["fingerprint"]
    data.write_text(data.read_text().replace("#### 4", "#### 5"))
    monkeypatch.setattr(backend, "create_service_client", lambda **_: pytest.fail("a model was loaded"))
    code = cli.main(["train", "--env", "qa", "--dataset", str(data), "-n", "4", "--log-root", str(tmp_path / "logs"),
                     "--expected-dataset-hash", recorded])
    err = capsys.readouterr().err
    assert code == 2 and recorded in err and "changed since" in err
