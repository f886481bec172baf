"""One float64 copy of a model's frozen base weights, shared by every :class:`~rlrunbook.engines.decoder.Decoder`.

Under ``exact`` numerics every matrix product is accumulated in float64 (see the decoder), so each frozen base
weight is converted once and kept. The sampler's decoder and the trainer's scorer run the same model: keyed on the
model, they find the same copies, and the float64 weights are held once per model (8 bytes per frozen parameter;
12.3 GB for a 1.5B model), not once per decoder.

The copies of a model live as long as the model does (the registry holds it weakly). Base weights never change, so
a copy is never stale; a tensor that replaced a weight (a reloaded module) gets its own copy.
"""

from __future__ import annotations

import threading
import weakref

import torch

from rlrunbook.engines.per_model import PerModel, base_model

_FLOAT64_BYTES = 8


class Float64Weights:
    """Float64 copies of one model's frozen weights, made on first use and kept."""

    def __init__(self) -> None:
        # id(weight) -> (a weak reference to the weight, its float64 copy). The weak reference tells a live
        # weight from a new tensor that reused a freed one's id.
        self._copies: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._lock = threading.Lock()  # the sampler and the trainer may run on different threads

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """The float64 copy of ``weight`` (a frozen base weight), made once."""
        key = id(weight)
        with self._lock:
            entry = self._copies.get(key)
            if entry is not None and entry[0]() is weight:
                return entry[1]
            copy = weight.detach().double()
            self._copies[key] = (weakref.ref(weight), copy)
            self._drop_dead()
            return copy

    def _drop_dead(self) -> None:
        for key in [k for k, (ref, _) in self._copies.items() if ref() is None]:
            del self._copies[key]

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies of live weights."""
        with self._lock:
            self._drop_dead()
            return sum(copy.numel() * copy.element_size() for _, copy in self._copies.values())

    def __len__(self) -> int:
        with self._lock:
            self._drop_dead()
            return len(self._copies)


_per_model: PerModel[Float64Weights] = PerModel(Float64Weights)


def float64_weights(model: torch.nn.Module) -> Float64Weights:
    """The one float64 cache of ``model`` (a peft wrapper and the model inside it share it)."""
    return _per_model.of(model)


def share_float64_weights(model: torch.nn.Module, source: torch.nn.Module) -> None:
    """Let ``model`` (a copy of ``source`` over the same weight tensors) use ``source``'s float64 copies."""
    _per_model.share(model, source)


def float64_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes of float64 weight copies held for ``model`` now (0 when none were made: numerics other than ``exact``)."""
    cache = _per_model.get(model)
    return 0 if cache is None else cache.nbytes


def planned_float64_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes the float64 copies of ``model`` take once every frozen projection weight has been used under ``exact``.

    Counts the weights of the linear layers whose weight is frozen (``requires_grad`` False: a LoRA model's base
    layers, the output layer included), 8 bytes per element; shapes only, so a model on the ``meta`` device works.
    A weight shared by two layers (tied embeddings) is counted once.
    """
    seen: set[int] = set()
    total = 0
    for module in base_model(model).modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or weight is None or weight.requires_grad or id(weight) in seen:
            continue
        seen.add(id(weight))
        total += weight.numel() * _FLOAT64_BYTES
    return total
