"""Data parallelism under ``torchrun``: the launch layout, the process group, and the few collectives used.

``torchrun --nproc_per_node=N -m rlrunbook train ...`` starts N processes and tells each its place
through the environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
This module reads that once (:func:`launch_layout`), joins the process group once (:func:`init`),
and offers the collectives the trainer and the loop need. Without torchrun, or with
``WORLD_SIZE=1``, every helper is a no-op and ``torch.distributed`` is never initialised.

Sharding is contiguous: with G items and W ranks, rank r gets items ``[r*G/W, (r+1)*G/W)``. Then
the ranks' shards concatenated in rank order are the single-process list in its own order, so a
gathered result needs no re-interleaving. The loop shards *group* indices, never single rollouts,
so GRPO's group centring always sees a whole group inside one process.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rlrunbook.errors import ConfigError

T = TypeVar("T")

REQUIRED_ENV = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Layout:
    """Where this process sits in a torchrun launch (``world_size`` 1: a plain single process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer: start the run with torchrun, "
                          "which sets it, or unset WORLD_SIZE for a single process.") from None


def launch_layout(env: Mapping[str, str] = os.environ) -> Layout:
    """The layout torchrun declared in ``env``, or the single-process layout when it declared none.

    ``WORLD_SIZE`` > 1 with any of ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``
    missing, or a rank outside ``[0, WORLD_SIZE)``, is a ``ConfigError``: a half-set environment
    would otherwise hang at the rendezvous.
    """
    if not env.get("WORLD_SIZE"):
        return Layout()
    world = _int_var(env, "WORLD_SIZE")
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be >= 1: launch with torchrun --nproc_per_node=N.")
    if world == 1:
        return Layout()
    missing = [name for name in REQUIRED_ENV if not env.get(name)]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} but {missing} unset: launch data-parallel runs with "
                          f"torchrun --nproc_per_node={world} -m rlrunbook ..., which sets them all.")
    rank, local_rank = _int_var(env, "RANK"), _int_var(env, "LOCAL_RANK")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world}): the launcher's environment is "
                          "inconsistent; start the run with torchrun.")
    return Layout(rank=rank, world_size=world, local_rank=local_rank)


def backend_for(device: str | torch.device) -> str:
    """The process-group backend: gloo for CPU tensors; on CUDA, nccl for CUDA tensors and gloo
    beside it for the CPU tensors that object collectives and CPU-side metrics use."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def init(layout: Layout | None = None, device: str | torch.device | None = None) -> Layout:
    """Join the process group once (later calls only return the layout); a no-op for one process.

    ``device`` defaults to CUDA when it is available, as the local backend's does; on CUDA each
    process takes the GPU ``LOCAL_RANK``. ``destroy_process_group`` is registered to run at exit.
    """
    layout = launch_layout() if layout is None else layout
    if layout.world_size == 1 or is_initialized():
        return layout
    import torch.distributed as dist

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if layout.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={layout.local_rank} but this machine has {torch.cuda.device_count()} "
                              "GPU(s): use --nproc_per_node <= the number of GPUs (one process per GPU).")
        torch.cuda.set_device(layout.local_rank)
    dist.init_process_group(backend=backend_for(device), rank=layout.rank, world_size=layout.world_size)
    atexit.register(shutdown)
    return layout


def is_initialized() -> bool:
    """Whether this process joined a process group (never true without torchrun)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def shutdown() -> None:
    """Leave the process group, if joined (registered with ``atexit`` by :func:`init`)."""
    if is_initialized():
        import torch.distributed as dist

        dist.destroy_process_group()


def rank() -> int:
    """This process's rank in the joined group; 0 without one."""
    import torch.distributed as dist

    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """The number of processes in the joined group; 1 without one."""
    import torch.distributed as dist

    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    """True on the one process that writes artifacts and logs (rank 0)."""
    return rank() == 0


def shard_bounds(count: int, rank_: int, world: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank_``'s contiguous block of ``count`` items over ``world`` ranks.

    Blocks differ in size by at most one (the first ``count % world`` ranks get the larger ones);
    the loop asks for ``count`` divisible by ``world``, so its blocks are equal.
    """
    if not 0 <= rank_ < world:
        raise ValueError(f"rank {rank_} outside [0, {world})")
    base, extra = divmod(count, world)
    lo = rank_ * base + min(rank_, extra)
    return lo, lo + base + (1 if rank_ < extra else 0)


def shard(items: Sequence[T], rank_: int | None = None, world: int | None = None) -> list[T]:
    """This rank's contiguous block of ``items`` (a list of groups, or of group indices)."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    lo, hi = shard_bounds(len(items), rank_, world)
    return list(items[lo:hi])


def all_reduce_sum(tensors: Sequence[torch.Tensor]) -> None:
    """Sum ``tensors`` in place over all ranks (one collective per dtype and device, not per tensor)."""
    if world_size() == 1 or not tensors:
        return
    import torch.distributed as dist

    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for bucket in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for tensor in bucket:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def all_reduce_max(value: int) -> int:
    """The largest of the ranks' ``value`` (``value`` itself for one process)."""
    if world_size() == 1:
        return value
    import torch.distributed as dist

    box = torch.tensor([value], dtype=torch.int64)  # a CPU tensor: gloo, also beside nccl
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` for one process).

    An all-gather rather than a gather to rank 0: each rank then takes the same decisions
    (for example that a step has no learning signal) from the same data, with no extra round.
    """
    if world_size() == 1:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``obj`` itself for one process)."""
    if world_size() == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for with one process)."""
    if world_size() > 1:
        import torch.distributed as dist

        dist.barrier()
