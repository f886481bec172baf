"""Sibling projections that read the same input, stored as one matrix so that one product computes them all.

A layer's query, key and value projections all read the normed hidden state, and so do the MLP's
gate and up projections. Computed one by one, a decode step pays a product's fixed cost five times
per layer where two would do (docs/performance.md gives the figures).

:func:`stacked_weights` lays the frozen weights (and biases) of such a group out back to back in one
tensor and makes each module's parameter a view of its rows, so the model holds no second copy and
transformers' own forward (and peft's) reads the very same numbers. Each output column of the
stacked product is the same dot product as the module's own; on CPU the results are bitwise those of the
module-by-module products (tested). Only frozen weights are stacked: a trained weight must stay its
own leaf tensor for its gradient to land on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _back_to_back(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether contiguous ``tensors`` already lie one after the other in one storage."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != storage
                or tensor.data_ptr() != expected):
            return False
        expected += tensor.numel() * tensor.element_size()
    return True


def _rows_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors (already back to back) seen as one, stacked along their first dimension."""
    first = tensors[0].detach()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.as_strided(shape, first.stride(), first.storage_offset())


def _restack(params: Sequence[torch.nn.Parameter]) -> None:
    """Copy ``params`` into one new tensor and make each of them a view of its rows."""
    stack = torch.cat([p.detach() for p in params])
    offset = 0
    for param in params:
        rows = param.shape[0]
        param.data = stack[offset:offset + rows]
        offset += rows


def stackable(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether plain ``nn.Linear`` modules can be stacked: frozen weights (and biases) of one dtype, device and
    input size, all with a bias or none, on a real device."""
    if not modules or not all(type(m) is torch.nn.Linear for m in modules):
        return False
    first = modules[0].weight
    has_bias = modules[0].bias is not None
    for module in modules:
        weight, bias = module.weight, module.bias
        if (weight.requires_grad or weight.dtype != first.dtype or weight.device != first.device
                or weight.device.type == "meta" or weight.shape[1:] != first.shape[1:]
                or (bias is not None) != has_bias or (bias is not None and bias.requires_grad)):
            return False
    return True


def stacked_weights(modules: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (``[sum of out_features, in_features]``) and biases of :func:`stackable` modules as one matrix.

    The first call lays them out back to back (the modules' parameters become views of the stack);
    later calls, from any decoder of the model, find them in place and only build the view. A weight
    replaced since (loaded anew, moved) is stacked again.
    """
    weights = [m.weight for m in modules]
    if not _back_to_back(weights):
        _restack(weights)
    biases = [m.bias for m in modules]
    if biases[0] is None:
        return _rows_view(weights), None
    if not _back_to_back(biases):
        _restack(biases)
    return _rows_view(weights), _rows_view(biases)


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # the projections the decoder stacks


def stack_frozen_groups(model: torch.nn.Module) -> int:
    """Lay out every stackable group of ``model`` (a layer's q/k/v, its MLP's gate/up) as the decoder does on
    first use; how many groups. A model loaded once and shared (rlrunbook.backend.model_host) is stacked before it is
    shared, so every module tree over it finds its groups in place and none makes a stack of its own."""
    count = 0
    for module in model.modules():
        for names in GROUPS:
            group = [getattr(module, name, None) for name in names]
            if all(m is not None for m in group) and stackable(group):
                stacked_weights(group)
                count += 1
    return count
