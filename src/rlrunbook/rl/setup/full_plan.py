"""Full-parameter training's memory on one rank: every weight trains, sharded by FSDP2 over torchrun's ranks.

The policy planned, for ``P`` parameters (tied weights once) over ``W`` ranks (``W`` = 1: a plain process, which
goes through FSDP2 with one rank), with PyTorch's ``fully_shard`` under a ``MixedPrecisionPolicy`` whose
``param_dtype`` is ``backend.dtype`` (the compute dtype, ``c`` bytes) and ``reduce_dtype`` float32:

- resident: float32 master weights ``4 P / W`` and AdamW's two float32 moments ``8 P / W``; with the KL on
  (``loss.kl_coef`` > 0) the reference, a frozen copy of the initial weights in the compute dtype, ``c P / W``;
- training adds the float32 gradients ``4 P / W``; forward and backward gather a decoder layer's weights in the
  compute dtype one layer at a time, and two layers are planned at once (the one computing and the next,
  prefetched), each with its unsharded gradient in the compute dtype while it is reduce-scattered; the root's own
  weights (embeddings, final norm, output layer) stay gathered through a micro-batch's forward and backward:
  ``c (4 layer + root)``; and one micro-batch's activations, traced with every weight trainable
  (:func:`rlrunbook.backend.memory.drop_gradients`);
- sampling (the in-process engine) reads every weight gathered in the compute dtype, a whole copy ``c P`` on
  every rank, freed before training; a rank samples and trains its ``num_groups / W`` groups, so its KV cache,
  prefix pool and training batch are those of ``1 / W`` of the step.

A rank's shard of a parameter is its dim 0 split into ``W`` equal parts, the last padded (FSDP2's layout), so its
share is exactly ``P / W`` where ``W`` divides every parameter's first dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlrunbook.rl.setup.config import TrainConfig

GIB = 1 << 30
GATHERED_LAYERS = 2  # the layer computing and the next, prefetched


@dataclass(frozen=True)
class FullShards:
    """One rank's bytes of full training over ``world_size`` ranks (see the module docstring)."""

    world_size: int
    parameters: int  # P, tied weights once
    dtype: str  # the compute dtype's name
    groups: int  # the step's question groups
    rank_groups: int  # those one rank samples and trains
    master: int  # float32 weights, sharded
    gradients: int  # float32, sharded; held while training
    optimizer: int  # AdamW's two float32 moments, sharded
    reference: int  # the KL reference in the compute dtype, sharded (0 with the KL off)
    gathered: int  # while training: two layers' weights and gradients and the root's weights, compute dtype
    sampling_copy: int  # while sampling: every weight gathered in the compute dtype

    @property
    def state(self) -> int:
        """Master weights, gradients and AdamW's moments: 16 bytes per parameter, over the ranks."""
        return self.master + self.gradients + self.optimizer


def shard_elements(model: torch.nn.Module, world_size: int) -> tuple[int, int]:
    """``(P, the most elements one of world_size ranks holds)`` of ``model``'s parameters (tied ones once), each
    parameter's dim 0 split into ``world_size`` parts as FSDP2 splits it."""
    total = per_rank = 0
    for param in model.parameters():  # a tied weight is one parameter, yielded once
        rows = param.shape[0] if param.dim() else 1
        total += param.numel()
        per_rank += -(-rows // world_size) * (param.numel() // rows)
    return total, per_rank


def full_shards(model: torch.nn.Module, dtype: torch.dtype, world_size: int, *, reference: bool, groups: int
                ) -> FullShards:
    """The per-rank parts of training every weight of ``model`` (a meta skeleton, :func:`skeleton` with no LoRA
    rank) in ``dtype`` over ``world_size`` ranks; ``reference``: the KL is on; ``groups``: the step's groups."""
    total, shard = shard_elements(model, world_size)
    layers = model.get_decoder().layers
    layer = sum(param.numel() for param in layers[0].parameters())
    root = total - len(layers) * layer
    size = dtype.itemsize
    return FullShards(
        world_size=world_size, parameters=total, dtype=str(dtype).removeprefix("torch."), groups=groups,
        rank_groups=-(-groups // world_size), master=4 * shard, gradients=4 * shard, optimizer=8 * shard,
        reference=size * shard if reference else 0, gathered=size * (2 * GATHERED_LAYERS * layer + root),
        sampling_copy=size * total)


def rank_share(config: TrainConfig, world_size: int) -> TrainConfig:
    """``config`` as one of ``world_size`` ranks samples and trains it: its ``num_groups / W`` groups (rounded
    up; a launch whose ranks cannot share the groups evenly is refused when it starts) of the same size."""
    groups = -(-config.num_groups // world_size)
    return config.replace(num_groups=groups, num_rollouts=groups * config.group_size)


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def header_lines(shards: FullShards) -> list[str]:
    """What is sharded how, and the resident part of one rank."""
    w = shards.world_size
    launch = "one process" if w == 1 else f"torchrun --nproc-per-node {w}"
    reference = f", reference ({shards.dtype}) {_gib(shards.reference)}" if shards.reference else ""
    return [f"full fine-tune: {shards.parameters:,} parameters sharded by FSDP2 over W = {w} ({launch}); each rank "
            f"holds 1/W of the state and samples and trains {shards.rank_groups} of the step's {shards.groups} groups",
            f"resident per rank: master weights (float32) {_gib(shards.master)}, AdamW moments (float32) "
            f"{_gib(shards.optimizer)}{reference}"]


def sampling_part(shards: FullShards) -> str:
    return f"every weight gathered ({shards.dtype}) {_gib(shards.sampling_copy)}, "


def training_part(shards: FullShards) -> str:
    return (f"gradients (float32) {_gib(shards.gradients)}, gathered ({GATHERED_LAYERS} layers' weights and "
            f"gradients, embeddings, norm and output layer; {shards.dtype}) {_gib(shards.gathered)}")


def consumers(shards: FullShards, *, kv_cache: int, prefix_pool: int, activations: int,
              vllm_share: int) -> dict[str, tuple[int, str]]:
    """The parts of a full-training plan that may not fit (the rank's ``shards`` and the plan's other parts, in
    bytes), each with the knob that shrinks it."""
    more_ranks = "more ranks (torchrun --nproc-per-node N: each holds 1/N of it)"
    return {
        "the decode KV cache": (kv_cache, "more ranks (torchrun --nproc-per-node N: each samples 1/N of the "
                                               "groups), fewer rows per sampling call (-n, or "
                                               "TINKER_LOCAL_MAX_BATCH_ROWS) or shorter sequences (--max-tokens, "
                                               "data.max_prompt_tokens)"),
        "the prefix pool": (prefix_pool, "a smaller TINKER_LOCAL_PREFIX_CACHE_TOKENS, or more ranks "
                                              "(torchrun --nproc-per-node N)"),
        "the sharded training state (float32 master weights, gradients, AdamW moments)": (
            shards.state, f"{more_ranks}, or finetune=lora"),
        "the KL reference": (shards.reference, f"{more_ranks}, or loss.kl_coef=0"),
        "every weight gathered for sampling": (shards.sampling_copy, "finetune=lora, or a smaller model"),
        "the layers gathered for training": (shards.gathered, "finetune=lora, or a smaller model"),
        "a micro-batch's activations": (activations, "a smaller backend.micro_batch_tokens, or "
                                                                   "backend.activation_checkpointing=on"),
        "the vLLM server's share": (vllm_share, "a smaller TINKER_LOCAL_VLLM_GPU_MEMORY_UTILIZATION"),
    }
