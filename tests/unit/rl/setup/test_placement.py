"""What runs where: the 4-bit preset says which engine samples and how the trainer scores, and a 4-bit base
with the in-process sampler cannot be written."""

from __future__ import annotations

import pytest

from rlrunbook import cli
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.config import BackendSettings, TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.placement import placement, resolved_sampler


def test_the_4bit_preset_shows_generate_sampling_and_padded_scoring(capsys, monkeypatch):
    monkeypatch.delenv("TINKER_LOCAL_SAMPLER", raising=False)
    monkeypatch.delenv("TINKER_BACKEND", raising=False)
    assert cli.main(["show-config", "--config-file", "gpu-8b-lora-4bit", "--strict-config"]) == 0
    out = capsys.readouterr().out
    where = out.split("# what runs where:")[1].split("\n\n")[0]
    assert "frozen base weights: 4-bit NF4 (bitsandbytes), computing in bfloat16" in where
    assert "sampling: transformers generate in process (backend.sampler: generate)" in where
    assert "training: transformers' forward over right-padded datums" in where


def test_a_float_model_is_trained_through_the_shared_prefix_pass():
    lines = placement(BackendSettings(device="cpu", dtype="float32"), {})
    assert "sampling: the in-process engine" in lines[1] and "(default: hf)" in lines[1]
    assert lines[2].startswith("training: the shared-prefix decoder pass")


def test_the_sampler_comes_from_the_config_then_the_environment_then_the_default():
    assert resolved_sampler(BackendSettings(sampler="vllm"), {"TINKER_LOCAL_SAMPLER": "generate"}) == (
        "vllm", "backend.sampler")
    assert resolved_sampler(BackendSettings(), {"TINKER_LOCAL_SAMPLER": "generate"}) == (
        "generate", "TINKER_LOCAL_SAMPLER")
    assert resolved_sampler(BackendSettings(), {}) == ("hf", "default")


def test_a_4bit_base_sampled_by_vllm_says_the_server_has_other_weights():
    lines = placement(BackendSettings(device="cuda", load_in_4bit=True, sampler="vllm"), {})
    assert any("unquantised" in line and "mismatch gate" in line for line in lines)


def test_the_hosted_service_runs_everything():
    assert placement(BackendSettings(load_in_4bit=True), {"TINKER_BACKEND": "api"}) == [
        "sampling and training: the hosted Tinker service (TINKER_BACKEND=api); backend.* is not used"]


def test_a_service_at_a_url_is_named():
    assert placement(BackendSettings(), {"TINKER_BACKEND": "api", "TINKER_BASE_URL": "http://127.0.0.1:8000"}) == [
        "sampling and training: the Tinker service at http://127.0.0.1:8000 (TINKER_BACKEND=api); backend.* is not "
        "used"]


def test_a_4bit_base_with_the_in_process_sampler_is_refused_before_loading():
    config = TrainConfig(backend=BackendSettings(device="cuda", load_in_4bit=True, sampler="hf"))
    with pytest.raises(ConfigError, match="backend.sampler: generate"):
        validate(config)
    with pytest.raises(ConfigError, match="TINKER_LOCAL_SAMPLER=generate"):
        LocalSettings(device="cpu", load_in_4bit=True)  # the default sampler is hf
    assert LocalSettings(device="cpu", load_in_4bit=True, sampler="generate").load_in_4bit


def test_a_4bit_base_with_full_training_is_refused():
    """4-bit weights are the frozen base of LoRA training; full training has no frozen weights to quantise."""
    config = TrainConfig(finetune="full", backend=BackendSettings(device="cuda", load_in_4bit=True, sampler="vllm"))
    with pytest.raises(ConfigError, match="finetune full trains every weight .*Drop load_in_4bit, or set finetune: "
                                          "lora"):
        validate(config)
    assert validate(config.replace(finetune="lora")).backend.load_in_4bit


@pytest.mark.parametrize(("changes", "named"), [
    ({"off_policy": 1}, "--off-policy 1 samples batches from past weights"),
    ({"backend": BackendSettings(sampler="generate")}, "backend.sampler generate with finetune full"),
])
def test_what_full_training_cannot_do_is_refused_before_loading(changes, named):
    """Full training keeps no copies of past weights (asynchronous runs sample from them) and samples its gathered
    live weights in process or on a vLLM server of its own (transformers' generate has no such path)."""
    config = TrainConfig(finetune="full", **changes)
    with pytest.raises(ConfigError, match=named):
        validate(config)
    validate(config.replace(finetune="lora"))


def test_full_training_samples_with_hf_or_vllm():
    for sampler in ("hf", "vllm", None):
        assert validate(TrainConfig(finetune="full", backend=BackendSettings(sampler=sampler))).finetune == "full"


@pytest.mark.parametrize(("env", "named"), [
    ({"TINKER_LOCAL_SAMPLER": "generate"}, "TINKER_LOCAL_SAMPLER=generate with finetune full"),
    ({"TINKER_LOCAL_SAMPLER": "vllm", "TINKER_LOCAL_VLLM_URL": "http://127.0.0.1:8000"},
     "TINKER_LOCAL_VLLM_URL with finetune full"),
])
def test_a_sampler_of_the_environment_full_training_cannot_use_is_refused(env, named):
    """What the environment chooses is refused by the plan's check, before the data set loads."""
    from rlrunbook.rl.training.plan import check_full_sampler

    with pytest.raises(ConfigError, match=named):
        check_full_sampler(TrainConfig(finetune="full"), env)
    check_full_sampler(TrainConfig(finetune="lora"), env)
    check_full_sampler(TrainConfig(finetune="full", backend=BackendSettings(sampler="hf")), env)
    check_full_sampler(TrainConfig(finetune="full"), {"TINKER_LOCAL_SAMPLER": "vllm"})
    with pytest.raises(ConfigError, match="TINKER_LOCAL_VLLM_URL with finetune full"):
        check_full_sampler(TrainConfig(finetune="full", backend=BackendSettings(sampler="vllm")),
                           {"TINKER_LOCAL_VLLM_URL": "http://127.0.0.1:8000"})


@pytest.mark.parametrize(("stated", "env", "expected"), [
    (BackendSettings(device="cuda"), {}, "invariant (default); fixed-order Triton kernels"),
    (BackendSettings(device="cuda", dtype="float16"), {}, "invariant (default); fixed-order Triton kernels"),
    (BackendSettings(device="cpu", dtype="bfloat16"), {}, "invariant (default); fixed-order C kernels"),
    (BackendSettings(), {"TINKER_LOCAL_DEVICE": "cuda:1"}, "invariant (default); fixed-order Triton kernels"),
    (BackendSettings(device="cuda"), {"TINKER_LOCAL_NUMERICS": "exact"}, "exact (TINKER_LOCAL_NUMERICS); float64"),
    (BackendSettings(device="cpu"), {"TINKER_LOCAL_NUMERICS": "native"}, "native (TINKER_LOCAL_NUMERICS); PyTorch's"),
])
def test_the_numerics_line_names_the_kernels_that_compute_them(stated, env, expected):
    line = placement(stated, env)[-1]
    assert line.startswith(f"numerics: {expected}"), line
