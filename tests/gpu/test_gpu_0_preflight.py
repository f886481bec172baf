"""Runbook §0, preflight: torch sees a CUDA GPU, NVML reads it, and CUDA arithmetic is right.

Every later GPU test assumes these; a failure here explains the others.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from gpu_support import DEVICE, nvml_handle

pytestmark = pytest.mark.gpu


def test_torch_sees_a_cuda_device(record_property):
    """A CUDA build of torch with a visible device; versions go to stdout and the JUnit properties."""
    import rlrunbook.backend  # noqa: F401  (the runbook's "repo imports compile" check)

    assert torch.version.cuda is not None, f"torch {torch.__version__} is a CPU-only build"
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() >= 1
    info = {
        "device_name": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": importlib.metadata.version("transformers"),
        "peft": importlib.metadata.version("peft"),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
    }
    for key, value in info.items():
        print(f"{key}: {value}")
        record_property(key, value)
    assert info["device_name"]


def test_nvml_reads_the_device(record_property):
    """nvidia-ml-py initialises, counts at least one device, and reads memory of the one torch uses."""
    import pynvml

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        memory = pynvml.nvmlDeviceGetMemoryInfo(nvml_handle(pynvml))
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    print(f"nvml devices: {count}, driver {driver}, "
          f"memory used {memory.used >> 20} / {memory.total >> 20} MiB")
    record_property("nvml_device_count", count)
    record_property("nvml_driver", str(driver))
    record_property("nvml_memory_total_mib", memory.total >> 20)
    assert count >= 1
    assert memory.total > 0
    assert 0 <= memory.used <= memory.total


def test_cuda_matmul_matches_cpu():
    """A small fp32 matmul (TF32 off) on the GPU equals the CPU result to fp32 rounding."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(64, 96, generator=gen)
        b = torch.randn(96, 32, generator=gen)
        on_gpu = (a.to(DEVICE) @ b.to(DEVICE)).cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    # Sums of 96 products of unit normals (|c| ~ 10): fp32 reordering error is ~1e-5, TF32 would be ~1e-2.
    torch.testing.assert_close(on_gpu, a @ b, rtol=1e-5, atol=1e-4)
