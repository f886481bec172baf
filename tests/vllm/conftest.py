"""Fixtures of the vLLM tier: one real vLLM server of ``tiny-vllm`` per session, and clients of it.

The server is started by the project's own managed mode (``ManagedServer``, from ``.venv-vllm`` or
``RLRUNBOOK_VLLM_VENV``) with ``--max-lora-rank 16``, and the tests reach it in external mode (its
URL), as a user's own server would be reached. ``TINKER_LOCAL_VLLM_URL`` set in the environment
points the tier at a running server of ``tiny-vllm`` instead. The root conftest decides first
whether the tier runs at all (skip, or fail under ``RLRUNBOOK_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

SERVER_MAX_LORA_RANK = 16
MODEL = "tiny-vllm"


@pytest.fixture(scope="session")
def vllm_url(request) -> str:
    """URL of a vLLM server serving ``tiny-vllm`` (fp32, processed logprobs, runtime LoRA up to rank 16)."""
    given = os.environ.get("TINKER_LOCAL_VLLM_URL", "").strip()
    if given:
        return given.rstrip("/")
    from rlrunbook.vllm.settings import VllmSettings
    from rlrunbook.vllm.server import ManagedServer, ServerLaunch
    from rlrunbook.models import resolve_model
    from rlrunbook.testing.vllm import CHECKOUT

    settings = VllmSettings.from_env(dict(os.environ))
    scratch = Path(tempfile.mkdtemp(prefix="rlrunbook-vllm-tests-"))
    launch = ServerLaunch(
        command=settings.server_command(CHECKOUT),
        model_folder=resolve_model(MODEL),
        dtype="float32",
        device="cpu",
        max_model_len=2048,
        max_loras=2,
        kv_cache_gb=1.0,
        gpu_memory_utilization=0.4,
        extra_args=(),
        scratch=scratch,
    )
    server = ManagedServer(launch, max_lora_rank=SERVER_MAX_LORA_RANK, startup_timeout_s=600)
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    request.addfinalizer(server.stop)
    server.start()
    return server.client.base_url


@pytest.fixture
def vllm_settings(vllm_url, tmp_path):
    """Local-backend settings (CPU, fp32) that sample through the session's server."""
    from rlrunbook.backend import LocalSettings
    from rlrunbook.vllm.settings import VllmSettings

    return LocalSettings(
        device="cpu",
        dtype=torch.float32,
        storage_dir=tmp_path / "tinker",
        sampler="vllm",
        vllm=VllmSettings(url=vllm_url, adapter_dir=tmp_path / "adapters"),
    )


@pytest.fixture
def vllm_service(vllm_settings):
    """A local ServiceClient whose sampling clients sample through the session's vLLM server."""
    from rlrunbook.backend import LocalServiceClient

    service = LocalServiceClient(vllm_settings)
    yield service
    service.close()
