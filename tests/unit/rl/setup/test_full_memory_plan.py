"""The memory plan of full-parameter training (``finetune: full``): one rank's sharded state derived by hand from
the parameter count, the rank's share of the step, refusals naming the knob, LoRA plans untouched by the world
size, and ``show-config --world-size`` as a user types it."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlrunbook.backend import memory
from rlrunbook.errors import ConfigError
from rlrunbook.models.shapes import model_shape
from rlrunbook.rl.setup.config_sources import build_config
from rlrunbook.rl.setup.full_plan import FullShards, full_shards
from rlrunbook.rl.setup.memory_plan import GIB, MemoryPlan, check_fits, format_plan, parse_size, plan_memory
from rlrunbook.testing.commands import installed_rlrunbook

ROOT = Path(__file__).resolve().parents[4]

# Qwen2.5-Math-1.5B's published shape (models/shapes.py): E 1,536, F 8,960, 28 layers, 12 query and 2 key/value
# heads of 128, vocabulary 151,936, tied embeddings. One decoder layer:
#   q_proj 1536 x 1536 + bias 1536, k_proj and v_proj 256 x 1536 + bias 256 each, o_proj 1536 x 1536 (no bias)
#     = 2,359,296 + 1,536 + 2 x (393,216 + 256) + 2,359,296                       =  5,507,072
#   gate, up, down: 3 x 8960 x 1536                                              = 41,287,680
#   two RMSNorms: 2 x 1536                                                       =      3,072
LAYER = 46_797_824
ROOT_PARAMS = 151_936 * 1536 + 1536  # embeddings (the output layer is the same tensor) and the final norm
P = 28 * LAYER + ROOT_PARAMS  # 1,543,714,304
assert P == 1_543_714_304


@pytest.fixture(scope="module")
def qwen_full():
    """The 1.5B model on the meta device with every weight trainable (no storage, built in about a second)."""
    shape, _ = model_shape("Qwen/Qwen2.5-Math-1.5B")
    return memory.skeleton(shape, torch.bfloat16, None)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_sharded_state_of_a_published_shape_by_hand(qwen_full, world):
    """Every first dimension (1,536, 256, 8,960, 151,936) divides by 1, 2 and 4, so a rank holds exactly P / W of
    each float32 part, and of the bf16 reference; sampling gathers all P in bf16 on every rank; training gathers
    two layers' weights and gradients and the root's weights in bf16, whatever W."""
    shards = full_shards(qwen_full, torch.bfloat16, world, reference=True, groups=64)
    assert shards.parameters == P
    assert shards.master == 4 * P // world  # W=1: 6,174,857,216 bytes (5.75 GiB); W=4: 1,543,714,304
    assert shards.gradients == 4 * P // world
    assert shards.optimizer == 8 * P // world  # AdamW's exp_avg and exp_avg_sq in float32
    assert shards.reference == 2 * P // world
    assert shards.state == 16 * P // world
    assert shards.sampling_copy == 2 * P  # 3,087,428,608 bytes: the whole model in bf16
    assert shards.gathered == 2 * (2 * 2 * LAYER + ROOT_PARAMS) == 841_133_056  # 0.78 GiB
    assert (shards.groups, shards.rank_groups) == (64, 64 // world)
    assert full_shards(qwen_full, torch.bfloat16, world, reference=False, groups=64).reference == 0  # KL off


def test_four_ranks_hold_at_most_three_tenths_of_one_ranks_state(qwen_full):
    one, four = (full_shards(qwen_full, torch.bfloat16, w, reference=True, groups=64) for w in (1, 4))
    assert four.state + four.reference <= 0.3 * (one.state + one.reference)


# The built-in tiny model (Qwen2, E 64, F 128, 2 layers, 4 query and 2 key/value heads of 16, vocabulary 719,
# untied): a layer is q 64x64+64, k and v 32x64+32 each, o 64x64, MLP 3x128x64, two norms of 64 = 37,120; the
# root is embeddings and output layer 719x64 each and the final norm 64 = 92,096; P = 2 x 37,120 + 92,096.
TINY_LAYER, TINY_ROOT = 37_120, 92_096
TINY_P = 2 * TINY_LAYER + TINY_ROOT  # 166,336
# FSDP2 splits each parameter's dim 0 and pads the last part: 719 rows are 360 per rank over 2, 180 over 4, so a
# rank holds a little more than P / W: the layers and norms split exactly, the two 719 x 64 tensors do not.
TINY_SHARD = {1: TINY_P, 2: 2 * TINY_LAYER // 2 + 32 + 2 * 360 * 64, 4: 2 * TINY_LAYER // 4 + 16 + 2 * 180 * 64}


def _tiny(finetune: str = "full", **cli):
    """A run of the tiny model planned as if on an 80 GiB CPU machine in float32, 4 groups of 4, KL on."""
    extra = {"lora_rank": 8} if finetune == "lora" else {}
    values = dict(model="tiny", finetune=finetune, num_rollouts=16, num_groups=4, max_tokens=64, **extra, **cli)
    return build_config(overrides=["backend.device=cpu", "backend.dtype=float32", "loss.kl_coef=0.01",
                                   "data.max_prompt_tokens=128"], cli=values).config


@pytest.fixture(scope="module")
def tiny_plans(tiny_folder):
    return {world: plan_memory(_tiny(), parse_size("80GiB"), world_size=world) for world in (1, 2, 4)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_full_plan_holds_one_ranks_shards_and_its_share_of_the_step(tiny_plans, world):
    plan, one = tiny_plans[world], tiny_plans[1]
    shard = TINY_SHARD[world]
    assert plan.full.parameters == TINY_P and plan.full.master == 4 * shard
    assert plan.training_state == 16 * shard and plan.gradient == 4 * shard
    assert plan.weights == 4 * shard and plan.float64_copy == 0  # the float32 reference's shard
    assert plan.full.sampling_copy == 4 * TINY_P and plan.snapshot == 4 * TINY_P
    assert plan.full.gathered == 4 * (2 * 2 * TINY_LAYER + TINY_ROOT)
    # 4 groups over W ranks: the rows of a sampling call, hence the KV cache, and the trained tokens are 1/W.
    assert plan.shape.startswith(f"{16 // world} rows per sampling call")
    assert plan.kv_cache * world == one.kv_cache and plan.batch_tokens * world == one.batch_tokens
    # The phases: the resident shards (master, moments, reference) and caches, then what each phase adds.
    resident = 12 * shard + 4 * shard + plan.kv_cache + plan.prefix_pool
    assert plan.resident == resident
    assert plan.sampling_peak == resident + plan.full.sampling_copy + plan.sampling_activations
    assert plan.training_peak == resident + 4 * shard + plan.full.gathered + plan.training_activations


def test_a_full_plan_states_its_parts_and_world_size(tiny_plans):
    lines = format_plan(tiny_plans[2])
    assert lines[1] == (f"full fine-tune: {TINY_P:,} parameters sharded by FSDP2 over W = 2 (torchrun "
                        "--nproc-per-node 2); each rank holds 1/W of the state and samples and trains 2 of the step's "
                        "4 groups")
    shard = 4 * TINY_SHARD[2] / GIB
    assert lines[2] == (f"resident per rank: master weights (float32) {shard:.2f} GiB, AdamW moments (float32) "
                        f"{2 * shard:.2f} GiB, reference (float32) {shard:.2f} GiB")
    assert "; every weight gathered (float32) 0.00 GiB, KV cache" in lines[3]
    assert "; gradients (float32) 0.00 GiB, gathered (2 layers' weights and gradients" in lines[4]


def test_a_lora_plan_does_not_depend_on_the_world_size(tiny_folder):
    """LoRA keeps every weight on every rank, planned as before: the same plan whatever the world size."""
    config = _tiny("lora")
    one, four = (plan_memory(config, parse_size("80GiB"), world_size=world) for world in (1, 4))
    assert one == four and one.full is None
    assert format_plan(one)[1].startswith("resident: weights ")
    with pytest.raises(ConfigError, match="world size 0 must be at least 1"):
        plan_memory(config, parse_size("80GiB"), world_size=0)


def _full_plan(**sizes) -> MemoryPlan:
    """A full plan on one of 2 ranks: 8 GiB of state (2 master, 2 gradients, 4 moments), 1 GiB of reference."""
    shards = FullShards(world_size=2, parameters=1 << 30, dtype="bfloat16", groups=64, rank_groups=32,
                        master=2 * GIB, gradients=2 * GIB, optimizer=4 * GIB, reference=GIB, gathered=GIB,
                        sampling_copy=2 * GIB)
    values = dict(device="cuda (80.0 GiB, stated)", total=80 * GIB, model="m", sampler="hf", weights=GIB,
                  training_state=8 * GIB, float64_copy=0, kv_cache=20 * GIB, prefix_pool=2 * GIB,
                  sampling_activations=2 * GIB, vllm_share=0, micro_batch_tokens=10000, recompute_layers=True,
                  training_activations=30 * GIB, batch_tokens=45000, shape="s", full=shards)
    values.update(sizes)
    return MemoryPlan(**values)


def test_full_peaks_add_up_as_stated():
    plan = _full_plan()
    # resident: reference 1 + master and moments 6 + KV 20 + pool 2 = 29; sampling adds the gathered copy 2 and
    # activations 2; training the gradients 2, the gathered layers 1 and activations 30.
    assert plan.resident == 29 * GIB and plan.sampling_peak == 33 * GIB and plan.training_peak == 62 * GIB
    assert plan.fits and plan.peak == 62 * GIB
    # off_policy 1: 3 copies of the gathered weights while training.
    assert replace(plan, concurrent_snapshots=3).peak == (62 + 2 + 3 * 2) * GIB


@pytest.mark.parametrize(("sizes", "match"), [
    (dict(master=20 * GIB, gradients=20 * GIB, optimizer=40 * GIB),
     r"with 2 rank\(s\).*largest part is the sharded training state .* Fix: more ranks \(torchrun --nproc-per-node "
     r"N: each holds 1/N of it\), or finetune=lora\..*--world-size 2"),
    (dict(reference=60 * GIB), r"the KL reference \(60.0 GiB\)\. Fix: more ranks .*or loss.kl_coef=0"),
    (dict(sampling_copy=60 * GIB), r"every weight gathered for sampling .*Fix: finetune=lora"),
])
def test_a_full_plan_that_does_not_fit_names_the_knob(sizes, match):
    shards = replace(_full_plan().full, **sizes)
    plan = _full_plan(full=shards, training_state=shards.state, weights=shards.reference)
    with pytest.raises(ConfigError, match=match):
        check_fits(plan)


def test_a_full_plan_with_too_many_tokens_names_the_micro_batch_and_the_kv_cache_more_ranks():
    with pytest.raises(ConfigError, match=r"a micro-batch's activations .*backend.micro_batch_tokens"):
        check_fits(_full_plan(training_activations=70 * GIB))
    with pytest.raises(ConfigError, match=r"the decode KV cache .*Fix: more ranks \(torchrun --nproc-per-node N: "
                                          r"each samples 1/N of the groups\)"):
        check_fits(_full_plan(kv_cache=60 * GIB))
    check_fits(_full_plan())  # fits: nothing raised


def test_the_full_trace_holds_activations_not_the_weights_gradients():
    """Each weight's gradient is dropped as it lands (FSDP2 reduce-scatters it away; the plan counts the float32
    shard): the traced fixed part of the 1.5B shape stays far below one bf16 copy of its 2.9 GiB of weights (0.93 GiB
    on 2026-11-29, with the per-token part at 176 KiB)."""
    shape, _ = model_shape("Qwen/Qwen2.5-Math-1.5B")
    cost = memory.token_cost(shape, torch.bfloat16, None, "invariant", recompute_layers=True, device_type="cuda")
    assert cost.fixed < 1.5 * GIB and cost.per_token > 0


def test_a_run_under_torchrun_is_planned_for_one_of_its_ranks(monkeypatch, tmp_path, tiny_folder):
    """``train`` under torchrun (WORLD_SIZE 2) plans a full fine-tune for one rank: half the state, 2 of 4 groups."""
    from rlrunbook.rl.setup.config import TrainConfig
    from rlrunbook.rl.training.plan import plan_run

    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TINKER_BACKEND", "local")
    config = TrainConfig(env="qa", dataset="test", num_rollouts=8, num_groups=4, model="tiny", finetune="full",
                         log_root=str(tmp_path / "logs"))
    full = plan_run(config).memory.full
    assert (full.world_size, full.rank_groups, full.parameters) == (2, 2, TINY_P)
    assert not (tmp_path / "logs").exists()


def test_show_config_plans_for_the_flags_world_size_then_torchrun_s():
    from argparse import Namespace

    from rlrunbook.cli.train import world_size

    assert world_size(Namespace(world_size=4), {"WORLD_SIZE": "2"}) == 4
    unset = Namespace(world_size=None)
    assert world_size(unset, {"WORLD_SIZE": "2"}) == 2
    assert world_size(unset, {"WORLD_SIZE": " "}) == world_size(unset, {}) == 1
    for bad in ("two", "0"):
        with pytest.raises(ConfigError, match=f"WORLD_SIZE='{bad}' is not a world size.*--world-size N"):
            world_size(unset, {"WORLD_SIZE": bad})


# --- as a user types it ---------------------------------------------------------------------------------------

def _show(*arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "WORLD_SIZE"}
    return subprocess.run([installed_rlrunbook(), "show-config", "--config-file", "h100-rlvr-full",
                           "--device-memory", "80GiB", *arguments], env={**environment, **(env or {})},
                          capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)


def _part(lines: list[str], label: str) -> float:
    """The GiB figure after ``label`` in the plan's lines."""
    (line,) = [line for line in lines if label in line]
    return float(line.split(label, 1)[1].split(" GiB", 1)[0])


@pytest.mark.slow
def test_the_full_preset_fits_one_h100_and_its_per_rank_state_shrinks_with_ranks():
    """`show-config --config-file h100-rlvr-full --device-memory 80GiB`, then with 2 ranks (WORLD_SIZE, as torchrun
    sets it) and 4 (--world-size): every plan fits, and each rank's master weights are 1/W of one process's."""
    masters = {}
    for world, arguments, env in ((1, (), None), (2, (), {"WORLD_SIZE": "2"}), (4, ("--world-size", "4"), None)):
        done = _show(*arguments, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert any(f"sharded by FSDP2 over W = {world} " in line for line in lines), done.stdout
        assert any(line.startswith("#   fits: ") for line in lines) and "error" not in done.stderr
        masters[world] = _part(lines, "master weights (float32) ")
    assert masters[1] == 5.75 and masters[2] == 2.88 and masters[4] == 1.44  # 4 x 1,543,714,304 bytes / W


@pytest.mark.slow
def test_show_config_refuses_a_full_8b_on_one_card_naming_the_knob():
    done = _show("model=meta-llama/Llama-3.1-8B-Instruct")
    assert done.returncode == 1 and "DOES NOT FIT" in done.stdout, done.stdout + done.stderr
    assert "largest part is the sharded training state" in done.stderr
    assert "torchrun --nproc-per-node N" in done.stderr and "finetune=lora" in done.stderr
    assert "Traceback" not in done.stderr
