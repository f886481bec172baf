"""The CUDA kernels compile for the GPUs users train on, on any machine: Triton ships its own ptxas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs it on Linux)")

# Shared memory one block may use, by architecture (CUDA programming guide): what a kernel must fit in to launch.
_SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024, 89: 99 * 1024}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(_SHARED_LIMIT), ids=lambda arch: f"sm_{arch}")
def test_the_cuda_kernels_compile_for_the_gpus_users_train_on(arch):
    """Every kernel compiles for H100/H200 (sm_90), A100 (sm_80) and L4/L40S/RTX 4090 (sm_89) with Triton's own
    ptxas, with no GPU here: bf16 products on the tensor cores, fp32 ones in full precision (no tensor-core TF32),
    and each block's shared memory within what the architecture allows (head size 128)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_cuda.py")
    result = subprocess.run([sys.executable, str(script), str(arch)], env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    assert len(lines) == 27, result.stdout  # 13 kernels (and variants) in 2 dtypes, and a mixed product
    for name, dtype, tensor_cores, shared in lines:
        assert int(shared.split("=")[1]) <= _SHARED_LIMIT[arch], f"{name} {dtype}: {shared}"
        if name == "_matmul_kernel":
            assert tensor_cores == f"tensor_cores={dtype == 'bf16'}", f"{name} {dtype}: {tensor_cores}"
