"""Managed mode: the project starts its own vLLM servers, checks, restarts and stops them.

Each test starts servers of its own (about 30 s each on 2 cores), so the tier keeps to two:
a server started without processed logprobs (refused at connect time, then stopped), and a
training run whose server is restarted on schedule and then killed mid-run (a clear error, the
finished steps' records and checkpoints kept). Neither leaves a vLLM process behind.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from vllm_support import kill_and_wait, vllm_pids

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.vllm.settings import VllmSettings
from rlrunbook.vllm.client import VllmServerError

pytestmark = pytest.mark.vllm
MODEL = "tiny-vllm"


def _managed_settings(tmp_path, **knobs) -> LocalSettings:
    env = {k: v for k, v in os.environ.items() if k != "TINKER_LOCAL_VLLM_URL"}
    vllm = dataclasses.replace(VllmSettings.from_env(env), **knobs)
    return LocalSettings(
        device="cpu", dtype=torch.float32, storage_dir=tmp_path / "tinker", sampler="vllm", vllm=vllm
    )


def test_server_without_processed_logprobs_is_refused_and_stopped(tmp_path):
    before = vllm_pids()
    settings = _managed_settings(
        tmp_path, extra_args=("--logprobs-mode", "raw_logprobs")
    )  # the last flag wins
    service = LocalServiceClient(settings)
    with pytest.raises(VllmServerError, match=r"raw T = 1 logprobs.*--logprobs-mode processed_logprobs"):
        service.create_sampling_client(base_model=MODEL)
    service.close()
    assert vllm_pids() <= before, "the refused server must be stopped, with every process it forked"


def test_restart_every_then_death_mid_run_keeps_the_runs_records(tmp_path, capsys):
    from rlrunbook.rl.setup.config import TrainConfig
    from rlrunbook.rl.training.loop import run_training

    before = vllm_pids()
    service = LocalServiceClient(_managed_settings(tmp_path, restart_every=2))
    config = TrainConfig(
        mode="single_turn",
        env="summary",
        dataset="cnn_dailymail",
        reward_fn="compression",
        num_rollouts=8,
        num_groups=2,
        steps=4,
        max_tokens=16,
        model=MODEL,
        learning_rate=1e-3,
        lora_rank=8,
        log_root=str(tmp_path / "logs"),
        name="managed",
        checkpoint={"every": 1},
    )

    def progress(steps):
        for step in steps:
            if step == 3:  # the server dies between steps 2 and 3: SIGKILL to its whole process group
                (engine,) = service._vllm._engines.values()
                process = engine.server._process
                kill_and_wait({process.pid} | (vllm_pids() - before))
                process.wait(timeout=30)  # reaped: the server's own check now sees an exit code
            yield step

    with pytest.raises(VllmServerError, match=r"(?s)was killed \(SIGKILL.*mid-run.*--resume-from"):
        run_training(config, service_factory=lambda: service, progress=progress)
    service.close()
    out = capsys.readouterr().out
    assert "[vllm] restarting the server: 2 adapter versions loaded" in out
    (run,) = (tmp_path / "logs").iterdir()
    rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]  # step 2 ran on the restarted server
    assert all((run / f"training_step_{k}.json").is_file() for k in range(3))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{k:06d}" for k in range(1, 4)]
    meta = json.loads((run / "run_metadata.json").read_text())
    assert meta["status"] == "failed" and "VllmServerError" in meta["error"]
    assert vllm_pids() <= before, "no vLLM process may outlive the service"
