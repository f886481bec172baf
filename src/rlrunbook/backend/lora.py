"""LoRA over a causal LM with peft: which modules, how initialised, how its weights are copied."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from rlrunbook.errors import ConfigError
from rlrunbook.lora_rank import check_lora_rank

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


def lora_target_modules(train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
    """Module names LoRA wraps; at least one group must be trained."""
    targets = [*(ATTENTION_MODULES if train_attn else ()), *(MLP_MODULES if train_mlp else ()),
               *(UNEMBED_MODULES if train_unembed else ())]
    if not targets:
        raise ConfigError("train_attn, train_mlp and train_unembed are all False: nothing would train.")
    return targets



def wrap_with_lora(
    model: torch.nn.Module, *, rank: int, alpha: int, seed: int,
    train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True,
) -> torch.nn.Module:
    """Wrap ``model`` in a peft LoRA adapter named ``default``; base weights are frozen. ``rank`` is from 1 to
    :data:`~rlrunbook.lora_rank.MAX_LORA_RANK` (``ConfigError`` otherwise).

    peft initialises A randomly (seeded here, without touching the global RNG stream) and B at
    zero, so the wrapped model computes exactly what the base model does until the first step.
    """
    check_lora_rank(rank)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in lora_target_modules(train_attn, train_mlp, train_unembed) if t in present]
    if not targets:
        raise ConfigError(f"none of the LoRA target modules exist in {type(model).__name__}.")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                        target_modules=targets, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        _quiet_peft_wrapping()
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    return peft_model


def load_saved_adapter(model: torch.nn.Module, folder: str) -> torch.nn.Module:
    """``PeftModel.from_pretrained(model, folder)`` (saved sampler weights), as quiet as :func:`wrap_with_lora`."""
    with warnings.catch_warnings():
        _quiet_peft_wrapping()
        return PeftModel.from_pretrained(model, folder)


def _quiet_peft_wrapping() -> None:
    """Filter (inside the caller's ``catch_warnings``) the two warnings peft's wrapping prints on every run,
    both about things rlrunbook does on purpose or cannot change; any other warning still shows."""
    # LoRA on the unembedding of a model with tied embeddings (SmolLM2) adapts the output projection only, as
    # the Tinker API's train_unembed means; the input embedding stays the base's. peft warns because merging
    # such an adapter, or converting it to another format, would untie the two; rlrunbook never does either.
    warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True` and a tied layer is part of "
                            "the adapter", category=UserWarning)
    # peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5 renamed (FutureWarning); the
    # call is peft's own and changes nothing here. Fixed in later peft releases.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable LoRA parameters by name (the only ones the optimizer sees)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def clone_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the adapter weights: a sampler snapshot."""
    return {name: p.detach().clone() for name, p in adapter_parameters(model).items()}


def is_lora_tensor(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA factor."""
    return ".lora_A." in name or ".lora_B." in name


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every LoRA factor, trainable or not (an adapter loaded for inference is frozen)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if is_lora_tensor(name)}


@contextmanager
def snapshot_loaded(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block the adapter holds ``weights``; the live values (not their gradients) come back after."""
    live = clone_adapter(model)
    load_adapter(model, weights)
    try:
        yield
    finally:
        load_adapter(model, live)


@torch.no_grad()
def load_adapter(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into the adapter in place; names and shapes must match exactly."""
    params = adapter_parameters(model)
    if params.keys() != weights.keys():
        raise ConfigError("adapter weights do not match this model's LoRA layout (different targets or rank).")
    for name, p in params.items():
        p.copy_(weights[name])
