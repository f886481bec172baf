"""The base models a server offers (``rlrunbook serve --base-models``): the default keeps the documented names and
folders, and any other base model, a folder of the server's disk included, is refused naming the option."""

from __future__ import annotations

import shutil

import pytest
import tinker

from rlrunbook.models import resolve_model
from rlrunbook.service.base_models import BaseModelRefusedError, BaseModels
from rlrunbook.testing.serve import start_server

KEY = "tml-base-models-key-0001"


def test_the_default_offers_the_builtins_and_the_cache_and_refuses_any_other_folder(tmp_path):
    offered = BaseModels.from_option(None)
    offered.check("tiny")
    offered.check(str(resolve_model("tiny")))  # the folder `rlrunbook resolve-model tiny` prints
    elsewhere = tmp_path / "tiny-elsewhere"
    shutil.copytree(resolve_model("tiny"), elsewhere)
    with pytest.raises(BaseModelRefusedError, match="--base-models"):
        offered.check(str(elsewhere))
    with pytest.raises(BaseModelRefusedError, match="--base-models"):
        offered.check(str(tmp_path / "no-such-folder"))


@pytest.mark.slow
def test_a_server_loads_only_the_base_models_it_was_given(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    allowed = tmp_path / "models"
    shutil.copytree(resolve_model("tiny"), allowed / "tiny-copy")
    (allowed / "leads-out").symlink_to(resolve_model("tiny"))  # inside by name, outside once resolved
    server = start_server(tmp_path / "storage", "--api-key", KEY, "--base-models", str(allowed), "tiny")
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        for name in ("tiny", str(allowed / "tiny-copy")):
            assert service.create_lora_training_client(base_model=name, rank=4).result().get_info().model_id
        for name in (str(resolve_model("tiny")), str(allowed / "leads-out"), "smollm2-135m"):
            with pytest.raises(tinker.BadRequestError, match="--base-models"):
                service.create_lora_training_client(base_model=name, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="--base-models"):
            service.create_sampling_client(base_model=str(resolve_model("tiny"))).result()
    finally:
        server.stop()
