"""The memory plan: predicted against measured, the shipped GPU preset planned on an 80 GB GPU, refusals that
name the knob, and the backend's micro-batch knobs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlrunbook.backend.settings import LocalSettings
from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.memory_plan import GIB, MemoryPlan, check_fits, format_plan, parse_size
from rlrunbook.testing.commands import installed_rlrunbook

HERE = Path(__file__).resolve().parents[2]  # tests/unit, where memory_probe.py lives
ROOT = HERE.parents[1]


def _rlrunbook() -> str:
    return installed_rlrunbook()


@pytest.mark.slow
def test_the_plan_is_within_20_percent_of_the_measured_peak():
    """A Qwen2.5-1.5B-shaped model (its published config values) with 2 layers and random weights, one datum of
    2,048 tokens (256 trained), fp32 on CPU: the traced plan against the process's resident peak."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # buffers go back to the OS: RSS follows tensors
    env.pop("MALLOC_MMAP_MAX_", None)
    done = subprocess.run([sys.executable, str(HERE / "memory_probe.py"), "2", "2048", "256", "1"], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    measured, planned = figures["measured"], figures["planned"]
    assert measured > 300 * (1 << 20), figures  # the pass really held hundreds of MB
    assert abs(planned - measured) <= 0.2 * measured, figures


@pytest.mark.slow
def test_the_rlvr_preset_fits_an_80gb_gpu_and_not_a_24gb_one():
    """`show-config --config-file h100-rlvr --device-memory 80GiB`, as a user types it: a plan that fits, with
    the sampling and training peaks, and the micro-batches that make training fit; on 24 GiB it does not fit."""
    done = subprocess.run([_rlrunbook(), "show-config", "--config-file", "h100-rlvr", "--device-memory", "80GiB"],
                          capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any("device: cuda (80.0 GiB, stated)" in line for line in lines)
    assert any(line.startswith("#   sampling: 256 rows per sampling call") for line in lines)
    (training,) = [line for line in lines if line.startswith("#   training: ")]
    count = re.search(r"in (\d+) micro-batch\(es\) of \d+ tokens", training)
    assert count and int(count.group(1)) >= 16 and "no limit" not in training, training  # grad_accum_steps 16
    assert any(line.startswith("#   fits: ") for line in lines)
    small = subprocess.run([_rlrunbook(), "show-config", "--config-file", "h100-rlvr", "--device-memory", "24GiB"],
                           capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert small.returncode == 1 and "DOES NOT FIT" in small.stdout, small.stdout + small.stderr


@pytest.mark.slow
def test_train_refuses_a_run_that_cannot_fit_before_loading_and_names_the_knob(tmp_path, tiny_folder):
    """256 rows of 60k tokens: the KV cache alone is far beyond this machine; refused (exit 2) with the largest
    part and its knob, before a model loads and before a run directory exists."""
    done = subprocess.run([_rlrunbook(), "train", "--model", "tiny", "-n", "256", "--num-groups", "64",
                           "--max-tokens", "600000", "--log-root", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "does not fit" in done.stderr and "the decode KV cache" in done.stderr
    assert "--max-tokens" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "logs").exists()


def _plan(**sizes) -> MemoryPlan:
    values = dict(device="cuda (80.0 GiB, stated)", total=80 * GIB, model="m", sampler="hf", weights=3 * GIB,
                  training_state=4 * GIB, float64_copy=0, kv_cache=20 * GIB, prefix_pool=2 * GIB,
                  sampling_activations=2 * GIB, vllm_share=0, micro_batch_tokens=10000, recompute_layers=False,
                  training_activations=40 * GIB, batch_tokens=45000, shape="s")
    values.update(sizes)
    return MemoryPlan(**values)


def test_the_micro_batch_count_counts_the_chunks_first():
    """forward_backward cuts a batch into grad_accum_steps parts by count, then each part by the token budget
    (backend/micro_batches.py): 45,000 tokens under a budget of 10,000 are 5 micro-batches; in 4 chunks of
    11,250 tokens, 2 each, 8; in 16 chunks of 2,813, 1 each, 16; no budget: one per chunk."""
    assert _plan().micro_batches == 5
    assert _plan(chunks=4).micro_batches == 8
    assert _plan(chunks=16).micro_batches == 16
    assert _plan(chunks=3, micro_batch_tokens=None).micro_batches == 3
    assert _plan(micro_batch_tokens=None).micro_batches == 1


def test_peaks_add_up_as_stated():
    plan = _plan()
    # resident: weights 3 + adapter and moments 3 + KV 20 + pool 2 = 28; sampling adds 2, training 1 + 40.
    assert plan.resident == 28 * GIB and plan.sampling_peak == 30 * GIB and plan.training_peak == 69 * GIB
    assert plan.usable == 72 * GIB and plan.fits and plan.micro_batches == 5
    assert format_plan(plan)[-1].startswith("fits: peak 69.00 GiB of 72.00 GiB usable")


def test_an_asynchronous_run_plans_both_phases_at_once():
    # off_policy 2: training 69 + sampling activations 2 + (2 + 2) adapter copies of 1 GiB = 75 > 72 usable.
    plan = _plan(concurrent_snapshots=4)
    assert plan.peak == 75 * GIB and not plan.fits
    assert format_plan(plan)[-1].startswith("DOES NOT FIT: peak 75.00 GiB of 72.00 GiB usable (sampling and training")
    assert _plan().peak == 69 * GIB, "synchronous: the larger phase alone"


def test_a_plan_that_does_not_fit_names_its_largest_part_and_the_knob():
    with pytest.raises(ConfigError, match=r"largest part is the decode KV cache \(60.0 GiB\).*--max-tokens"):
        check_fits(_plan(kv_cache=60 * GIB))
    with pytest.raises(ConfigError, match=r"a micro-batch's activations .*micro_batch_tokens"):
        check_fits(_plan(training_activations=70 * GIB))
    check_fits(_plan())  # fits: nothing raised


@pytest.mark.parametrize(("text", "size"), [("80GiB", 80 * GIB), ("80GB", 80 * GIB), ("24 GiB", 24 * GIB),
                                            ("512MiB", 512 << 20), ("1.5G", int(1.5 * GIB)), ("4096", 4096)])
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "eighty", "80XB", "0GiB", "-1GiB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ConfigError, match="80GiB"):
        parse_size(text)


def test_micro_batch_knobs_from_the_environment():
    assert LocalSettings.from_env({}).micro_batch_tokens is None  # auto
    assert LocalSettings.from_env({"TINKER_LOCAL_MICRO_BATCH_TOKENS": "auto"}).micro_batch_tokens is None
    assert LocalSettings.from_env({"TINKER_LOCAL_MICRO_BATCH_TOKENS": "20000"}).micro_batch_tokens == 20000
    assert LocalSettings.from_env({"TINKER_LOCAL_MICRO_BATCH_TOKENS": "0"}).micro_batch_tokens == 0  # no limit
    assert LocalSettings.from_env({"TINKER_LOCAL_ACTIVATION_CHECKPOINTING": "on"}).activation_checkpointing == "on"
    with pytest.raises(ConfigError, match="TINKER_LOCAL_MICRO_BATCH_TOKENS"):
        LocalSettings.from_env({"TINKER_LOCAL_MICRO_BATCH_TOKENS": "lots"})
    with pytest.raises(ConfigError, match="TINKER_LOCAL_ACTIVATION_CHECKPOINTING"):
        LocalSettings.from_env({"TINKER_LOCAL_ACTIVATION_CHECKPOINTING": "sometimes"})


def test_the_backend_derives_a_budget_for_the_model_it_loaded(local_service):
    """A training client made without a stated budget splits its batches by one derived from this machine's
    memory and the model's traced per-token cost (tiny: far more tokens than a test batch)."""
    training = local_service.create_lora_training_client("tiny", rank=4)
    trainer = training._trainer
    assert trainer.micro_batch_tokens is not None and trainer.micro_batch_tokens >= 4096
    assert trainer.micro_batch_tokens % 256 == 0 and trainer.recompute_layers is False
    assert torch.device(local_service.settings.device).type == "cpu"


# --- models whose config states each layer's attention (layer_types) --------------------------------------------

FULL, SLIDING = "full_attention", "sliding_attention"


def _model_folder(root: Path, tiny_folder: Path, kind: str, layer_types: list[str]) -> str:
    """``tiny``'s tokenizer beside a Qwen2 or Qwen3 model with these layers and random weights."""
    import shutil

    import transformers

    folder = root / f"{kind}-{'-'.join(layer_types)}"
    shutil.copytree(tiny_folder, folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    tiny = json.loads((tiny_folder / "config.json").read_text())
    sliding = SLIDING in layer_types
    config_class = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[kind]
    config = config_class(
        **{k: tiny[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "bos_token_id", "eos_token_id", "pad_token_id")},
        num_hidden_layers=len(layer_types), layer_types=list(layer_types), use_sliding_window=sliding,
        sliding_window=16 if sliding else None, max_position_embeddings=2048, tie_word_embeddings=False,
        **({"head_dim": 16} if kind == "qwen3" else {}))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(("kind", "layer_types"), [
    ("qwen2", [FULL]), ("qwen3", [FULL, FULL]), ("qwen2", [FULL, FULL, FULL]),
    ("qwen2", [SLIDING]), ("qwen3", [SLIDING, FULL]), ("qwen2", [FULL, SLIDING, FULL]),
], ids=lambda value: value if isinstance(value, str) else "-".join(t.split("_")[0] for t in value))
def test_any_layer_count_and_pattern_is_planned(tmp_path, tiny_folder, capsys, monkeypatch, kind, layer_types):
    """``show-config --memory-plan`` of 1, 2 and 3-layer models, full and sliding attention mixed: full-attention
    models get a traced plan; sliding ones (which the trainer runs through transformers' padded forward, with
    ``TINKER_LOCAL_SAMPLER=generate``) a plan that says their activations are not planned. Never a traceback."""
    from rlrunbook import cli

    folder = _model_folder(tmp_path, tiny_folder, kind, layer_types)
    sliding = SLIDING in layer_types
    monkeypatch.setenv("TINKER_LOCAL_SAMPLER", "generate" if sliding else "hf")
    assert cli.main(["show-config", "--model", folder, "--memory-plan"]) == 0
    out = capsys.readouterr().out
    (training,) = [line for line in out.splitlines() if line.startswith("#   training: ")]
    if sliding:
        assert "training runs transformers' forward over padded datums (sliding-window attention" in out
    else:
        assert "micro-batch(es) of" in training and "no limit" not in training and "padded" not in out


def test_kept_products_are_planned_per_token_and_held_through_both_phases():
    """A token keeps every layer's q, k, v, o, gate, up and down outputs (engines/kept_products.py) and the logits it
    was drawn from: SmolLM2-135M, 30 layers x ((9 + 2 x 3) heads x 64 + 2 x 576 + 2 x 1,536) = 30 x 5,184 values,
    622,080 bytes in float32 (311,040 in bfloat16), and 49,152 float32 logits, 196,608 bytes."""
    from rlrunbook.models.shapes import model_shape
    from rlrunbook.rl.setup.memory_plan import kept_row_bytes

    shape, _ = model_shape("smollm2-135m")
    assert kept_row_bytes(shape, torch.float32) == 622_080 + 196_608
    assert kept_row_bytes(shape, torch.bfloat16) == 311_040 + 196_608
    plan = _plan(kept_products=2 * GIB)
    assert plan.resident == 30 * GIB and plan.sampling_peak == 32 * GIB and plan.training_peak == 71 * GIB
    with pytest.raises(ConfigError, match=r"largest part is the kept products \(50.0 GiB\).*KEPT_PRODUCTS_MB"):
        check_fits(_plan(kept_products=50 * GIB))


def _smollm2_plan(**backend) -> MemoryPlan:
    from rlrunbook.rl.setup.config_sources import build_config
    from rlrunbook.rl.setup.memory_plan import plan_memory

    overrides = ["backend.device=cpu", "data.max_prompt_tokens=128"] + [f"backend.{k}={v}" for k, v in backend.items()]
    run = {"model": "smollm2-135m", "num_rollouts": 4, "num_groups": 1, "max_tokens": 16}
    config = build_config(overrides=overrides, cli=run).config
    return plan_memory(config, parse_size("32GiB"))


def test_coded_weights_are_planned_at_two_bytes_a_value_where_the_engine_codes_them(monkeypatch):
    """The CPU engine may keep a short exact form of each frozen float32 matrix-product weight (kernels/
    coded_weights.py), 2 bytes a value at most: SmolLM2-135M's 30 layers x (576 x (576 + 2 x 192 + 576) + 3 x 576 x
    1,536) = 106,168,320 values and its output layer (tied to the embedding: one tensor) 49,152 x 576 = 28,311,552."""
    plan = _smollm2_plan()
    assert plan.coded_weights == 2 * (106_168_320 + 28_311_552)
    assert any("coded weights <= 0.25 GiB" in line for line in format_plan(plan))
    monkeypatch.setenv("TINKER_LOCAL_CODED_WEIGHTS", "0")
    off = _smollm2_plan()
    assert off.coded_weights == 0 and off.resident == plan.resident - plan.coded_weights
    monkeypatch.delenv("TINKER_LOCAL_CODED_WEIGHTS")
    assert _smollm2_plan(dtype="bfloat16").coded_weights == 0  # only float32 weights are coded
    with pytest.raises(ConfigError, match=r"largest part is the coded weights \(50.0 GiB\).*CODED_WEIGHTS=0"):
        check_fits(_plan(coded_weights=50 * GIB))
