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

Triton: on a machine without CUDA, ``TRITON_INTERPRET=1`` is set before anything imports triton, so the CUDA kernels
of the default numerics run interpreted on CPU (``tests/unit/kernels/test_triton_kernels.py``).

Data (``rlrunbook.testing.data``): no test reaches the Hugging Face hub for data, nor reads a data set cached from
it on this machine (``datasets`` offline with an empty cache; models offline unless ``HF_HUB_OFFLINE`` says
otherwise); a test marked ``data`` reads the project's real data sets where they are
(``$RLRUNBOOK_DATA_DIR``, else ``shared/data`` beside the checkout), skips without them and fails without them
when ``RLRUNBOOK_REQUIRE_DATA=1``; every other test sees an empty data root, so it runs the same with or without
real data beside the checkout (as in a lone clone) and reads only what the suite generates.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

# Without CUDA the Triton kernels of the default numerics can only run interpreted (tests/unit/kernels): the knob must
# be set before triton is imported, because its own library functions (tl.sum, ...) are compiled at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rlrunbook.testing import data as data_requirement

# The session's scratch: an empty data root for the tests not marked `data`, an empty cache for `datasets`. The
# hub's variables are set before anything imports huggingface_hub or datasets, which read them once.
_SCRATCH = Path(tempfile.mkdtemp(prefix="rlrunbook-tests-"))
os.environ.update(data_requirement.offline_hub_env(_SCRATCH / "hf-datasets", os.environ))

import pytest
from hypothesis import settings

from rlrunbook.testing import trl as trl_requirement
from rlrunbook.testing import vllm as vllm_requirement
from rlrunbook.testing.gpu import REQUIRE_ENV, gpu_required, missing_gpu_reason, not_proven_reason

# Under RLRUNBOOK_REQUIRE_GPU=1 a gpu test's skip is a failure unless it names an optional part of the tier.
pytest_plugins = ("rlrunbook.testing.gpu_plugin",)

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", derandomize=False, deadline=None,
                          max_examples=int(os.environ.get("RLRUNBOOK_HYPOTHESIS_EXAMPLES", "1000")))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_data_roots: data_requirement.DataRoots | None = None
_DATA_ROOT_BEFORE = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    global _data_roots
    (_SCRATCH / "no-data").mkdir(exist_ok=True)
    _data_roots = data_requirement.DataRoots(os.environ, _SCRATCH / "no-data")
    _data_roots.hide()  # from collection on; a `data` test's setup shows the real root, its teardown hides it again


def pytest_unconfigure(config: pytest.Config) -> None:
    if _data_roots is not None:
        _data_roots.show()
    shutil.rmtree(_SCRATCH, ignore_errors=True)


def _data_setup(item: pytest.Item) -> None:
    """Show a `data` test the real data root, or skip it (fail it when required) without the data it names."""
    marker = item.get_closest_marker("data")
    if marker is None:
        return
    item.stash[_DATA_ROOT_BEFORE] = _data_roots.show()
    outcome = data_requirement.data_outcome(data_requirement.missing_data_reason(marker.args),
                                            data_requirement.data_required())
    if outcome is not None:
        action, reason = outcome
        if action == "fail":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield  # after the test's fixtures are torn down (a monkeypatch of the variable is undone first)
    if _DATA_ROOT_BEFORE in item.stash:
        _data_roots.put_back(item.stash[_DATA_ROOT_BEFORE])


def _gpu_setup(item: pytest.Item) -> None:
    """Skip a `gpu` test without a usable GPU, or fail it under RLRUNBOOK_REQUIRE_GPU=1 (checked first: a gpu test's
    other requirements, an optional vLLM server among them, mean nothing on a machine without a GPU)."""
    if item.get_closest_marker("gpu") is None:
        return
    reason = missing_gpu_reason()
    if reason is None:
        return
    if gpu_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but no usable GPU: {reason}", pytrace=False)
    pytest.skip(f"needs a CUDA GPU ({reason}); set {REQUIRE_ENV}=1 to make this a failure")


def pytest_runtest_setup(item: pytest.Item) -> None:
    _gpu_setup(item)
    _data_setup(item)
    if item.get_closest_marker("vllm") is not None:
        missing = vllm_requirement.missing_vllm_reason()
        if missing is not None:
            if vllm_requirement.vllm_required():
                pytest.fail(f"{vllm_requirement.REQUIRE_ENV}=1 but no vLLM server can be had: {missing}", pytrace=False)
            if item.get_closest_marker("gpu") is not None:  # the gpu tier's vLLM cases: an optional part
                pytest.skip(not_proven_reason("vllm", f"{missing}; set {vllm_requirement.REQUIRE_ENV}=1 to make this a failure"))
            pytest.skip(f"needs a vLLM server ({missing}); set {vllm_requirement.REQUIRE_ENV}=1 to make this a failure")
    if item.get_closest_marker("trl") is not None:
        outcome = trl_requirement.trl_outcome(trl_requirement.missing_trl_reason(), trl_requirement.trl_required())
        if outcome is not None:
            action, reason = outcome
            if action == "fail":
                pytest.fail(reason, pytrace=False)
            pytest.skip(reason)


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
    from rlrunbook.backend.model_host import load_host
    from rlrunbook.backend.settings import LocalSettings

    return load_host(str(tiny_folder), LocalSettings(device="cpu", dtype=__import__("torch").float32))


@pytest.fixture(scope="session")
def smollm2_host(smollm2_folder):
    from rlrunbook.backend.model_host import load_host
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


@pytest.fixture
def generated_data(tmp_path, monkeypatch):
    """Generated stand-ins for the real data sets (``rlrunbook.testing.data.write_data_root``): ``{kind: file}``,
    and the kind names (``gsm8k``, ``nq_open``, ``cnn_dailymail``) resolve to them for this test."""
    from rlrunbook.rl.data import DATA_DIR_ENV

    files = data_requirement.write_data_root(tmp_path / "generated-data")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "generated-data"))
    return files
