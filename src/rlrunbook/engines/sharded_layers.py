"""How a pass runs a module whose weights may be sharded over ranks (full-parameter training, FSDP2).

A sharded module holds only this rank's slice of its weights between passes. PyTorch's FSDP2 gathers them
around a module's *forward*; the decoder never calls a layer's ``forward`` (it computes each layer with
its own fixed-order functions, :mod:`rlrunbook.engines.decoder`), so the sharding code
(:mod:`rlrunbook.backend.sharding`) gives each sharded module a forward method of its own, ``sharded_call``,
registered with FSDP2: ``module.sharded_call(fn, *args)`` gathers the module's weights, runs
``fn(*args)`` and releases them again, and records what backward needs to gather them again and reduce the
gradients. This module is what the passes use to run a piece of work through that method when it exists.

While a model is gathered as a whole (:func:`rlrunbook.backend.sharding.gathered`: sampling), every weight is
already in place and the work runs directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

SHARDED_CALL = "sharded_call"  # the forward method the sharding code registers on each sharded module
GATHERED = "_rlrunbook_gathered"  # set on a sharded module while its weights are gathered for a whole call


def through(module: torch.nn.Module, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` with ``module``'s weights in place: through its ``sharded_call`` where it is sharded and
    not gathered, else directly."""
    call = module.__dict__.get(SHARDED_CALL)
    if call is None or module.__dict__.get(GATHERED, False):
        return fn(*args)
    return call(fn, *args)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a sharded unit whose weights are not gathered now."""
    return SHARDED_CALL in module.__dict__ and not module.__dict__.get(GATHERED, False)
