"""The GPU requirement of the ``gpu`` tier: skip without CUDA, fail when a GPU was required.

``RLRUNBOOK_REQUIRE_GPU=1`` turns the skip into a failure that names what is missing, so a GPU
CI runner whose CUDA broke cannot pass by skipping everything. It does the same for every other skip of a gpu
test, except those of the stated optional parts (``OPTIONAL_PARTS``), which stay skipped as "not proven".
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping

from rlrunbook.testing.requirement import required

REQUIRE_ENV = "RLRUNBOOK_REQUIRE_GPU"


def gpu_required(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``RLRUNBOOK_REQUIRE_GPU`` turns the skip into a failure."""
    return required(REQUIRE_ENV, env)


def missing_gpu_reason() -> str | None:
    """Why CUDA is unusable here, naming the missing piece; ``None`` when a CUDA GPU is usable."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (run scripts/setup.sh)"
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); "
                "install a CUDA build, or create the venv with --system-site-packages to use the system's")
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device: "
                "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    return None


# The gpu tier's optional parts: what a GPU machine may lack and still pass the tier, each counted by the report
# (scripts/gpu_report.py) as "not proven", never as passed. Under RLRUNBOOK_REQUIRE_GPU=1 any other skip of a gpu
# test is a failure (rlrunbook.testing.gpu_plugin).
OPTIONAL_PARTS: dict[str, str] = {
    "bitsandbytes": "4-bit base weights (tests/gpu/test_gpu_6_quantised.py)",
    "vllm": "the vLLM sampler's parity cases (tests/gpu/test_gpu_1_logprob_parity.py)",
}
NOT_PROVEN = "not proven: optional part"


def not_proven_reason(part: str, missing: str) -> str:
    """The skip reason of a gpu test whose optional ``part`` (a key of ``OPTIONAL_PARTS``) is ``missing``."""
    if part not in OPTIONAL_PARTS:
        raise KeyError(f"{part!r} is not an optional part of the gpu tier ({', '.join(OPTIONAL_PARTS)})")
    return f"{NOT_PROVEN} {part}, {OPTIONAL_PARTS[part]}: {missing}"


def not_proven_part(reason: str) -> str | None:
    """The optional part a skip reason names (as :func:`not_proven_reason` writes it), else ``None``."""
    if not reason.startswith(NOT_PROVEN + " "):
        return None
    part = reason[len(NOT_PROVEN) + 1:].split(",", 1)[0]
    return part if part in OPTIONAL_PARTS else None


def missing_module(name: str, fix: str, find_spec: Callable[[str], object] = importlib.util.find_spec) -> str | None:
    """``None`` when module ``name`` can be imported here, else why not and ``fix``."""
    return None if find_spec(name) is not None else f"{name} is not installed ({fix})"


def required_skip_failure(reason: str, is_required: bool) -> str | None:
    """What a skipped gpu test becomes: ``None`` (it stays skipped) without the requirement or when ``reason``
    names an optional part; else the failure message, naming what the skip said was missing."""
    if not is_required or not_proven_part(reason) is not None:
        return None
    return (f"{REQUIRE_ENV}=1 but this gpu test skipped, and only the optional parts ({', '.join(OPTIONAL_PARTS)}) "
            f"may: {reason}")
