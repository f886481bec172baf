"""The GPU requirement of the ``gpu`` tier: skip without CUDA, fail when a GPU was required.

``RLRUNBOOK_REQUIRE_GPU=1`` turns the skip into a failure that names what is missing, so a GPU
CI runner whose CUDA broke cannot pass by skipping everything.
"""

from __future__ import annotations

from collections.abc import Mapping

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
