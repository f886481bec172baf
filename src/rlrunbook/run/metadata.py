"""What a run records about where it ran: versions, git state, hardware, seeds, environment.

Everything here is best effort and never raises: a missing package is ``"missing"``, a source
tree outside git is ``None``. Secrets are the exception to "record everything": the environment
is filtered to the prefixes that change behaviour, secret-looking names are redacted, credentials in
other values (a URL's ``user:password``, a token shape) are cut out, and the
values of every secret-looking variable are scrubbed from all strings written (a token passed
on the command line as well as through the environment).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlrunbook.run.jsonio import REDACTED
from rlrunbook.run.redaction import (  # noqa: F401 - re-exported: the names callers knew here
    MIN_SCRUB_LENGTH,
    SECRET_KEY_PATTERNS,
    SECRET_NAME_PATTERNS,
    is_secret_name,
    redact_argv,
    redact_config,
    scrub_credentials,
    secret_values,
)

VERSIONED_PACKAGES = ("torch", "transformers", "peft", "tinker", "rlrunbook", "numpy")
ENV_PREFIXES = (
    "TINKER_",
    "RLRUNBOOK_",
    "CUDA_",
    "PYTORCH_",
    "HF_",
    "TRANSFORMERS_",
    "OMP_",
    "MALLOC_",
    "PYTHON",
)


def package_versions() -> dict[str, str]:
    """Python and the installed versions of the packages a run depends on ("missing" if absent).

    ``torch_build`` is the running torch's own version string: it carries the local build tag
    (``2.11.0+cu130``) that the installed distribution's metadata may lack (``2.11.0``).
    """
    versions = {"python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "missing"
    import torch

    versions["torch_build"] = torch.__version__
    return versions


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(source_dir: Path | None = None) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the repository holding rlrunbook's source; None outside a repository."""
    source_dir = source_dir or Path(__file__).resolve().parent
    commit = _git(["rev-parse", "HEAD"], source_dir)
    if commit is None:
        return None
    # --no-optional-locks: a plain `git status` may rewrite the index, which would race with
    # whoever else is using the checkout; recording metadata must not change it.
    status = _git(["--no-optional-locks", "status", "--porcelain"], source_dir)
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def _total_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def hardware() -> dict[str, Any]:
    """Platform, CPU count, memory and the CUDA devices torch sees."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "total_memory_bytes": _total_memory_bytes(),
    }
    try:
        import torch
    except ImportError:
        info.update(torch_cuda_available=None, cuda_devices=[])
        return info
    available = bool(torch.cuda.is_available())
    info["torch_cuda_available"] = available
    info["cuda_devices"] = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    )
    return info


def seeds(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every config key named ``seed`` or ending in ``_seed``, nested sections as dotted paths."""
    found: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            found.update(seeds(value, f"{path}."))
        elif key == "seed" or key.endswith("_seed"):
            found[path] = value
    return found


def filtered_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that shape a run (see ``ENV_PREFIXES``): secret-named ones redacted, and the credentials in
    the others cut out (``TINKER_BASE_URL=https://user:pass@host`` is recorded as ``https://<redacted>@host``)."""
    return {
        k: (REDACTED if is_secret_name(k) else scrub_credentials(v))
        for k, v in sorted(environ.items())
        if k.startswith(ENV_PREFIXES)
    }
