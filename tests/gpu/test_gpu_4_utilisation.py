"""Runbook §6, GPU utilisation: sampling really runs on the GPU (utilisation > 0, memory above idle).

A burst of sampling (64 rows x 64 tokens, repeated for at least two seconds) runs in a
background thread while the main thread reads NVML every 50 ms: the automated ``watch
nvidia-smi``. A CPU-only torch, or a model left on the CPU, reads 0% and no memory growth.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from gpu_support import chat_prompts, nvml_handle

from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters

pytestmark = pytest.mark.gpu

POLL_S = 0.05
MIN_BURST_S = 2.0  # NVML averages utilisation over 1/6 s to 1 s: the burst must outlast that
MIN_CALLS = 3


def _burst(host, done: threading.Event, calls: list[float], errors: list[BaseException]) -> None:
    try:
        prompts = chat_prompts(host.tokenizer, 8)
        request = GenerationRequest(max_tokens=64, filters=SamplingFilters(1.0), stop=(), seed=0)
        start = time.perf_counter()
        while len(calls) < MIN_CALLS or time.perf_counter() - start < MIN_BURST_S:
            t0 = time.perf_counter()
            host.engine.sample(prompts, 8, request)  # 8 prompts x 8 samples = 64 rows
            calls.append(time.perf_counter() - t0)
    except BaseException as error:  # reported by the main thread
        errors.append(error)
    finally:
        done.set()


def test_sampling_burst_uses_the_gpu(model_name, cuda_hosts, record_property):
    """Max NVML utilisation > 0 and device memory in use rises above the idle reading during the burst."""
    import pynvml

    host = cuda_hosts(model_name, torch.bfloat16)
    pynvml.nvmlInit()
    try:
        handle = nvml_handle(pynvml)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # give cached blocks back, so the burst's allocations show in NVML
        time.sleep(0.2)
        idle_used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        done, calls, errors = threading.Event(), [], []
        worker = threading.Thread(target=_burst, args=(host, done, calls, errors), daemon=True)
        utilisation, used = [], []
        worker.start()
        tail_until = None
        while tail_until is None or time.perf_counter() < tail_until:
            utilisation.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            used.append(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
            if done.is_set() and tail_until is None:
                tail_until = time.perf_counter() + 0.5  # NVML's window lags the work
            time.sleep(POLL_S)
        worker.join()
    finally:
        pynvml.nvmlShutdown()
    if errors:
        raise errors[0]

    figures = {
        "calls": len(calls),
        "median_call_s": sorted(calls)[len(calls) // 2],
        "tokens_per_s": 64 * 64 * len(calls) / sum(calls),
        "max_utilisation_pct": max(utilisation),
        "mean_utilisation_pct": sum(utilisation) / len(utilisation),
        "idle_used_mib": idle_used >> 20,
        "peak_used_mib": max(used) >> 20,
        "torch_max_allocated_mib": torch.cuda.max_memory_allocated() >> 20,
        "polls": len(utilisation),
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
        record_property(key, value)
    assert max(utilisation) > 0, "NVML read 0% utilisation throughout the burst: is the model on the GPU?"
    assert max(used) > idle_used, "device memory in use never rose above the idle reading during the burst"
