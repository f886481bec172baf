"""One object per model, held while the model lives and shared by the module trees over its weights.

The decoders of a model (the sampler's, the trainer's) keep what they derive from its frozen weights once per
model, not once per decoder: the float64 copies of ``exact`` numerics (engines/float64_weights.py) and the coded
weights of decode steps (engines/coded_forms.py). A peft wrapper and the transformers model inside it count as one
model (the same weights); a module tree made over another model's weight tensors
(``rlrunbook.backend.model_host.share_weights``) is given that model's object with :meth:`PerModel.share`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (the same weights), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class PerModel(Generic[T]):
    """A ``make()`` per model, made on first use and held weakly by the model (it goes when the model goes)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._items: weakref.WeakKeyDictionary[torch.nn.Module, T] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # the sampler and the trainer may run on different threads

    def of(self, model: torch.nn.Module) -> T:
        """``model``'s object, made now where it has none."""
        owner = base_model(model)
        with self._lock:
            item = self._items.get(owner)
            if item is None:
                item = self._items[owner] = self._make()
            return item

    def get(self, model: torch.nn.Module) -> T | None:
        """``model``'s object, or ``None`` where none was made."""
        with self._lock:
            return self._items.get(base_model(model))

    def share(self, model: torch.nn.Module, source: torch.nn.Module) -> None:
        """Let ``model`` (a module tree over ``source``'s weight tensors) use ``source``'s object."""
        item = self.of(source)
        with self._lock:
            self._items[base_model(model)] = item
