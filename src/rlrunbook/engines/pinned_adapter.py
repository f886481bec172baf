"""The LoRA factors a sampling call computes with, held by the engine apart from the trained adapter.

Read straight from the modules the trainer updates in place, ``lora_A``/``lora_B`` would let a sampler
run only between training calls, with its snapshot copied into the live adapter for the call and the
live one copied back. A :class:`PinnedAdapter` is the engine's own copy of every LoRA factor: a sampling
call copies its snapshot into it (only when the snapshot differs from the one already there) and the
decoder reads the factors from it. The trainer may then step, load or disable its adapter while the
sampler samples its snapshot, on another thread.

The buffers keep their addresses for the engine's life, so CUDA graphs captured over them stay valid
when a new snapshot is copied in.
Whether the adapter is on at all (the base model: ``weights is None``) is the pinned state's own
flag: peft's ``disable_adapter()``, a switch on the shared modules, is the trainer's to flip.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from rlrunbook.errors import ConfigError


def _lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules()
            if hasattr(module, "lora_A") and hasattr(module, "base_layer")}


class PinnedAdapter:
    """Engine-owned copies of a model's LoRA factors, loaded from one sampler snapshot at a time.

    ``load(weights, key)``: ``weights`` maps the model's adapter parameter names (as
    :func:`rlrunbook.backend.lora.clone_adapter` gives them) to tensors, or is ``None`` for the base
    model; ``key`` names the snapshot, so loading the same one again copies nothing.
    """

    def __init__(self, model: torch.nn.Module):
        self._names: dict[int, list[str]] = {}  # id(module) -> the adapters it adds
        self._factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._by_parameter: dict[str, torch.Tensor] = {}
        for prefix, module in _lora_modules(model).items():
            names = [name for name in module.lora_A if name in getattr(module, "active_adapters", [name])]
            self._names[id(module)] = names
            for name in names:
                a, b = module.lora_A[name].weight, module.lora_B[name].weight
                pinned = (a.detach().clone(), b.detach().clone())
                self._factors[(id(module), name)] = pinned
                self._by_parameter[f"{prefix}.lora_A.{name}.weight"] = pinned[0]
                self._by_parameter[f"{prefix}.lora_B.{name}.weight"] = pinned[1]
        self.enabled = True
        self.key: Hashable | None = None

    @torch.no_grad()
    def load(self, weights: Mapping[str, torch.Tensor] | None, key: Hashable) -> None:
        """Make the buffers hold ``weights`` (``None``: the adapter off); nothing is copied for the loaded ``key``."""
        if key == self.key and key is not None:
            return
        self.key = None  # a failed copy leaves no key claiming the buffers
        if weights is None:
            self.enabled = False
        else:
            missing = sorted(set(self._by_parameter) - set(weights))[:2]
            extra = sorted(set(weights) - set(self._by_parameter))[:2]
            shaped = sorted(name for name, buffer in self._by_parameter.items()
                            if name in weights and tuple(weights[name].shape) != tuple(buffer.shape))[:2]
            if missing or extra or shaped:
                raise ConfigError(f"the sampler snapshot does not fit the engine's LoRA layout (missing {missing}, "
                                  f"not in the engine {extra}, of another shape {shaped}); sample with a client made "
                                  "from this model's training client.")
            for name, buffer in self._by_parameter.items():
                buffer.copy_(weights[name])
            self.enabled = True
        self.key = key

    def adapter_names(self, module: torch.nn.Module) -> list[str]:
        """The adapters ``module`` adds in this pinned state (none when the adapter is off)."""
        return self._names.get(id(module), []) if self.enabled else []

    def factors(self, module: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` of adapter ``name`` of ``module``, as pinned."""
        return self._factors[(id(module), name)]


@dataclass(frozen=True)
class RowAdapters:
    """Several adapters in one pass (the samplers of several training clients of one base model, decoded as one
    batch): row ``i`` computes with ``slots[row_slot[i]]``, each slot an engine's :class:`PinnedAdapter` over the
    same model (the same LoRA layout, another snapshot). The rows are in slot order: slot ``s`` holds rows
    ``bounds[s]`` to ``bounds[s + 1]`` (what the fused CPU kernel cuts by); ``row_slot`` is the same as a tensor on
    the rows' device (what the chain masks by, captured CUDA graphs included: a graph's rows may change slots
    between replays)."""

    slots: tuple[PinnedAdapter, ...]
    bounds: tuple[int, ...]
    row_slot: torch.Tensor  # [rows] int64

    @classmethod
    def of_rows(cls, slots: Sequence[PinnedAdapter], row_slots: Sequence[int],
                device: torch.device | str = "cpu") -> RowAdapters:
        """Rows in slot order: ``row_slots[i]`` is row ``i``'s slot, never less than the row before's."""
        if any(b < a for a, b in pairwise(row_slots)) or (row_slots and not 0 <= row_slots[-1] < len(slots)):
            raise ValueError(f"rows' slots {list(row_slots)[:16]} are not in order of {len(slots)} slots")
        bounds = tuple(bisect_left(row_slots, s) for s in range(len(slots))) + (len(row_slots),)
        return cls(tuple(slots), bounds, torch.tensor(list(row_slots), dtype=torch.int64).to(device))

    @property
    def rows(self) -> int:
        return self.bounds[-1]

    def state(self) -> tuple:
        """What decides which adapters a pass adds (for captured graphs): the slots and whether each is on."""
        return tuple((id(slot), slot.enabled) for slot in self.slots)
