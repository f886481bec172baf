"""The LoRA updates of sibling projections with few operations, for passes that compute no gradient.

peft adds each adapted projection's update on its own: ``x @ A.T``, ``@ B.T``, a scaling and an add,
four small operations per projection, 28 per layer of a model with LoRA on its 7 projections. At the
few rows of a decode step each one's fixed cost, paid whatever its size, is far more than its arithmetic
(docs/performance.md gives the figures).

For a group of projections that read the same input (q/k/v; gate/up; or one alone) this computes the
group's updates as one product with the stacked ``A`` matrices (``xa = x @ A_stack.T``, ``A_stack``
``[sum of ranks, in]``) and, per projection, one product with its scaled ``B.T`` added in place into
its slice of the base output (``addmm_``): for q/k/v four operations instead of twelve. (One
block-diagonal ``B`` would make it two, but would read two to three times the bytes, and at these
sizes the adapter weights come from memory.)

The factors are copies of the adapter weights, so they are built for a block in which the weights
cannot change (:meth:`rlrunbook.engines.decoder.Decoder.weights_fixed`, one sampling call) and not
reused after it. The result differs from peft's order of operations by float rounding at most
(``(x A^T)(s B^T)`` against ``((x A^T) B^T) s``: the same bits when ``s`` is a power of two, as
alpha = 2 r gives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlrunbook.engines.pinned_adapter import PinnedAdapter


@dataclass(frozen=True)
class GroupFactors:
    """A group's LoRA factors: ``A`` stacked, and each module's ``scaling * B.T``."""

    a_stack: torch.Tensor  # [sum of ranks, in]
    b_scaled: tuple[torch.Tensor, ...]  # [rank, out] per module
    ranks: tuple[int, ...]


def active_adapter_names(module: torch.nn.Module) -> list[str]:
    """The adapters a peft LoRA layer adds to its base output now (none when disabled or merged)."""
    if module.disable_adapters or module.merged:
        return []
    return [name for name in module.active_adapters if name in module.lora_A]


def adapter_names(module: torch.nn.Module, pinned: PinnedAdapter | None = None) -> list[str]:
    """The adapters a peft LoRA layer adds: as the module is now, or as ``pinned`` holds them."""
    return active_adapter_names(module) if pinned is None else pinned.adapter_names(module)


def adapter_weights(module: torch.nn.Module, name: str,
                    pinned: PinnedAdapter | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of adapter ``name`` of ``module``: its live parameters, or ``pinned``'s copies."""
    if pinned is None:
        return module.lora_A[name].weight, module.lora_B[name].weight
    return pinned.factors(module, name)


def _single_adapter(module: torch.nn.Module,
                    pinned: PinnedAdapter | None = None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``(A, B, scaling)`` of a peft LoRA layer computing exactly one plain adapter, else ``None``."""
    if getattr(module, "base_layer", None) is None:
        return None
    active = adapter_names(module, pinned)
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(module, "lora_variant", {}) or module.lora_B[name].bias is not None:
        return None
    return (*adapter_weights(module, name, pinned), float(module.scaling[name]))


def group_factors(modules: Sequence[torch.nn.Module], pinned: PinnedAdapter | None = None) -> GroupFactors | None:
    """The factors of ``modules`` (peft LoRA layers with one active plain adapter each, of one dtype and
    device), copied as they are now (or as ``pinned`` holds them); ``None`` when the group cannot be
    computed this way (the caller then goes module by module)."""
    adapters = [_single_adapter(module, pinned) for module in modules]
    if any(adapter is None for adapter in adapters):
        return None
    if len({(a.dtype, a.device, b.dtype) for a, b, _ in adapters}) != 1:
        return None
    with torch.no_grad():
        a_stack = torch.cat([a for a, _, _ in adapters])
        b_scaled = tuple((b * scaling).t().contiguous() for _, b, scaling in adapters)
    return GroupFactors(a_stack, b_scaled, tuple(a.shape[0] for a, _, _ in adapters))


def add_group_updates(outputs: Sequence[torch.Tensor], x: torch.Tensor, factors: GroupFactors) -> None:
    """Add each module's LoRA update into its base output (``outputs``, views allowed) in place; no gradient."""
    xa = x.to(factors.a_stack.dtype) @ factors.a_stack.t()
    for out, part, b in zip(outputs, xa.split(factors.ranks, dim=-1), factors.b_scaled, strict=True):
        out.addmm_(part, b)
