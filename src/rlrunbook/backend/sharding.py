"""Full-parameter training's weights, sharded over the ranks of a torchrun launch with PyTorch's FSDP2.

Every decoder layer, and the model around them (embeddings, final norm, output layer), is a
``fully_shard`` unit: between passes each rank holds ``1/W`` of every weight, of its gradient and of
AdamW's moments (float32: the master weights). A pass gathers a unit's weights in the compute dtype
(``MixedPrecisionPolicy(param_dtype=...)``) just before it runs and frees them after (the layers; the
outer unit stays gathered until its backward); backward gathers them again and reduce-scatters the
gradients in float32. With one process the same code runs over a one-rank group, so a run is computed
the same way at any world size.

The decoder runs layers with its own functions, not their ``forward``, so each unit gets a forward
method of its own registered with FSDP2 (``sharded_call``, :mod:`rlrunbook.engines.sharded_layers`):
the decoder runs a layer through it, and the trainer runs each micro-batch's scoring through the
outer unit's. Gradients are *summed* over ranks (the loss is a token sum: the sum of the ranks'
gradients is the gradient of the whole batch), not averaged as FSDP2 does by default.

Sampling reads every weight of the model: :func:`gather` holds them all gathered from one optimizer step to
the next training pass (:func:`release`), so sampling calls need no collectives, however many each rank makes.
"""

from __future__ import annotations

import functools
import warnings

import torch

from rlrunbook import distributed
from rlrunbook.engines.decoder import causal_lm
from rlrunbook.engines.sharded_layers import GATHERED, SHARDED_CALL

_SHARDS = "_rlrunbook_shards"


def _call(fn, *args):
    return fn(*args)


def _mesh(device: torch.device):
    """The ranks' device mesh, after joining torchrun's group, or making a one-rank group for a plain process
    (FSDP2 needs a group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        layout = distributed.launch_layout()
        if layout.world_size > 1:
            distributed.init(layout, device)
        else:
            dist.init_process_group(backend=distributed.backend_for(device), store=dist.HashStore(), rank=0,
                                    world_size=1)
    return init_device_mesh(device.type, (distributed.world_size(),))


def _unit(module: torch.nn.Module, mesh, **options) -> None:
    """``module`` made a ``fully_shard`` unit with its own forward method, ``sharded_call``."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    fully_shard(module, mesh=mesh, **options)
    setattr(module, SHARDED_CALL, _call)
    register_fsdp_forward_method(module, SHARDED_CALL)


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def shard(model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Shard ``model`` (a supported ``*ForCausalLM``, on its device) for full-parameter training, in place.

    Its weights become float32 master weights, split over the ranks; passes compute in ``compute_dtype``.
    Call once, before any optimizer sees the parameters (they are replaced by sharded ones).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh(next(model.parameters()).device)
    # The outer unit's forward returns the scores of a chunk, views among them; nothing changes them in place,
    # which is what FSDP2 warns about for every such call.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    model.float()
    model.requires_grad_(True)
    policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
    lm = causal_lm(model)
    for layer in lm.model.layers:
        _unit(layer, mesh, mp_policy=policy)
    # The outer unit stays gathered from a micro-batch's forward to its backward: its forward is the whole
    # scoring call, whose outputs FSDP2 cannot follow into backward.
    _unit(lm, mesh, mp_policy=policy, reshard_after_forward=False)
    for unit in _units(lm):
        unit.set_gradient_divide_factor(1.0)  # sum the ranks' gradients (token-sum losses)
        unit.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one
    # While gathered, the modules hold the gathered (compute dtype) tensors; the optimizer steps these.
    lm.__dict__[_SHARDS] = dict(model.named_parameters())


def sharded_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The sharded float32 master parameters of a model :func:`shard` sharded, by name, whether or not its
    weights are gathered now (the modules then hold gathered copies)."""
    return causal_lm(model).__dict__[_SHARDS]


def shard_reference(model: torch.nn.Module) -> None:
    """Shard a frozen copy of the initial weights (the KL reference) like the policy: ``1/W`` of it per rank, kept
    in its own (compute) dtype, gathered a unit at a time when a pass reads it."""
    mesh = _mesh(next(model.parameters()).device)
    model.requires_grad_(False)
    lm = causal_lm(model)
    for unit in (*lm.model.layers, lm):
        _unit(unit, mesh)


def architecture(model: torch.nn.Module) -> str:
    """The model's class name (FSDP2 renames a sharded module's class ``FSDP<name>``)."""
    name = type(causal_lm(model)).__name__
    return name.removeprefix("FSDP") if is_sharded(model) else name


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was sharded by :func:`shard`."""
    return SHARDED_CALL in causal_lm(model).__dict__


def outer_call(model: torch.nn.Module, fn, *args):
    """``fn(*args)`` as the outer unit's forward (its weights gathered; their gradients reduced after backward),
    after releasing weights :func:`gather` held; a direct call for a model that is not sharded."""
    lm = causal_lm(model)
    call = lm.__dict__.get(SHARDED_CALL)
    if call is None:
        return fn(*args)
    release(model)
    return call(fn, *args)


def gather(model: torch.nn.Module) -> None:
    """Gather every weight of a sharded ``model`` (in the compute dtype) until :func:`release`: what sampling reads.

    Holds one full copy of the weights in the compute dtype. Under torchrun a collective: every rank calls it at
    the same point (the trainer does after each optimizer step and state import, so sampling calls, whose
    number may differ between ranks, find the weights in place). A no-op when gathered or not sharded.
    """
    if not is_sharded(model) or is_gathered(model):
        return
    for unit in _units(model):
        unit.unshard()
        unit.__dict__[GATHERED] = True


def release(model: torch.nn.Module) -> None:
    """Free what :func:`gather` holds: each unit back to this rank's shard (a no-op when not gathered)."""
    if not is_gathered(model):
        return
    for unit in _units(model):
        unit.__dict__[GATHERED] = False
        unit.reshard()


def is_gathered(model: torch.nn.Module) -> bool:
    """Whether a sharded ``model``'s weights are gathered by :func:`gather` now."""
    return causal_lm(model).__dict__.get(GATHERED, False)


def parameter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each trained parameter's whole value on CPU (for a sharded model: the float32 master weights, gathered
    over ranks, a collective): for tests and small exports."""
    params = sharded_parameters(model) if is_sharded(model) else dict(model.named_parameters())
    return {name: full_value(param).detach().to("cpu", copy=True) for name, param in params.items()}


@functools.cache
def _state_dict_api():
    from torch.distributed.checkpoint import state_dict as api

    return api


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """The model's full weights (keyed as :func:`sharded_parameters`) and the optimizer's state keyed by parameter
    name, gathered on CPU on rank 0 (the other ranks get empty dicts: one copy of the state in host memory, where
    the checkpoint is written).

    World-size independent (a state saved at one world size loads at any other). A collective: every rank calls it.
    """
    release(model)
    api = _state_dict_api()
    options = api.StateDictOptions(full_state_dict=True, cpu_offload=True)
    names = sharded_parameters(model)  # a weight tied to two modules once, under its first name
    # cpu_offload: the tensors come as new CPU copies already
    weights = {name: value for name, value in api.get_model_state_dict(model, options=options).items()
               if name in names}
    if optimizer is None:
        return weights, None
    return weights, api.get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(model: torch.nn.Module, weights: dict, optimizer: torch.optim.Optimizer | None,
                    optimizer_state: dict | None) -> None:
    """Load :func:`full_state`'s output into a sharded ``model`` (and ``optimizer``). A collective: under torchrun
    rank 0's state is the one loaded (sent to the others shard by shard); the others' may be empty."""
    release(model)
    api = _state_dict_api()
    # strict=False: tied weights come under one name
    options = api.StateDictOptions(full_state_dict=True, strict=False,
                                   broadcast_from_rank0=distributed.world_size() > 1)
    # The loaders replace the values of the dicts they are given by this rank's shards: give them copies.
    api.set_model_state_dict(model, _containers(weights), options=options)
    if optimizer is not None:
        api.set_optimizer_state_dict(model, optimizer, _containers(optimizer_state or {}), options=options)


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """This rank's shards of the float32 master weights and of the optimizer's state, as CPU copies, keyed as
    :func:`full_state`'s (a sharded tensor's local shard in its place; AdamW's step counts whole). No collective:
    what a sharded checkpoint writes per rank.

    FSDP2 shards every weight along its first dimension in rank order (``torch.chunk``; a rank past the last chunk
    holds an empty shard), so the ranks' shards of a tensor, concatenated in rank order, are the whole tensor
    (:func:`rlrunbook.run.checkpoint_format.join_shards`): a sharded checkpoint loads at any world size.
    """
    release(model)
    weights = {name: _local(param).detach().to("cpu", copy=True) for name, param in sharded_parameters(model).items()}
    if optimizer is None:
        return weights, None
    api = _state_dict_api()
    state = api.get_optimizer_state_dict(model, optimizer)
    return weights, _map_tensors(state, lambda tensor: _local(tensor).detach().to("cpu", copy=True))


def load_local_state(model: torch.nn.Module, weights: dict, optimizer: torch.optim.Optimizer | None,
                     optimizer_state: dict | None) -> None:
    """Load :func:`local_state`'s output, saved by this rank at this world size, into a sharded ``model`` (and
    ``optimizer``). ``ValueError`` naming the first weight whose names or shard shapes differ. No collective."""
    release(model)
    params = sharded_parameters(model)
    if weights.keys() != params.keys():
        missing, unexpected = sorted(params.keys() - weights.keys())[:2], sorted(weights.keys() - params.keys())[:2]
        raise ValueError(f"the saved shards do not fit this model (missing {missing}, unexpected {unexpected})")
    for name, param in params.items():
        if tuple(_local(param).shape) != tuple(weights[name].shape):
            raise ValueError(f"{name}: this rank's shard is {tuple(_local(param).shape)}, the saved one "
                             f"{tuple(weights[name].shape)}")
    with torch.no_grad():
        for name, param in params.items():
            _local(param).copy_(weights[name])
    if optimizer is None:
        return
    api = _state_dict_api()
    state = {"state": {name: {key: _as_shard_of(value, params[name]) for key, value in entry.items()}
                       for name, entry in (optimizer_state or {}).get("state", {}).items()},
             "param_groups": (optimizer_state or {}).get("param_groups", [])}
    api.set_optimizer_state_dict(model, optimizer, state, options=api.StateDictOptions(strict=False))


def _as_shard_of(value, param: torch.nn.Parameter):
    """A saved local optimizer tensor as ``param``'s shard of the whole (a sharded DTensor on its mesh); anything
    else (a step count, a number) as it is."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(value, torch.Tensor) and isinstance(param, DTensor) and value.dim() > 0):
        return value
    local = _local(param)
    return DTensor.from_local(value.to(device=local.device, dtype=local.dtype), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _map_tensors(value, fn):
    """``value`` with ``fn`` applied to every tensor (dicts, lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def _containers(value):
    """``value`` with its dicts and lists copied (the tensors in them shared)."""
    if isinstance(value, dict):
        return {key: _containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_containers(item) for item in value]
    return value


def to_cpu(value):
    """``value`` with every tensor replaced by a CPU copy (dicts, lists and tuples walked)."""
    return _map_tensors(value, lambda tensor: tensor.detach().to("cpu", copy=True))


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's whole value (a collective), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor`` (its shard, for a sharded one)."""
    local = _local(tensor)
    return local.numel() * local.element_size()
