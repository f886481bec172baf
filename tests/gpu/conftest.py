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

    from rlrunbook.backend.host import load_host
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


@pytest.fixture(scope="session")
def vllm_engines():
    """``get(host, dtype)`` → a vLLM engine sampling ``host``'s model on a server of that dtype.

    The server is managed (from ``.venv-vllm`` / ``RLRUNBOOK_VLLM_VENV``, the CUDA ``vllm`` wheel on a GPU
    machine) or given by ``TINKER_LOCAL_VLLM_URL``; one at a time, so two never share the GPU's memory.
    """
    import os

    from rlrunbook.backend.settings import LocalSettings
    from rlrunbook.backend.vllm_sampling import VllmSamplers
    from rlrunbook.backend.vllm_settings import VllmSettings

    current: dict[tuple, VllmSamplers] = {}

    def get(host, dtype):
        key = (str(host.folder), dtype)
        if key not in current:
            for samplers in current.values():
                samplers.close()
            current.clear()
            current[key] = VllmSamplers(LocalSettings(device=DEVICE, dtype=dtype, sampler="vllm",
                                                      vllm=VllmSettings.from_env(dict(os.environ))))
        return current[key].engine_for(host)

    yield get
    for samplers in current.values():
        samplers.close()
