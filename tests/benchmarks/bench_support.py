"""Shared settings of the throughput benchmarks: device, models, fixed-shape inputs, timing helpers.

Timings on a shared 2-core CPU swing by up to 2x between runs: read medians, compare figures only
within one run and under the same allocator settings. With glibc defaults, multi-GB activation
buffers go back to the OS and are re-faulted every step; for CPU numbers comparable with
docs/performance.md run the benchmarks under
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000`` and say so next to the figures.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path

import torch

BASELINES = Path(__file__).parent / "baselines.json"
DEVICE_ENV = "RLRUNBOOK_BENCH_DEVICE"
MODELS_ENV = "RLRUNBOOK_BENCH_MODELS"
DEFAULT_MODELS = "tiny,smollm2-135m"

ROWS = 8  # prompts (sampling) or datums (training) per call
PROMPT_TOKENS = 32
COMPLETION_TOKENS = 32

# Plain prose, long enough for ROWS overlapping windows of PROMPT_TOKENS + COMPLETION_TOKENS tokens.
_TEXT = (
    "The river ran past the old mill and under the stone bridge, where children sat in summer to watch "
    "the boats go by. In the autumn the water rose, the mill wheel turned faster, and the miller counted "
    "sacks of flour by lamplight: seven on Monday, twelve on Tuesday, and more than twenty by the end of "
    "the week. Nobody in the village could remember a year when the harvest had been so large, or a winter "
    "that came so late. "
)


def bench_device(env: Mapping[str, str] | None = None) -> str:
    """``RLRUNBOOK_BENCH_DEVICE``, else ``cuda`` when available, else ``cpu``."""
    env = os.environ if env is None else env
    return env.get(DEVICE_ENV, "").strip() or ("cuda" if torch.cuda.is_available() else "cpu")


def bench_models(env: Mapping[str, str] | None = None) -> list[str]:
    """``RLRUNBOOK_BENCH_MODELS`` (comma-separated), else tiny and smollm2-135m."""
    env = os.environ if env is None else env
    raw = env.get(MODELS_ENV, "").strip() or DEFAULT_MODELS
    return [name.strip() for name in raw.split(",") if name.strip()]


def token_windows(tokenizer: object, rows: int, length: int) -> list[list[int]]:
    """``rows`` distinct windows of exactly ``length`` token ids of fixed prose: the same shape every run."""
    ids: list[int] = tokenizer.encode(_TEXT * 4, add_special_tokens=False)  # type: ignore[attr-defined]
    stride = 7
    assert len(ids) >= stride * (rows - 1) + length, f"benchmark text too short: {len(ids)} tokens"
    return [ids[i * stride:i * stride + length] for i in range(rows)]


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so a timed call ends when its kernels do."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(benchmark: object) -> float | None:
    """The median round time, or ``None`` when pytest-benchmark is disabled (no statistics kept)."""
    stats = getattr(benchmark, "stats", None)
    return None if stats is None else float(stats.stats.median)


def describe(device: str, dtype: torch.dtype) -> dict[str, object]:
    """Context that makes a throughput figure interpretable later."""
    info: dict[str, object] = {"device": device, "dtype": str(dtype).removeprefix("torch."),
                               "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"):
        info[name] = os.environ.get(name, "")
    return info


def baselines() -> dict[str, dict[str, object]]:
    """The stored baselines (``baselines.json``): ``{key: {figure, machine, torch, ...}}``."""
    return json.loads(BASELINES.read_text()) if BASELINES.exists() else {}


def updating_baselines() -> bool:
    """Whether this run stores its figures as the new baselines (``RLRUNBOOK_UPDATE_BENCH_BASELINE=1``)."""
    return os.environ.get("RLRUNBOOK_UPDATE_BENCH_BASELINE") == "1"


def _cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            for line in file:
                if line.startswith("model name"):
                    return f"{line.partition(':')[2].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def store_baseline(key: str, figures: dict[str, object], device: str) -> None:
    """Store ``figures`` under ``key`` with the machine they were measured on (the GPU's name on CUDA)."""
    machine = torch.cuda.get_device_name() if device.startswith("cuda") else _cpu_model()
    stored = baselines()
    stored[key] = {**figures, "machine": machine, "torch": torch.__version__}
    BASELINES.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
