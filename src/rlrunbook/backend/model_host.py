"""A loaded model with its tokenizer and sampling engine, and the weights a sampler samples from."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlrunbook import distributed, pending_signal
from rlrunbook.backend import sharding
from rlrunbook.backend.lora import clone_adapter, is_lora_tensor, load_adapter
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.engines.base import SamplingEngine
from rlrunbook.engines.coded_forms import share_coded_forms
from rlrunbook.engines.decoder import unsupported_reason
from rlrunbook.engines.float64_weights import share_float64_weights
from rlrunbook.engines.generate import GenerateEngine
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.engines.stacked_projections import stack_frozen_groups
from rlrunbook.errors import ConfigError
from rlrunbook.models import load_causal_lm, load_tokenizer, resolve_model


@dataclass
class ModelHost:
    """One model in memory: ``model`` (plain or LoRA-wrapped), its tokenizer, its engine.

    ``vllm`` is set when a vLLM server samples for this model (``TINKER_LOCAL_SAMPLER=vllm``): a
    :class:`rlrunbook.vllm.engine.VllmSamplingEngine`; ``engine`` then only validates requests
    and draws seeds.
    """

    name: str
    folder: Path
    tokenizer: object
    model: torch.nn.Module
    engine: SamplingEngine
    vllm: object | None = None
    # The resident base weights this host's model computes with (hosts of one value hold the same tensors), or
    # None where its weights are its own: samplers of hosts over one base may be decoded as one batch.
    shared_base: int | None = None

    @functools.cached_property
    def adapter_layout(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """The model's LoRA factors by name, shape and dtype (:func:`tensor_layout`; empty without an adapter)."""
        return tensor_layout({name: tensor for name, tensor in self.model.named_parameters() if is_lora_tensor(name)})

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a turn: the tokenizer's eos and the model config's eos id(s)."""
        ids: list[int] = []
        config_eos = getattr(self.model.config, "eos_token_id", None)
        for value in (self.tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])):
            if value is not None and value not in ids:
                ids.append(int(value))
        return ids

    @property
    def pad_token_id(self) -> int:
        return self.engine.pad_token_id


def tensor_layout(tensors: dict[str, torch.Tensor]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """Names, shapes and dtypes of ``tensors``, sorted: a snapshot of one layout fits every engine of that layout."""
    return tuple(sorted((name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in tensors.items()))


_resident_keys = itertools.count()


@dataclass
class ResidentModel:
    """A base model loaded once, whose frozen weights every host made over it shares (:func:`host_over`).

    ``model`` itself is never wrapped or sampled: each host gets a module tree of its own (its own LoRA
    adapter, its own engine and caches) whose base parameters and buffers hold these very tensors. ``load``
    loads the model anew (the module tree a host gets before its tensors are swapped for these).
    """

    folder: Path
    tokenizer: object
    model: torch.nn.Module
    load: Callable[[], torch.nn.Module]
    shareable: bool = True  # False for 4-bit weights: each host then keeps the tensors it loaded
    # Unique per resident (never reused, unlike id()): hosts over one resident say so by it (ModelHost.shared_base).
    key: int = field(default_factory=lambda: next(_resident_keys))

    @property
    def nbytes(self) -> int:
        """Bytes of the shared weights and buffers (a tensor tied to two modules counted once)."""
        seen: dict[int, int] = {}
        for tensor in itertools.chain(self.model.parameters(), self.model.buffers()):
            seen[tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()] = (
                tensor.numel() * tensor.element_size())
        return sum(seen.values())


def load_resident(base_model: str, settings: LocalSettings) -> ResidentModel:
    """Resolve ``base_model`` (built-in name, folder, or hub id; or its stand-in, ``settings.model_for``) and load
    its tokenizer and weights once; the weights are frozen and their stackable groups laid out back to back
    (:func:`rlrunbook.engines.stacked_projections.stack_frozen_groups`), as the decoder would on first use."""
    folder = resolve_model(settings.model_for(base_model))
    tokenizer = load_tokenizer(folder)

    def load() -> torch.nn.Module:
        model = load_causal_lm(folder, dtype=settings.resolved_dtype(), device=settings.device,
                               load_in_4bit=settings.load_in_4bit)
        pending_signal.raise_pending()  # a signal swallowed while the model's libraries loaded
        return model

    model = load()
    shareable = not settings.load_in_4bit
    if shareable:
        model.requires_grad_(False)
        stack_frozen_groups(model)
    return ResidentModel(folder, tokenizer, model, load, shareable)


def share_weights(resident: ResidentModel) -> torch.nn.Module:
    """A model of its own whose parameters and buffers hold ``resident``'s tensors (no byte kept twice).

    The module tree is loaded anew (as transformers loads any model), then each parameter's and buffer's data is
    swapped for the resident's, and the loaded copy is freed. Wrapping it in LoRA adds adapter tensors to it only;
    the base weights stay shared and frozen. It also shares the resident's float64 weight copies (``exact``) and
    coded weights (engines/coded_forms.py)."""
    model = resident.load()
    if not resident.shareable:
        return model
    shared = dict(resident.model.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        param.requires_grad_(False)
        param.data = shared[name].data
    shared_buffers = dict(resident.model.named_buffers())
    for name, buffer in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = shared_buffers[name]
    share_float64_weights(model, resident.model)
    share_coded_forms(model, resident.model)
    return model


def host_over(resident: ResidentModel, name: str, settings: LocalSettings, *, own_weights: bool = False) -> ModelHost:
    """A host named ``name`` over ``resident``'s weights: its own modules and engine, no second copy of the base.

    ``own_weights``: the host loads a copy of the weights of its own instead (full-parameter training changes
    every weight); its engine then captures no CUDA graphs (sharded weights are gathered into new memory).
    """
    model = resident.load() if own_weights else share_weights(resident)
    tokenizer = resident.tokenizer
    config = model.config
    common = dict(pad_token_id=int(tokenizer.pad_token_id), vocab_size=int(config.vocab_size),
                  max_context=getattr(config, "max_position_embeddings", None), max_batch_rows=settings.max_batch_rows,
                  seed=settings.seed, decode_batch=_text_decoder(tokenizer))
    # With vllm the in-process engine only validates requests, draws seeds and scores prompts: transformers'
    # generate engine does that for a model the decoder cannot run (quantised base weights, another family).
    if settings.sampler == "generate" or (settings.sampler == "vllm" and unsupported_reason(model) is not None):
        engine: SamplingEngine = GenerateEngine(model, **common)
    else:
        # No kept products while sampling runs beside training (off-policy): a call could add to them while a
        # training pass reads them.
        kept = 0 if settings.concurrent_sampling else settings.kept_products_mb << 20
        engine = HFSamplingEngine(model, numerics=settings.decoder_numerics(),
                                  cuda_graphs=settings.cuda_graphs and not own_weights,
                                  prefix_cache_tokens=settings.prefix_cache_tokens, kept_products_bytes=kept,
                                  coded_weights=settings.coded_weights, **common)
    shared = None if own_weights or not resident.shareable else resident.key
    return ModelHost(name, resident.folder, tokenizer, model, engine, shared_base=shared)


def load_host(base_model: str, settings: LocalSettings) -> ModelHost:
    """Load ``base_model`` and build its engine (a host with its weights to itself). The host keeps the name
    asked for."""
    return host_over(load_resident(base_model, settings), base_model, settings)


def _text_decoder(tokenizer):
    """Token-id rows -> text, special tokens kept as written: what stop strings are matched against."""
    def decode_batch(rows: list[list[int]]) -> list[str]:
        return tokenizer.batch_decode(rows, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode_batch


_snapshot_keys = itertools.count()


@dataclass(frozen=True)
class SamplerWeights:
    """What a SamplingClient samples from: the base model (``adapter is None``) or an adapter snapshot.

    ``version`` is the trainer's weights_version when the snapshot was taken: while the trainer
    is still at that version the live adapter *is* the snapshot and no copy is needed.
    """

    adapter: dict[str, torch.Tensor] | None
    version: int = -1
    full: bool = False  # the live weights of a full-parameter trainer (``adapter`` unused), valid at ``version``
    # Unique per snapshot (never reused, unlike id()): an engine keeps cached prefixes under this key.
    key: int = field(default_factory=lambda: next(_snapshot_keys))

    @classmethod
    def base(cls) -> SamplerWeights:
        return cls(adapter=None, key=-1)  # the base model's keys/values never change


@contextmanager
def active_weights(host: ModelHost, weights: SamplerWeights, live_version: int | None) -> Iterator[None]:
    """Make ``host.model`` compute with ``weights`` inside the block, restoring the live adapter after.

    Full-parameter training keeps no copy of past weights: a sampler of its live weights samples them while
    they are still the trainer's, and is refused once an optimizer step moved them.
    """
    model = host.model
    if weights.full:
        if live_version is not None and weights.version != live_version:
            raise ConfigError(
                f"this sampler holds the weights of version {weights.version}, but full-parameter training has moved "
                f"them to version {live_version} and keeps no copies: sample before the next optim_step, or make a "
                "new sampler with save_weights_and_get_sampling_client() after it.")
        if not sharding.is_gathered(model) and distributed.world_size() > 1:
            raise ConfigError(
                "sampling between forward_backward and optim_step under torchrun: the full-parameter weights are "
                "sharded then, and gathering them would need every rank to sample at the same point. Sample after "
                "optim_step (or before forward_backward).")
        sharding.gather(model)  # one process: the weights as the last optimizer step left them
        yield
        return
    if weights.adapter is None:
        disable = getattr(model, "disable_adapter", None)
        with (disable() if callable(disable) else nullcontext()):
            yield
        return
    if live_version is not None and weights.version == live_version:
        yield
        return
    live = clone_adapter(model)
    load_adapter(model, weights.adapter)
    try:
        yield
    finally:
        load_adapter(model, live)
