"""``rlrunbook eval-checkpoints`` on a tiny run with two checkpoints (after steps 1 and 2)."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from tinker import types

from rlrunbook import cli
from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.backend.model_host import load_host
from rlrunbook.backend.lora import load_adapter, wrap_with_lora
from rlrunbook.engines.scoring import teacher_forced_logprobs
from rlrunbook.rl.evaluation.checkpoint_eval import checkpoint_samplers
from rlrunbook.run.checkpoint_format import checkpoint_dirs, load_checkpoint

pytestmark = pytest.mark.e2e

TRAIN = ["--model", "tiny", "--env", "qa", "--dataset", "test", "-n", "16", "--num-groups", "2",
         "--max-tokens", "32", "--learning-rate", "1e-2", "--seed", "1", "-s", "2", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    assert cli.main(["train", "--log-root", str(logs), *TRAIN]) == 0
    (run_dir,) = logs.iterdir()
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [1, 2]
    return run_dir


def test_table_has_one_row_per_checkpoint_and_the_base(run, tmp_path, capsys):
    out = tmp_path / "table.csv"
    code = cli.main(["eval-checkpoints", str(run), "--samples", "4", "--num-problems", "6", "--ks", "1", "2",
                     "--threshold", "0.1", "--resamples", "500", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = list(csv.DictReader(out.open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert list(rows[0]) == ["step", "mean_reward", "mean_ci_low", "mean_ci_high", "pass@1", "pass@1_ci_low",
                             "pass@1_ci_high", "pass@2", "pass@2_ci_low", "pass@2_ci_high"]
    for row in rows:
        value = {k: float(v) for k, v in row.items()}
        assert value["mean_ci_low"] <= value["mean_reward"] <= value["mean_ci_high"]
        for k in (1, 2):
            assert value[f"pass@{k}_ci_low"] <= value[f"pass@{k}"] <= value[f"pass@{k}_ci_high"]
        assert value["pass@1"] <= value["pass@2"]
    assert printed.count("[eval-checkpoints] step") == 3 and "pass@2_ci_high" in printed


def test_each_sampler_computes_with_its_checkpoints_adapter(run, tmp_path):
    """Logprobs of one fixed sequence: step 0 = base model; steps 1, 2 = a model given the saved tensors by hand."""
    config = json.loads((run / "checkpoints" / "step_000001" / "checkpoint.json").read_text())["config"]
    record = json.loads((run / "baseline_0.json").read_text())["records"][0]
    settings = LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / "tinker")
    service = LocalServiceClient(settings)
    try:
        training = service.create_lora_training_client("tiny", rank=config["lora_rank"], seed=config["seed"])
        tokens = training.get_tokenizer().encode("What is 7 * 8?") + record["completion_tokens"]
        prompt = types.ModelInput.from_ints(tokens)
        folders = [folder for _, folder in checkpoint_dirs(run)]
        got = {step: sampler.compute_logprobs(prompt).result()[1:]
               for step, sampler in checkpoint_samplers(training, folders)}
        base = service.create_sampling_client(base_model="tiny").compute_logprobs(prompt).result()[1:]
    finally:
        service.close()
    assert got[0] == base
    assert got[1] != got[0] and got[2] != got[1], "the checkpoints' adapters did not change the logprobs"
    host = load_host("tiny", settings)
    model = wrap_with_lora(host.model, rank=config["lora_rank"], alpha=settings.lora_alpha, seed=123)
    for step, folder in zip((1, 2), folders, strict=True):
        load_adapter(model, load_checkpoint(folder).adapter)
        (expected,) = teacher_forced_logprobs(model, [tokens], host.pad_token_id)
        # compute_logprobs runs the trainer's forward, transformers' forward is the reference: the fp32 parity gate
        # (1e-4) separates them from a wrong adapter, which moves these logprobs by far more (see the != above)
        assert torch.allclose(torch.tensor(got[step]), expected.float(), atol=1e-4, rtol=0), step
