"""tinker-cookbook recipes, unmodified, on the local backend: each for 2 steps on ``tiny``.

Every recipe runs in its own process through ``python -m rlrunbook.cookbook`` (the bindings are
per process), offline (``HF_HUB_OFFLINE=1``), and is judged from the recipe's own files:
``metrics.jsonl`` (one row per step) and ``checkpoints.jsonl``.

- math RL (``recipes.math_rl.train``) on the synthetic arithmetic environment, synchronous and in
  the off-policy async mode (several live sampler snapshots), with ``compute_post_kl`` (prompt logprobs);
- the minimal RL loop (``recipes.rl_loop``) on GSM8K served from the project's local copy (a ``data`` test: it
  skips without the copy), and from a warm start on generated GSM8K-format questions;
- supervised learning with cross_entropy: the minimal loop (``recipes.sl_loop``, its hub data set
  served from the cookbook's bundled example conversations) and the library loop (``recipes.sl_basic``);
- an exact resume of ``sl_loop`` from its own ``save_state`` checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COMMON_RL = ["model_name=tiny", "lora_rank=8", "loss_fn=importance_sampling"]


@pytest.fixture(scope="module")
def conversations() -> Path:
    try:
        return Path(str(resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"))
    except ModuleNotFoundError:
        pytest.fail("tinker-cookbook is not installed: run `RLRUNBOOK_EXTRAS=test,cookbook bash scripts/setup.sh`",
                    pytrace=False)


def run_recipe(tmp_path: Path, *args: str, expect_rc: int = 0, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TINKER_LOCAL_STORAGE=str(tmp_path / "tinker"), HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"), PYTHONUNBUFFERED="1", **env_vars)
    env.setdefault("TINKER_LOCAL_DEVICE", "cpu")
    done = subprocess.run([sys.executable, "-m", "rlrunbook.cookbook", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == expect_rc, f"exit {done.returncode}\n{done.stderr[-6000:]}"
    return done


def step_rows(log_path: Path, steps: int) -> list[dict]:
    """The recipe's per-step metric rows 0..steps-1 (a trailing totals row, if any, is left out)."""
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for row in rows:
        by_step.setdefault(row["step"], {}).update(row)
    assert list(range(steps)) == [s for s in sorted(by_step) if s < steps], sorted(by_step)
    return [by_step[s] for s in range(steps)]


def finite(row: dict, *keys: str) -> None:
    for key in keys:
        assert key in row and math.isfinite(row[key]), (key, row.get(key))


def final_checkpoint(tmp_path: Path, log_path: Path) -> dict:
    record = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()][-1]
    for key, kind in (("state_path", "weights"), ("sampler_path", "sampler_weights")):
        model_id, segment, name = record[key].removeprefix("tinker://").split("/")
        assert segment == kind
        assert (tmp_path / "tinker" / model_id / segment / name / "adapter_model.safetensors").is_file()
    return record


def test_math_rl_arithmetic(tmp_path):
    log = tmp_path / "math_rl"
    run_recipe(tmp_path, "tinker_cookbook.recipes.math_rl.train", *COMMON_RL, "renderer_name=qwen3_instruct",
               "env=arithmetic", "group_size=8", "groups_per_batch=8", "max_tokens=24", "max_steps=2",
               "eval_every=0", "save_every=0", "compute_post_kl=True", f"log_path={log}",
               "behavior_if_log_dir_exists=delete")
    rows = step_rows(log, 2)
    for row in rows:
        finite(row, "loss:sum", "grad_norm:mean", "env/all/reward/total", "time/total", "kl_pre_post_v1")
        # On-policy: the sampler's logprobs are the trainer's (to float precision).
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-4, row["optim/kl_sample_train_v1"]
    assert any(row["loss:sum"] != 0 for row in rows), "rewards varied in some group, so something trained"
    assert final_checkpoint(tmp_path, log)["batch"] == 2


def test_math_rl_async_off_policy(tmp_path):
    """max_steps_off_policy=1, the recipe unmodified: rollouts of step k may come from the step k-1 sampler
    while k trains, and the backend's timeline shows sampling calls running while training calls run."""
    from rlrunbook.backend.timeline import overlap_seconds, read_timeline

    log, timeline = tmp_path / "math_rl_async", tmp_path / "timeline.jsonl"
    done = run_recipe(tmp_path, "tinker_cookbook.recipes.math_rl.train", *COMMON_RL, "renderer_name=qwen3_instruct",
                      "env=arithmetic", "group_size=8", "groups_per_batch=8", "max_tokens=24", "max_steps=3",
                      "max_steps_off_policy=1", "eval_every=0", "save_every=0", f"log_path={log}",
                      "behavior_if_log_dir_exists=delete", TINKER_LOCAL_TIMELINE=str(timeline))
    assert "TINKER_LOCAL_CONCURRENT_SAMPLING=1: max_steps_off_policy=1" in done.stderr
    rows = step_rows(log, 3)
    for row in rows:
        finite(row, "loss:sum", "grad_norm:mean", "optim/kl_sample_train_v1", "time/total")
    lags = [row["training_client/step"] - row["sampling_client/step_min"] for row in rows]
    assert max(lags) >= 1, f"no step trained on an older snapshot's rollouts: lags {lags}"
    records = read_timeline(timeline)
    training = [r for r in records if r["worker"] == "rlrunbook-local" and ("forward_backward" in r["call"]
                                                                             or "optim_step" in r["call"])]
    assert training and any(r["worker"] == "rlrunbook-sampler" for r in records)
    both = training + [r for r in records if r["worker"] == "rlrunbook-sampler"]
    assert overlap_seconds(both, "rlrunbook-local", "rlrunbook-sampler") > 0, "sampling never ran during training"


@pytest.mark.data("gsm8k")
def test_rl_loop_on_local_gsm8k(tmp_path):
    """The minimal RL loop: GSM8K from the project's copy. A random tiny model earns no \\boxed{} reward,
    so the recipe itself skips each step's update (its rule for all-zero advantages) and logs no loss."""
    from rlrunbook.testing.data import real_data_path

    gsm8k = real_data_path("gsm8k")
    log = tmp_path / "rl_loop"
    done = run_recipe(tmp_path, "--renderer", "qwen3_instruct", "--hf-dataset", f"openai/gsm8k={gsm8k}",
                      "tinker_cookbook.recipes.rl_loop", *COMMON_RL, "batch_size=4", "group_size=4",
                      "max_tokens=16", "max_steps=2", "save_every=0", f"log_path={log}")
    rows = step_rows(log, 2)
    for k, row in enumerate(rows):
        assert row["progress/batch"] == k
        finite(row, "reward/total", "time/total")
    assert done.stderr.count("all advantages zero, skipping training step") == sum(
        row["reward/total"] == 0 for row in rows)
    final_checkpoint(tmp_path, log)


def test_rl_loop_default_loss_is_refused_naming_the_nearest(tmp_path):
    """rl_loop defaults to stable_reinforce: refused before any sampling, naming cispo and importance_sampling."""
    from rlrunbook.testing.data import gsm8k_rows, write_jsonl

    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(4))
    done = run_recipe(tmp_path, "--renderer", "qwen3_instruct", "--hf-dataset",
                      f"openai/gsm8k={gsm8k}", "tinker_cookbook.recipes.rl_loop",
                      "model_name=tiny", "batch_size=2", "group_size=2", "max_steps=1", f"log_path={tmp_path / 'x'}",
                      expect_rc=2)
    assert "stable_reinforce" in done.stderr and "'cispo'" in done.stderr and "'importance_sampling'" in done.stderr


# Preference pairs in Anthropic/hh-rlhf's format (a "chosen" and a "rejected" dialogue), written for this test.
HH_PAIRS = [("What is 2 + 2?", "2 + 2 is 4.", "It is 5."), ("Name a colour.", "Blue is a colour.", "I will not say."),
            ("Say hello.", "Hello!", "No."), ("What is the capital of France?", "Paris.", "London."),
            ("Is water wet?", "Water makes things wet.", "Maybe."), ("Count to three.", "1, 2, 3.", "3, 2."),
            ("What is 3 * 3?", "9.", "6."), ("Spell cat.", "C-A-T.", "K-A-T.")]


def test_dpo_runs_on_forward_backward_custom(tmp_path):
    """The DPO recipe unmodified: its loss is a forward_backward_custom callable. The first step starts at the
    reference (loss ln 2); the second has moved toward the chosen answers."""
    pairs = tmp_path / "hh.jsonl"
    pairs.write_text("".join(json.dumps({"chosen": f"\n\nHuman: {q}\n\nAssistant: {good}",
                                         "rejected": f"\n\nHuman: {q}\n\nAssistant: {bad}"}) + "\n"
                             for q, good, bad in HH_PAIRS))
    log = tmp_path / "dpo"
    run_recipe(tmp_path, "--renderer", "qwen3_instruct", "--hf-dataset", f"Anthropic/hh-rlhf={pairs}",
               "tinker_cookbook.recipes.preference.dpo.train", "model_name=tiny", "dataset=hhh", "batch_size=4",
               "max_length=256", "max_steps=2", f"log_path={log}", "behavior_if_log_dir_exists=delete")
    first, second = step_rows(log, 2)
    for row in (first, second):
        finite(row, "dpo_loss", "margin", "loss:sum")
    assert abs(first["dpo_loss"] - math.log(2)) < 1e-5, first["dpo_loss"]
    assert second["dpo_loss"] < math.log(2) and second["margin"] > 0, second


def test_sl_loop_cross_entropy(tmp_path, conversations):
    log = tmp_path / "sl_loop"
    run_recipe(tmp_path, "--renderer", "qwen3_instruct", "--hf-dataset", f"HuggingFaceH4/no_robots={conversations}",
               "tinker_cookbook.recipes.sl_loop", "model_name=tiny", "lora_rank=8", "batch_size=16",
               "max_length=512", "max_steps=2", "save_every=0", f"log_path={log}")
    for row in step_rows(log, 2):
        finite(row, "loss:sum", "train_mean_nll", "grad_norm:mean", "time_total")
        assert row["train_mean_nll"] > 0
    final_checkpoint(tmp_path, log)


def test_sl_basic_cross_entropy_with_eval(tmp_path, conversations):
    """The library supervised loop, its data set pointed at a local file, evaluated every step."""
    log = tmp_path / "sl_basic"
    common = "dataset_builder.common_config."
    run_recipe(tmp_path, "--renderer", "qwen3_instruct", "tinker_cookbook.recipes.sl_basic", "model_name=tiny",
               "lora_rank=8", "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
               f"dataset_builder.file_path={conversations}", "dataset_builder.test_size=8",
               f"{common}model_name_for_tokenizer=tiny", f"{common}renderer_name=qwen3_instruct",
               f"{common}batch_size=16", f"{common}max_length=512", "max_steps=2", "eval_every=1",
               f"log_path={log}")
    for row in step_rows(log, 2):
        finite(row, "loss:sum", "train_mean_nll", "test/nll", "num_loss_tokens")
        # The backend's summed cross_entropy is the NLL the cookbook computes from the returned logprobs.
        assert row["loss:sum"] == pytest.approx(row["train_mean_nll"] * row["num_loss_tokens"], rel=1e-4)
    final_checkpoint(tmp_path, log)


def test_sl_loop_resume_from_its_checkpoint_is_exact(tmp_path, conversations):
    """Run 4 steps saving state at step 2; a second run resumes from that row of checkpoints.jsonl
    (create_training_client_from_state_with_optimizer) and must reproduce steps 2 and 3."""
    args = ["--renderer", "qwen3_instruct", "--hf-dataset", f"HuggingFaceH4/no_robots={conversations}",
            "tinker_cookbook.recipes.sl_loop", "model_name=tiny", "lora_rank=8", "batch_size=16",
            "max_length=512", "max_steps=4", "save_every=2"]
    first, second = tmp_path / "first", tmp_path / "second"
    run_recipe(tmp_path, *args, f"log_path={first}")
    saved = [json.loads(line) for line in (first / "checkpoints.jsonl").read_text().splitlines()]
    at_two = [row for row in saved if row["name"] == "000002"]
    assert at_two and at_two[0]["batch"] == 2
    second.mkdir()
    (second / "checkpoints.jsonl").write_text(json.dumps(at_two[0]) + "\n")
    done = run_recipe(tmp_path, *args, f"log_path={second}")
    assert "Resuming from batch 2" in done.stderr
    original = step_rows(first, 4)
    resumed = {row["step"]: row for row in map(json.loads, (second / "metrics.jsonl").read_text().splitlines())}
    assert sorted(resumed) == [2, 3]
    for k in (2, 3):  # step 3 depends on AdamW's moments: equal only if the optimizer state was restored
        for key in ("loss:sum", "grad_norm:mean", "train_mean_nll"):
            assert resumed[k][key] == pytest.approx(original[k][key], rel=1e-5), (k, key)


def _warm_start_state(storage: Path, log: Path) -> None:
    """Teach tiny to answer ``\\boxed{4}`` (cross_entropy on varied prompts, through the local backend), save the
    state, and point the recipe's own ``checkpoints.jsonl`` at it: the recipe then resumes from it as it would on
    the service. Measured: the held-out hit rate of ``\\boxed{4}`` reaches about 0.5 after 40 steps."""
    import random

    from tinker import types

    from rlrunbook.backend import LocalServiceClient, LocalSettings
    from rlrunbook.tokens import build_datum_arrays

    rng = random.Random(0)
    words = ["apples", "pears", "boxes", "cars", "miles", "hours", "cents", "tickets", "pages", "eggs", "cups", "dogs"]
    service = LocalServiceClient(LocalSettings(device="cpu", storage_dir=storage))
    try:
        training = service.create_lora_training_client("tiny", rank=8, seed=0)
        tok = training.get_tokenizer()
        answer = tok.encode("\\boxed{4}", add_special_tokens=False) + [tok.eos_token_id]
        for _ in range(40):
            data = []
            for _ in range(16):
                question = " ".join(rng.choice(words) for _ in range(rng.randint(5, 120)))
                prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}],
                                                            add_generation_prompt=True, tokenize=False),
                                    add_special_tokens=False)
                arrays = build_datum_arrays(prompt, answer)
                data.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                                        loss_fn_inputs={"target_tokens": arrays.target_tokens,
                                                        "weights": arrays.weights}))
            training.forward_backward(data, "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=2e-3)).result()
        state = training.save_state("warm").result()
    finally:
        service.close()
    log.mkdir(parents=True)
    (log / "checkpoints.jsonl").write_text(json.dumps({"name": "warm", "batch": 0, "state_path": state.path}) + "\n")


def test_rl_loop_trains_from_a_warm_start_with_finite_losses(tmp_path):
    """The minimal RL loop with real updates: resumed (by its own checkpoints.jsonl) from a tiny that answers
    \\boxed{4} about half the time, on GSM8K-format questions whose answer is 4, so groups have reward spread."""
    log = tmp_path / "rl_loop"
    _warm_start_state(tmp_path / "tinker", log)
    data = tmp_path / "fours.jsonl"
    data.write_text("".join(json.dumps({"question": f"How many {w} are in the basket?",
                                        "answer": f"There are 4 {w}.\n#### 4"}) + "\n"
                            for w in ("apples", "pears", "eggs", "cups", "dogs", "pages", "cars", "boxes")))
    done = run_recipe(tmp_path, "--renderer", "qwen3_instruct", "--hf-dataset", f"openai/gsm8k={data}",
                      "tinker_cookbook.recipes.rl_loop", *COMMON_RL, "batch_size=4", "group_size=4",
                      "max_tokens=16", "max_steps=2", "save_every=0", f"log_path={log}")
    assert "Resuming from batch 0" in done.stderr
    rows = step_rows(log, 2)
    for row in rows:
        finite(row, "loss:sum", "reward/total")
        assert 0 < row["reward/total"] < 1, "rewards must vary for the update to run"
