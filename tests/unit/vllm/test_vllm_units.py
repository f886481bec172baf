"""The vLLM sampler's pure parts, without a server: request mapping, settings, server command line,
stop cutting, the zero adapter, adapter names, and the tier's skip/fail rule."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types as pytypes
from pathlib import Path

import pytest
import torch

from rlrunbook.backend.settings import LocalSettings
from rlrunbook.vllm.settings import VllmSettings
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.vllm.adapters import write_zero_unembed_adapter
from rlrunbook.vllm.client import RawChoice, VllmServerError, completion_payload, lora_rank_flag
from rlrunbook.vllm.engine import VllmSamplingEngine
from rlrunbook.vllm.server import ServerLaunch, group_rss_mb, server_arguments, server_environment
from rlrunbook.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_payload_sends_every_distribution_knob_explicitly():
    payload = completion_payload(
        "m",
        [3, 4],
        2,
        SamplingFilters(temperature=0.7, top_k=-1, top_p=0.9),
        16,
        seed=(1 << 62) + 5,
        stop_token_ids=[2],
    )
    assert payload["top_k"] == 0 and payload["top_p"] == 0.9 and payload["temperature"] == 0.7
    assert payload["repetition_penalty"] == 1.0 and payload["presence_penalty"] == 0.0
    assert payload["frequency_penalty"] == 0.0 and payload["min_p"] == 0.0 and payload["min_tokens"] == 0
    assert payload["ignore_eos"] is True and payload["stop_token_ids"] == [2] and payload["logprobs"] == 0
    assert (
        payload["return_token_ids"] is True and payload["seed"] == 5
    )  # child k gets seed + k: stays in int64
    greedy = completion_payload(
        "m", [3], 1, SamplingFilters(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2), 4, 0, []
    )
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["min_p"]) == (0.0, 0, 1.0, 0.0)


def test_filters_vllm_would_sample_differently_are_refused():
    with pytest.raises(ConfigError, match="min-p before top-p"):
        completion_payload("m", [3], 1, SamplingFilters(top_p=0.9, min_p=0.1), 4, 0, [])
    with pytest.raises(ConfigError, match="greedily below"):
        completion_payload("m", [3], 1, SamplingFilters(temperature=1e-6), 4, 0, [])
    completion_payload("m", [3], 1, SamplingFilters(top_k=5, min_p=0.1), 4, 0, [])  # commute: allowed


def test_lora_rank_flag_rounds_up_to_a_value_vllm_accepts():
    assert [lora_rank_flag(r) for r in (1, 2, 8, 9, 16, 17, 32, 33)] == [1, 8, 8, 16, 16, 32, 32, 64]
    with pytest.raises(ConfigError, match="512"):
        lora_rank_flag(513)


def test_settings_from_env(tmp_path):
    settings = VllmSettings.from_env(
        {
            "TINKER_LOCAL_VLLM_URL": "http://127.0.0.1:8000/",
            "TINKER_LOCAL_VLLM_RESTART_EVERY": "5",
            "TINKER_LOCAL_VLLM_MAX_MEMORY_MB": "6000",
            "TINKER_LOCAL_VLLM_COMMAND": "my-vllm --flag 'a b'",
            "TINKER_LOCAL_VLLM_EXTRA_ARGS": "--enforce-eager",
            "TINKER_LOCAL_VLLM_STARTUP_TIMEOUT": "90",
        }
    )
    assert settings.url == "http://127.0.0.1:8000" and settings.restart_every == 5
    assert settings.max_memory_mb == 6000 and settings.command == ("my-vllm", "--flag", "a b")
    assert settings.extra_args == ("--enforce-eager",) and settings.startup_timeout_s == 90
    assert LocalSettings.from_env({"TINKER_LOCAL_SAMPLER": "vllm"}).sampler == "vllm"
    with pytest.raises(ConfigError, match="TINKER_LOCAL_SAMPLER='vllms' must be one of"):
        LocalSettings.from_env({"TINKER_LOCAL_SAMPLER": "vllms"})
    with pytest.raises(ConfigError, match="GPU_MEMORY_UTILIZATION"):
        VllmSettings.from_env({"TINKER_LOCAL_VLLM_GPU_MEMORY_UTILIZATION": "1.5"})


def test_server_command_finds_the_venv_or_names_the_fix(tmp_path):
    venv = tmp_path / "v"
    with pytest.raises(
        ConfigError, match=r"no vLLM server virtualenv found.*setup-vllm\.sh.*TINKER_LOCAL_VLLM_URL"
    ):
        VllmSettings(venv=venv).server_command(None)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert VllmSettings(venv=venv).server_command(None) == (
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
    )


def _launch(device: str) -> ServerLaunch:
    return ServerLaunch(
        command=("py", "-m", "srv"),
        model_folder=Path("/m"),
        dtype="float32",
        device=device,
        max_model_len=2048,
        max_loras=2,
        kv_cache_gb=1.5,
        gpu_memory_utilization=0.3,
        extra_args=("--x",),
        scratch=Path("/s"),
    )


def test_server_command_line_and_environment():
    args = server_arguments(_launch("cpu"), 1234, 16)
    text = " ".join(args)
    for flag in (
        "--logprobs-mode processed_logprobs",
        "--generation-config vllm",
        "--max-lora-rank 16",
        "--enable-lora",
        "--max-loras 3",
        "--no-enable-chunked-prefill",
        "--port 1234",
        "--dtype float32",
    ):
        assert flag in text, flag
    assert args[-1] == "--x" and "--gpu-memory-utilization" not in text
    assert "--gpu-memory-utilization 0.3" in " ".join(server_arguments(_launch("cuda"), 1, 8))
    env = server_environment(_launch("cpu"), {"PYTHONPATH": "/src", "HOME": "/h"})
    assert "PYTHONPATH" not in env and env["HOME"] == "/h" and env["VLLM_CPU_KVCACHE_SPACE"] == "1.5"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["TORCHDYNAMO_DISABLE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in server_environment(_launch("cuda"), {})
    assert "VLLM_SERVER_DEV_MODE" not in env  # the weight-update routes only for a full-parameter trainer's server
    updating = dataclasses.replace(_launch("cpu"), weight_updates=True)
    assert server_environment(updating, {})["VLLM_SERVER_DEV_MODE"] == "1"


def _engine(decode=None) -> VllmSamplingEngine:
    return VllmSamplingEngine(
        pytypes.SimpleNamespace(),
        vocab_size=100,
        max_context=None,
        adapter_dir=Path("/x"),
        unembed_shape=(100, 8),
        decode_batch=decode,
    )


def test_finish_cuts_after_the_first_complete_stop():
    engine = _engine()
    choice = RawChoice(
        tokens=[5, 6, 7, 8, 6, 7, 9, 3], logprobs=[-0.1 * i for i in range(8)], finish_reason="stop"
    )
    request = GenerationRequest(max_tokens=10, stop=((6, 7), (3,)))
    (done,) = engine._finish([choice], request)
    assert done.tokens == [5, 6, 7] and done.logprobs == choice.logprobs[:3] and done.stop_reason == "stop"
    (full,) = engine._finish(
        [RawChoice([5, 6, 5, 6], [-1.0] * 4, "length")], GenerationRequest(max_tokens=4, stop=((6, 7),))
    )
    assert full.tokens == [5, 6, 5, 6] and full.stop_reason == "length"
    (hot,) = engine._finish(
        [RawChoice([1, 2], [-1.0, -2.0], "length")],
        GenerationRequest(max_tokens=2, filters=SamplingFilters(temperature=0.5)),
    )
    assert hot.policy_logprobs is None


def test_finish_refuses_a_stop_nobody_asked_for():
    with pytest.raises(VllmServerError, match="without any requested stop"):
        _engine()._finish(
            [RawChoice([5, 6], [-1.0, -1.0], "stop")], GenerationRequest(max_tokens=8, stop=((9,),))
        )


def test_finish_stop_string_at_the_token_that_completes_it():
    vocab = {5: "ab", 6: "c<", 7: "/x", 8: "yz"}
    engine = _engine(decode=lambda rows: ["".join(vocab[t] for t in row) for row in rows])
    (done,) = engine._finish(
        [RawChoice([5, 6, 7, 8], [-1.0] * 4, "length")],
        GenerationRequest(max_tokens=4, stop_strings=("</x",)),
    )
    assert done.tokens == [5, 6, 7] and done.stop_reason == "stop"


def test_zero_unembed_adapter_leaves_logits_exactly_unchanged(tmp_path):
    from peft import PeftModel

    from rlrunbook.models import load_causal_lm, resolve_model

    model = load_causal_lm(resolve_model("tiny-vllm"), dtype=torch.float32, device="cpu")
    head = model.get_output_embeddings()
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        base = model(input_ids=ids).logits
    write_zero_unembed_adapter(tmp_path / "zero", head.out_features, head.in_features)
    wrapped = PeftModel.from_pretrained(model, str(tmp_path / "zero"))
    with torch.no_grad():
        assert torch.equal(wrapped(input_ids=ids).logits, base)


def test_adapter_names_follow_the_weights(tiny_host):
    from rlrunbook.backend.model_host import SamplerWeights
    from rlrunbook.backend.vllm_sampling import snapshot_adapter

    weights = {"a.lora_B.weight": torch.zeros(4, 2), "a.lora_A.weight": torch.ones(2, 3)}
    same = {k: v.clone() for k, v in weights.items()}
    moved = {**same, "a.lora_B.weight": torch.full((4, 2), 1e-7)}
    name = lambda w: snapshot_adapter(tiny_host, SamplerWeights(adapter=w)).name  # noqa: E731
    assert name(weights) == name(same) != name(moved)
    assert snapshot_adapter(tiny_host, SamplerWeights.base()) is None


class _WeightsServer:
    """A server stand-in that records what ``AdapterSlots`` asks of it: adapter loads and weight reloads, with
    the tensors each reload reads from its folder."""

    served_model = "base"

    def __init__(self):
        self.epoch = 0
        self.reloaded: list[dict[str, torch.Tensor]] = []
        self.client = self

    def load_adapter(self, name: str, path: str) -> None:
        pass

    def unload_adapter(self, name: str) -> None:
        pass

    def alive(self) -> bool:
        return True

    def reload_weights(self, folder: str) -> None:
        from safetensors.torch import load_file

        self.reloaded.append(load_file(str(Path(folder) / "model.safetensors")))


def test_full_weights_are_written_and_reloaded_once_per_version_and_after_a_restart(tmp_path):
    from rlrunbook.vllm.adapters import AdapterSlots, FullWeights

    server = _WeightsServer()
    slots = AdapterSlots(server, tmp_path, unembed_shape=(10, 4), max_loaded=2)
    written = []

    def weights(version: int) -> FullWeights:
        def write(folder: Path) -> None:
            from safetensors.torch import save_file

            written.append(version)
            folder.mkdir(parents=True)
            save_file({"w": torch.full((2,), float(version))}, str(folder / "model.safetensors"))
        return FullWeights(version, write)

    base = slots.name_for(weights(0))
    assert base == slots.name_for(None)  # sampled under the base model's name
    slots.name_for(weights(0))
    slots.name_for(weights(1))
    slots.name_for(weights(1))
    server.epoch += 1  # a restarted server starts from the base model's folder again
    slots.name_for(weights(1))
    assert written == [0, 1, 1] and slots.weight_reloads == 3
    assert all(sync.bytes > 8 and sync.write_s >= 0 and sync.reload_s >= 0 for sync in slots.weight_syncs)
    assert [t["w"][0].item() for t in server.reloaded] == [0.0, 1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith("-weights")], "one folder, the last version"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    slots.close()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith("-weights")]


def test_full_weights_file_holds_every_weight_as_the_model_computes(tiny_folder, tmp_path):
    from safetensors.torch import load_file

    from rlrunbook.backend import sharding
    from rlrunbook.backend.model_host import load_host
    from rlrunbook.backend.vllm_sampling import write_full_weights

    model = load_host(str(tiny_folder), LocalSettings(device="cpu", dtype=torch.float32)).model  # sharded below
    write_full_weights(model, tmp_path / "w")
    saved = load_file(str(tmp_path / "w" / "model.safetensors"))
    params = dict(model.named_parameters())
    assert saved.keys() == params.keys() and "model.embed_tokens.weight" in saved
    assert all(torch.equal(saved[name], param.detach()) for name, param in params.items())
    assert saved.keys() <= model.state_dict().keys()  # the checkpoint's names (vLLM loads them by name)

    sharding.shard(model, torch.float32)
    sharding.release(model)
    with pytest.raises(TypeError, match="is sharded: gather the weights"):
        write_full_weights(model, tmp_path / "sharded")
    sharding.gather(model)
    write_full_weights(model, tmp_path / "gathered")
    gathered = load_file(str(tmp_path / "gathered" / "model.safetensors"))
    assert gathered.keys() == saved.keys() and all(torch.equal(gathered[n], saved[n]) for n in saved)


def test_a_tied_output_layer_is_written_under_its_own_name_too(tmp_path):
    """vLLM reloads a tied output layer in place correctly only when the file names it (see vllm_sampling)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlrunbook.backend.vllm_sampling import write_full_weights

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    assert "lm_head.weight" not in dict(model.named_parameters())
    write_full_weights(model, tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert torch.equal(saved["lm_head.weight"], model.lm_head.weight.detach())


def test_group_rss_counts_this_process_group():
    assert group_rss_mb(os.getpgid(0)) > 10
    assert group_rss_mb(2**22 + 12345) == 0  # no such group


def _run_tier(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RLRUNBOOK_REQUIRE_VLLM",
            "TINKER_LOCAL_VLLM_URL",
            "TINKER_LOCAL_VLLM_COMMAND",
            "PYTEST_ADDOPTS",
        )
    }
    env.update(env_extra)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/vllm/test_vllm_bad_input.py::test_settings_refuse_bad_values",
            "-m",
            "vllm",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_vllm_tier_skips_without_a_server_and_fails_when_required(tmp_path):
    missing = {"RLRUNBOOK_VLLM_VENV": str(tmp_path / "no-venv")}
    skipped = _run_tier(missing)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout + skipped.stderr
    assert "setup-vllm.sh" in skipped.stdout
    failed = _run_tier({**missing, "RLRUNBOOK_REQUIRE_VLLM": "1"})
    assert failed.returncode != 0 and "RLRUNBOOK_REQUIRE_VLLM=1 but no vLLM server" in failed.stdout, (
        failed.stdout
    )


def test_samplers_of_a_server_reached_by_url_leave_no_scratch_folder(monkeypatch, tmp_path):
    """An engine of a server reached by URL writes nothing in the samplers' scratch folder; closing removes it (it
    was left behind, empty, by every service that used such a server)."""
    from rlrunbook.backend import vllm_sampling

    class UrlEngine:
        server = None

        def close(self) -> None:
            pass

    scratches = []

    def open_engine(host, settings, scratch, log, weight_updates=False):
        scratches.append(scratch.parent)
        return UrlEngine()

    monkeypatch.setattr(vllm_sampling, "open_engine", open_engine)
    monkeypatch.setattr(vllm_sampling, "adapter_rank", lambda host: None)
    samplers = vllm_sampling.VllmSamplers(LocalSettings())
    samplers.engine_for(pytypes.SimpleNamespace(model=torch.nn.Linear(2, 2), folder=str(tmp_path)))
    (scratch,) = scratches
    assert scratch.is_dir() and not any(scratch.iterdir())
    samplers.close()
    assert not scratch.exists()
    samplers.close()  # twice: nothing left to remove
