"""Bad input to the vLLM sampler: each is refused at connect time with the cause and the fix."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from rlrunbook.backend import LocalServiceClient
from rlrunbook.vllm.settings import VllmSettings
from rlrunbook.vllm.client import VllmServerError
from rlrunbook.errors import ConfigError

pytestmark = pytest.mark.vllm
MODEL = "tiny-vllm"


def _service(settings, **vllm):
    return LocalServiceClient(dataclasses.replace(settings, vllm=dataclasses.replace(settings.vllm, **vllm)))


def test_url_that_does_not_answer(vllm_settings):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = _service(vllm_settings, url=f"http://127.0.0.1:{port}")
    with pytest.raises(
        VllmServerError, match=rf"no answer from the vLLM server at http://127.0.0.1:{port}.*running"
    ):
        service.create_lora_training_client(MODEL, rank=8)
    service.close()


def test_server_serving_another_model(vllm_settings, tmp_path):
    """Same architecture and vocabulary, other weights (another seed): the probe tells them apart."""
    from rlrunbook.models.tiny import build_tiny_vllm

    other = build_tiny_vllm(tmp_path / "tiny-vllm-seed1", seed=1)
    service = _service(vllm_settings)
    with pytest.raises(VllmServerError, match="serves another model.*--model"):
        service.create_lora_training_client(str(other), rank=8)
    service.close()


def test_lora_rank_above_the_servers_max(vllm_settings):
    """The session's server runs --max-lora-rank 16; a rank-32 adapter (the SDK default) is refused at
    client creation, before any step, naming the flag to restart it with."""
    service = _service(vllm_settings)
    with pytest.raises(ConfigError, match=r"rank 32.*--max-lora-rank 32"):
        service.create_lora_training_client(MODEL, rank=32)
    service.close()


def test_min_p_with_top_p_refused(vllm_service):
    from tinker import types

    sampler = vllm_service.create_sampling_client(base_model=MODEL)
    with pytest.raises(ConfigError, match="min-p before top-p"):
        sampler.sample(
            types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=4, top_p=0.9), min_p=0.1
        )


def test_unknown_served_model_name(vllm_settings):
    service = _service(vllm_settings, served_model="not-served")
    with pytest.raises(VllmServerError, match="not-served"):
        service.create_sampling_client(base_model=MODEL)
    service.close()


def test_settings_refuse_bad_values():
    with pytest.raises(ConfigError, match="TINKER_LOCAL_VLLM_URL"):
        VllmSettings.from_env({"TINKER_LOCAL_VLLM_URL": "127.0.0.1:8000"})
    with pytest.raises(ConfigError, match="TINKER_LOCAL_VLLM_RESTART_EVERY"):
        VllmSettings.from_env({"TINKER_LOCAL_VLLM_RESTART_EVERY": "often"})
