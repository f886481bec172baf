"""Shared pieces of the GPU runbook tests: the device, the models under test, NVML (prompts: rlrunbook.testing).

Kept free of CUDA calls at import time, so collecting the tier on a CPU-only machine is cheap
and the ``gpu`` marker decides (skip, or fail under ``RLRUNBOOK_REQUIRE_GPU=1``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from rlrunbook.testing.prompts import chat_prompts  # noqa: F401 - the tier imports it from here

# Every test in tests/gpu runs here; the single constant makes a CPU dry run a one-word edit.
DEVICE = "cuda"

MODELS_ENV = "RLRUNBOOK_GPU_MODELS"
DEFAULT_MODELS = "tiny,smollm2-135m"

def gpu_models(env: Mapping[str, str] | None = None) -> list[str]:
    """The models to run the runbook on: ``RLRUNBOOK_GPU_MODELS`` (comma-separated), else tiny and smollm2."""
    env = os.environ if env is None else env
    raw = env.get(MODELS_ENV, "").strip() or DEFAULT_MODELS
    return [name.strip() for name in raw.split(",") if name.strip()]


def nvml_handle(pynvml: object, device_index: int = 0) -> object:
    """The NVML handle of the GPU torch calls ``cuda:device_index``.

    CUDA and NVML may number devices differently (CUDA_VISIBLE_DEVICES, FASTEST_FIRST order), so
    match by UUID when torch reports one and fall back to the index (right on one-GPU machines).
    """
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        try:
            name = text if text.startswith("GPU-") else f"GPU-{text}"
            return pynvml.nvmlDeviceGetHandleByUUID(name)  # type: ignore[attr-defined]
        except pynvml.NVMLError:  # type: ignore[attr-defined]
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(device_index)  # type: ignore[attr-defined]
