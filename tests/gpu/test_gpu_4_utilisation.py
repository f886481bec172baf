"""Runbook §6, GPU utilisation: this process's sampling really runs on the GPU.

A burst of sampling (64 rows x 64 tokens, repeated for at least two seconds) runs in a background thread while the
main thread reads NVML every 50 ms: the automated ``watch nvidia-smi``. What is asserted is this process's own use,
from counters that only it moves:

- memory: torch's allocator peak during the burst (``torch.cuda.max_memory_allocated`` after a reset) above what
  the process held before it;
- compute: one more sampling call under ``torch.profiler`` (CUDA activity, this process's kernels only) spends
  kernel time on the device; its share of the call's wall time is recorded.

NVML's utilisation and memory-in-use figures are the whole card's: every process on it counts. They are recorded
(``card_*``), not asserted, and say nothing about this process on a shared card. Where NVML lists this process
(``nvmlDeviceGetComputeRunningProcesses``; not inside a PID namespace that hides it) its own memory is recorded too.
A CPU-only torch, or a model left on the CPU, allocates nothing on the device and runs no kernels.
"""

from __future__ import annotations

import os
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


def _request() -> GenerationRequest:
    return GenerationRequest(max_tokens=64, filters=SamplingFilters(1.0), stop=(), seed=0)


def _burst(host, done: threading.Event, calls: list[float], errors: list[BaseException]) -> None:
    try:
        prompts = chat_prompts(host.tokenizer, 8)
        start = time.perf_counter()
        while len(calls) < MIN_CALLS or time.perf_counter() - start < MIN_BURST_S:
            t0 = time.perf_counter()
            host.engine.sample(prompts, 8, _request())  # 8 prompts x 8 samples = 64 rows
            calls.append(time.perf_counter() - t0)
    except BaseException as error:  # reported by the main thread
        errors.append(error)
    finally:
        done.set()


def _own_nvml_memory(pynvml, handle) -> int | None:
    """This process's device memory as NVML lists it, or ``None`` where NVML does not show this pid."""
    for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if process.pid == os.getpid() and process.usedGpuMemory is not None:
            return process.usedGpuMemory
    return None


def _kernel_seconds(host) -> tuple[float, float]:
    """(seconds of CUDA kernels this process ran, wall seconds) over one sampling call of 64 rows."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prompts = chat_prompts(host.tokenizer, 8)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        host.engine.sample(prompts, 8, _request())
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernel_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return kernel_us / 1e6, wall


def test_sampling_burst_uses_the_gpu_for_this_process(model_name, cuda_hosts, record_property):
    """This process's allocator peak rises during the burst and its sampling runs CUDA kernels; the card's NVML
    figures are recorded beside them."""
    import pynvml

    host = cuda_hosts(model_name, torch.bfloat16)
    pynvml.nvmlInit()
    try:
        handle = nvml_handle(pynvml)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # give cached blocks back, so the burst's allocations show in NVML
        time.sleep(0.2)
        card_idle_used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        own_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        done, calls, errors = threading.Event(), [], []
        worker = threading.Thread(target=_burst, args=(host, done, calls, errors), daemon=True)
        utilisation, used, own_nvml = [], [], []
        worker.start()
        tail_until = None
        while tail_until is None or time.perf_counter() < tail_until:
            utilisation.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            used.append(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
            own_nvml.append(_own_nvml_memory(pynvml, handle))
            if done.is_set() and tail_until is None:
                tail_until = time.perf_counter() + 0.5  # NVML's window lags the work
            time.sleep(POLL_S)
        worker.join()
    finally:
        pynvml.nvmlShutdown()
    if errors:
        raise errors[0]
    own_peak = torch.cuda.max_memory_allocated()
    kernel_s, wall_s = _kernel_seconds(host)
    listed = [b for b in own_nvml if b is not None]

    figures = {
        "calls": len(calls),
        "median_call_s": sorted(calls)[len(calls) // 2],
        "tokens_per_s": 64 * 64 * len(calls) / sum(calls),
        "process_allocated_before_mib": own_before >> 20,
        "process_peak_allocated_mib": own_peak >> 20,
        "process_kernel_s": round(kernel_s, 4),
        "process_kernel_share_of_call": round(kernel_s / wall_s, 3),
        "process_nvml_used_mib": max(listed) >> 20 if listed else "not listed by NVML",
        "card_max_utilisation_pct": max(utilisation),
        "card_mean_utilisation_pct": sum(utilisation) / len(utilisation),
        "card_idle_used_mib": card_idle_used >> 20,
        "card_peak_used_mib": max(used) >> 20,
        "polls": len(utilisation),
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
        record_property(key, value)
    assert own_peak > own_before, (
        f"this process's allocator never rose above the {own_before >> 20} MiB it held before the burst: "
        "is the model on the GPU?")
    assert kernel_s > 0, "one sampling call ran no CUDA kernel in this process: is the model on the GPU?"
