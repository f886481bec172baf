"""Shared pytest wiring: hypothesis profiles, tier markers, the GPU, vLLM and TRL requirements, session-scoped built-in
models.

Loading transformers and a model costs seconds, so models are built once per session into a
cache (``RLRUNBOOK_CACHE_DIR``, default ``~/.cache/rlrunbook``) and shared by fixtures.

Hypothesis profiles (``HYPOTHESIS_PROFILE``, or ``pytest --hypothesis-profile NAME``):

- ``ci`` (the default, and what ``scripts/test.sh`` runs): ``derandomize=True``, so every run tries the same
  examples and CI never flakes on a new one; no deadline, because the 2-core CI machine is shared and
  a slow example is not a wrong one.
- ``dev``: randomized, no deadline, ``RLRUNBOOK_HYPOTHESIS_EXAMPLES`` examples per property (1000 by
  default): local fuzzing, e.g. ``HYPOTHESIS_PROFILE=dev RLRUNBOOK_HYPOTHESIS_EXAMPLES=10000 pytest
  tests/unit/test_regularizers.py``. A test that states its own ``max_examples`` keeps it in both.

An input that once failed becomes an explicit ``@example`` on its property, so it runs in every profile.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from rlrunbook.testing import trl as trl_requirement
from rlrunbook.testing import vllm as vllm_requirement
from rlrunbook.testing.gpu import REQUIRE_ENV, gpu_required, missing_gpu_reason

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", derandomize=False, deadline=None,
                          max_examples=int(os.environ.get("RLRUNBOOK_HYPOTHESIS_EXAMPLES", "1000")))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vllm") is not None:
        missing = vllm_requirement.missing_vllm_reason()
        if missing is not None:
            if vllm_requirement.vllm_required():
                pytest.fail(f"{vllm_requirement.REQUIRE_ENV}=1 but no vLLM server can be had: {missing}", pytrace=False)
            pytest.skip(f"needs a vLLM server ({missing}); set {vllm_requirement.REQUIRE_ENV}=1 to make this a failure")
    if item.get_closest_marker("trl") is not None:
        outcome = trl_requirement.trl_outcome(trl_requirement.missing_trl_reason(), trl_requirement.trl_required())
        if outcome is not None:
            action, reason = outcome
            if action == "fail":
                pytest.fail(reason, pytrace=False)
            pytest.skip(reason)
    if item.get_closest_marker("gpu") is None:
        return
    reason = missing_gpu_reason()
    if reason is None:
        return
    if gpu_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but no usable GPU: {reason}", pytrace=False)
    pytest.skip(f"needs a CUDA GPU ({reason}); set {REQUIRE_ENV}=1 to make this a failure")


@pytest.fixture(scope="session")
def tiny_folder():
    from rlrunbook.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def smollm2_folder():
    from rlrunbook.models import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_host(tiny_folder):
    """The tiny model in fp32 on CPU with its engine (shared: tests must not change its weights)."""
    from rlrunbook.backend.host import load_host
    from rlrunbook.backend.settings import LocalSettings

    return load_host(str(tiny_folder), LocalSettings(device="cpu", dtype=__import__("torch").float32))


@pytest.fixture(scope="session")
def smollm2_host(smollm2_folder):
    from rlrunbook.backend.host import load_host
    from rlrunbook.backend.settings import LocalSettings

    return load_host(str(smollm2_folder), LocalSettings(device="cpu", dtype=__import__("torch").float32))


@pytest.fixture
def local_service(tmp_path):
    """A fresh local ServiceClient on CPU in fp32, storing checkpoints under tmp_path."""
    import torch

    from rlrunbook.backend import LocalServiceClient, LocalSettings

    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / "tinker"))
    yield service
    service.close()
