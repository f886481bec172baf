"""Full-parameter training with the vLLM sampler: a managed server of the client's own (started with vLLM's
weight-update routes) whose weights are replaced in place by the trainer's before each new version is first
sampled. What it samples must be what the trainer scores: the server's logprobs of its own tokens equal the
trainer's teacher-forced logprobs of the same weights (fp32, within the tier's 1e-4 parity bound), at every
version, after a restart, and with the prompt's prefix cached from the previous version."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinker import types
from vllm_support import supervised_datum

pytestmark = pytest.mark.vllm

MODEL = "tiny-vllm"
PARITY = 1e-4


def _tied_copy(folder: Path) -> Path:
    """``tiny-vllm`` with its output layer tied to the embeddings (as SmolLM2's and Qwen2.5-Math's are)."""
    from rlrunbook.models import resolve_model

    shutil.copytree(resolve_model(MODEL), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(str(folder / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module", params=["untied", "tied"])
def full_training(request, tmp_path_factory):
    """A full-parameter training client of ``tiny-vllm`` (and of a tied copy: vLLM reloads a tied output layer
    wrongly, which the served copy avoids) sampling through a managed server of its own."""
    from rlrunbook.backend import LocalServiceClient, LocalSettings
    from rlrunbook.vllm.settings import VllmSettings

    tmp = tmp_path_factory.mktemp("vllm_full")
    model = MODEL if request.param == "untied" else str(_tied_copy(tmp / "tiny-vllm-tied"))
    env = {k: v for k, v in os.environ.items() if k != "TINKER_LOCAL_VLLM_URL"}  # a server of its own
    settings = LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp / "tinker", sampler="vllm",
                             vllm=dataclasses.replace(VllmSettings.from_env(env), adapter_dir=tmp / "adapters"))
    service = LocalServiceClient(settings)
    yield service.create_full_training_client(model)
    service.close()


def _prompt(tokenizer) -> types.ModelInput:
    """A prompt long enough to fill several prefix-cache blocks, so a stale cache would show."""
    text = "Question: what is seven times eight? Think about it step by step, then answer. " * 4
    return types.ModelInput.from_ints(tokenizer.encode(text))


def _sample_and_score(sampler, prompt: types.ModelInput) -> tuple[list[list[int]], float]:
    """Two seeded samples of ``prompt``; their tokens, and the largest gap between the server's logprobs and the
    trainer's teacher-forced logprobs of the same tokens."""
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    response = sampler.sample(prompt, 2, params).result()
    gap = 0.0
    for sequence in response.sequences:
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + list(sequence.tokens)))
        trainer = torch.tensor(scored.result()[-len(sequence.tokens):])
        gap = max(gap, (torch.tensor(sequence.logprobs) - trainer).abs().max().item())
    return [list(s.tokens) for s in response.sequences], gap


def test_the_server_samples_each_versions_weights(full_training, record_property):
    engine = full_training._host.vllm
    tokenizer = full_training.get_tokenizer()
    prompt = _prompt(tokenizer)
    datum = supervised_datum(tokenizer, "What is 7 * 8?", " The answer is 56.")
    tokens, gaps = [], []
    first = None
    for version in range(3):
        if version:
            full_training.forward_backward([datum], "cross_entropy").result()
            full_training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        sampler = full_training.save_weights_and_get_sampling_client()
        first = first or sampler
        sampled, gap = _sample_and_score(sampler, prompt)
        tokens.append(sampled)
        gaps.append(gap)
    record_property("sampler_trainer_gap_per_version", gaps)
    assert max(gaps) <= PARITY, gaps
    assert tokens[0] != tokens[2], "the same seed drew the same tokens: the server's weights did not move"
    assert engine.adapters.weight_reloads == 3  # once per version, none for the prompt-logprob calls

    again, gap = _sample_and_score(sampler, prompt)
    assert again == tokens[2] and gap <= PARITY and engine.adapters.weight_reloads == 3

    engine.server.restart("a restart starts from the base model's folder")
    after_restart, gap = _sample_and_score(sampler, prompt)
    assert after_restart == tokens[2] and gap <= PARITY and engine.adapters.weight_reloads == 4

    with pytest.raises(Exception, match="holds the weights of version 0"):
        first.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=1)).result()


def test_a_users_server_is_refused_for_full_training(tmp_path):
    from rlrunbook.backend import LocalServiceClient, LocalSettings
    from rlrunbook.errors import ConfigError
    from rlrunbook.vllm.settings import VllmSettings

    settings = LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / "tinker", sampler="vllm",
                             vllm=VllmSettings(url="http://127.0.0.1:9"))
    service = LocalServiceClient(settings)
    try:
        with pytest.raises(ConfigError, match="unset TINKER_LOCAL_VLLM_URL"):
            service.create_full_training_client(MODEL)
    finally:
        service.close()


def test_train_full_parameters_with_the_vllm_sampler(tmp_path, capsys, monkeypatch):
    """`rlrunbook train finetune=full` sampling through vLLM passes check-run (the mismatch gate included)."""
    import json

    from rlrunbook import cli
    from rlrunbook.run import check_run, format_results, rubric_passed

    monkeypatch.setenv("TINKER_LOCAL_SAMPLER", "vllm")
    monkeypatch.delenv("TINKER_LOCAL_VLLM_URL", raising=False)
    code = cli.main(["train", "--no-proxy", "--log-root", str(tmp_path), "--model", MODEL, "--env", "summary",
                     "--dataset", "cnn_dailymail", "--reward-fn", "compression", "-n", "8", "--num-groups", "2",
                     "-s", "2", "--max-tokens", "16", "--learning-rate", "1e-3", "--name", "full_vllm",
                     "finetune=full"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[vllm] sampling with" in out
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    results = check_run(run)
    assert rubric_passed(results), format_results(results)
    rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert len(rows) == 2


def test_the_weight_sync_script_reports_each_version(tmp_path):
    """``scripts/vllm_weight_sync.py`` (the figures in docs/vllm.md) on ``tiny-vllm``: one row per version."""
    import subprocess
    import sys

    from rlrunbook.testing import ranks

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sync.json"
    env = ranks.child_env()
    env.pop("TINKER_LOCAL_VLLM_URL", None)
    done = subprocess.run([sys.executable, str(root / "scripts" / "vllm_weight_sync.py"), "--model", MODEL,
                           "--steps", "1", "--rows", "2", "--max-tokens", "8", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [v["version"] for v in result["versions"]] == [0, 1]
    assert all(v["gap"] <= PARITY and v["file_mb"] > 0 and v["reload_s"] > 0 for v in result["versions"])
    assert "median after a step" in done.stdout
