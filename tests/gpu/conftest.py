"""Fixtures of the GPU tier: models parametrized from RLRUNBOOK_GPU_MODELS, hosts on CUDA per dtype.

The root conftest's ``gpu`` marker check runs before any fixture here is set up, so nothing
below touches CUDA on a machine without it.
"""

from __future__ import annotations

import pytest
from gpu_support import DEVICE, gpu_models


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "model_name" in metafunc.fixturenames:
        # Function scope keeps the runbook's file order (session scope would regroup tests by model);
        # the hosts are cached by ``cuda_hosts`` anyway.
        metafunc.parametrize("model_name", gpu_models())


@pytest.fixture(scope="session")
def cuda_hosts():
    """``get(model_name, dtype)`` → a ModelHost on the GPU, loaded once per session and shared.

    The hosts are plain (no LoRA) and shared: tests must not change their weights.
    """
    import torch

    from rlrunbook.backend.model_host import load_host
    from rlrunbook.backend.settings import LocalSettings

    hosts = {}

    def get(model_name: str, dtype: torch.dtype):
        key = (model_name, dtype)
        if key not in hosts:
            hosts[key] = load_host(model_name, LocalSettings(device=DEVICE, dtype=dtype))
        return hosts[key]

    yield get
    hosts.clear()
    torch.cuda.empty_cache()
