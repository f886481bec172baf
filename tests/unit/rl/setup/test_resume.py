"""Resume planning (rlrunbook.rl.setup.resume) and the backend's in-memory training state export/import."""

from __future__ import annotations

import json

import pytest
import torch
from tinker import types

from rlrunbook.backend.lora import adapter_parameters
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.resume import CheckpointSchedule, plan_resume
from rlrunbook.run import RunWriter
from rlrunbook.run.checkpoint_format import Checkpoint, capture_rng, save_checkpoint
from rlrunbook.tokens import build_datum_arrays

STORED = validate(TrainConfig(env="qa", dataset="test", num_rollouts=4, steps=4, learning_rate=1e-3,
                              checkpoint={"every": 2}))


def fake_run(root, steps=(2,)):
    """A run directory with metadata and checkpoints at ``steps`` (tiny stand-in tensors)."""
    run = root / "20260101-000000_grpo_qa_run"
    run.mkdir(parents=True)
    (run / "run_metadata.json").write_text(json.dumps({"config": STORED.to_dict(), "dataset": {}}))
    for step in steps:
        save_checkpoint(run, Checkpoint(step, STORED.to_dict(), {"w": torch.ones(2)}, None, capture_rng()))
    return run


def cli_sources(**stated):
    """Sources as build_config records them: the stated keys from the cli, the rest defaults."""
    from rlrunbook.rl.setup.config_sources import leaf_keys

    return {key: ("cli" if key in stated else "default") for key in leaf_keys()}


def test_run_dir_resumes_from_its_latest_checkpoint(tmp_path):
    run = fake_run(tmp_path, steps=(2, 4))
    requested = TrainConfig(steps=6, log_root=str(tmp_path / "new"), name="more")
    resume = plan_resume(run, requested, cli_sources(steps=1, log_root=1, name=1))
    assert resume.step == 4 and resume.checkpoint.path.name == "step_000004"
    assert resume.config == STORED.replace(steps=6, log_root=str(tmp_path / "new"), name="more")
    assert resume.sources["steps"] == "cli" and resume.sources["learning_rate"].startswith("checkpoint:")
    assert resume.record() == {"path": str(run / "checkpoints" / "step_000004"), "run": str(run), "step": 4}


def test_checkpoint_dir_resumes_from_that_checkpoint(tmp_path):
    run = fake_run(tmp_path, steps=(2, 4))
    resume = plan_resume(run / "checkpoints" / "step_000002", TrainConfig(), cli_sources())
    assert resume.step == 2 and resume.config == STORED


def test_other_changed_options_are_refused_by_name(tmp_path):
    run = fake_run(tmp_path)
    with pytest.raises(ConfigError, match=r"learning_rate is 0.0001 here but 0.001 in the checkpoint"):
        plan_resume(run, TrainConfig(learning_rate=1e-4), cli_sources(learning_rate=1))
    with pytest.raises(ConfigError, match=r"checkpoint.every is 3 here"):
        plan_resume(run, TrainConfig(checkpoint={"every": 3}), cli_sources(**{"checkpoint.every": 1}))
    # Stating the stored value again is fine; so is an option left at its default.
    plan_resume(run, TrainConfig(learning_rate=1e-3, env="qa"), cli_sources(learning_rate=1, env=1))


def test_without_sources_fields_off_their_defaults_count_as_stated(tmp_path):
    run = fake_run(tmp_path)
    with pytest.raises(ConfigError, match="num_rollouts is 8 here but 4"):
        plan_resume(run, TrainConfig(num_rollouts=8), None)
    assert plan_resume(run, TrainConfig(steps=5), None).config.steps == 5


@pytest.mark.parametrize("where, error, message", [
    ("missing", ConfigError, "does not exist"),
    ("plain", ConfigError, "neither a run directory"),
    ("bare_run", ConfigError, "has no complete checkpoint"),
])
def test_bad_paths_are_refused(tmp_path, where, error, message):
    (tmp_path / "plain").mkdir()
    (tmp_path / "bare_run").mkdir()
    (tmp_path / "bare_run" / "run_metadata.json").write_text("{}")
    with pytest.raises(error, match=message):
        plan_resume(tmp_path / where, TrainConfig(), cli_sources())


def test_checkpoint_at_or_past_the_requested_steps_is_refused(tmp_path):
    run = fake_run(tmp_path, steps=(2, 4))
    with pytest.raises(ConfigError, match=r"at step 4, so -s 4 has nothing left to run. Pass -s larger than 4"):
        plan_resume(run, TrainConfig(), cli_sources())
    with pytest.raises(ConfigError, match="-s 3 has nothing left"):
        plan_resume(run, TrainConfig(steps=3), cli_sources(steps=1))


def test_corrupted_latest_checkpoint_is_refused_not_skipped(tmp_path):
    run = fake_run(tmp_path, steps=(2, 4))
    (run / "checkpoints" / "step_000004" / "adapter.safetensors").write_bytes(b"garbage")
    with pytest.raises(InputError, match=r"step_000004 is corrupted.*adapter.safetensors does not match"):
        plan_resume(run, TrainConfig(steps=6), cli_sources(steps=1))


def test_checkpoint_due_every_n_and_after_the_last():
    config = TrainConfig(steps=5, checkpoint={"every": 2})
    assert [k for k in range(1, 6) if CheckpointSchedule.of(config).due(k)] == [2, 4, 5]
    assert not any(CheckpointSchedule.of(TrainConfig(steps=5)).due(k) for k in range(1, 6))


def test_copy_steps_from_needs_every_record(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    (tmp_path / "old" / "train_log.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(InputError, match=r"lacks the records of steps before 2 \(train_log.jsonl row 1"):
        RunWriter(tmp_path / "new").copy_steps_from(tmp_path / "old", 2, "baseline")


# --- the backend's export/import ------------------------------------------------------------------------

PROMPT = [5, 17, 42, 9, 11]


def one_step(client, seed: int) -> None:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed, stop=[])
    sequences = client.save_weights_and_get_sampling_client().sample(
        types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
    datums = []
    for sequence, advantage in zip(sequences, [1.0, -1.0, 0.5, -0.5], strict=True):
        a = build_datum_arrays(PROMPT, sequence.tokens, sequence.logprobs, [advantage] * len(sequence.tokens))
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(a.input_tokens),
                                  loss_fn_inputs={"target_tokens": a.target_tokens, "logprobs": a.logprobs,
                                                  "advantages": a.advantages}))
    client.forward_backward(datums, "importance_sampling")
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def adapter_of(client) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in adapter_parameters(client._host.model).items()}


def test_imported_state_continues_training_exactly(local_service):
    """Steps 1-2 on one client, export, step 3; a second client imports the export and takes step 3: same."""
    straight = local_service.create_lora_training_client("tiny", rank=4, seed=0)
    one_step(straight, seed=1)
    one_step(straight, seed=2)
    state = straight.export_training_state()
    assert state.optimizer is not None and all(t.device.type == "cpu" for t in state.adapter.values())
    one_step(straight, seed=3)
    resumed = local_service.create_lora_training_client("tiny", rank=4, seed=7)  # another LoRA init
    resumed.import_training_state(state)
    assert all(torch.equal(adapter_of(resumed)[n], state.adapter[n]) for n in state.adapter)
    one_step(resumed, seed=3)
    expected, got = adapter_of(straight), adapter_of(resumed)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_import_without_optimizer_restarts_adam(local_service):
    source = local_service.create_lora_training_client("tiny", rank=4, seed=0)
    one_step(source, seed=1)
    state = source.export_training_state()
    client = local_service.create_lora_training_client("tiny", rank=4, seed=0)
    client.import_training_state(state, with_optimizer=False)
    assert client._trainer.optimizer_state() is None
    assert client.export_training_state().optimizer is None


def test_import_refuses_another_layout(local_service):
    state = local_service.create_lora_training_client("tiny", rank=4, seed=0).export_training_state()
    other = local_service.create_lora_training_client("tiny", rank=2, seed=0)
    with pytest.raises(ConfigError, match="another LoRA rank"):
        other.import_training_state(state)


def test_resume_with_a_sweep_is_refused(tmp_path, capsys):
    from rlrunbook import cli

    run = fake_run(tmp_path)
    code = cli.main(["train", "--resume-from", str(run), "--sweep", "seed=1,2", "--log-root", str(tmp_path / "x")])
    assert code == 2 and "cannot be combined with a sweep" in capsys.readouterr().err
