"""Full-parameter training on CUDA: one process over a one-rank FSDP2 group (nccl), bfloat16 passes of float32
master weights, on each GPU-tier model.

The unit tier's worker (``tests/unit/backend/full_param_worker.py``) runs in a process of its own (a process
group is process-wide): two RL steps of eight sampled datums, the sampler's logprobs against the trainer's at
every step (0: the sampler reads the gathered bf16 weights the trainer computes with, through the same Triton
kernels), every weight moved, the state held as 16 bytes per parameter, and the exact resume.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_support import DEVICE

from rlrunbook.testing import ranks

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).resolve().parents[1] / "unit" / "backend" / "full_param_worker.py"


def test_full_parameter_steps_keep_sampler_and_trainer_bitwise(model_name, tmp_path, record_property):
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path), "--device", DEVICE, "--dtype", "bfloat16",
                           "--model", model_name], capture_output=True, text=True, env=ranks.child_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    record_property("parity", result["parity"])
    assert result["parity"] == [0.0, 0.0]
    initial, straight = result["initial"], result["straight"]
    assert all(value.dtype == torch.float32 for value in straight.values())
    moved = sum(not torch.equal(initial[name], straight[name]) for name in initial)
    assert moved == len(initial), f"{len(initial) - moved} parameters did not move"
    params = sum(value.numel() for value in initial.values())
    state = result["state_bytes"][1]
    assert state["adapter"] == 4 * params and state["gradients"] == 4 * params
    assert all(torch.equal(straight[name], result["resumed"][name]) for name in straight)
