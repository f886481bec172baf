"""The service a run trains through: the local backend's settings, the default service client, the device.

Which backend runs is chosen by ``TINKER_BACKEND`` (see :func:`rlrunbook.backend.backend_name`); for the
local backend, the ``TINKER_LOCAL_*`` environment gives the settings and the run's ``backend`` section
overrides them. Everything here reads only that section of the config.
"""

from __future__ import annotations

import dataclasses
import random

from rlrunbook.rl.setup.config import BackendSettings


def local_settings(stated: BackendSettings):
    """The local backend's settings: the TINKER_LOCAL_* environment, with the run's ``backend`` section on top."""
    import torch

    from rlrunbook.backend.settings import LocalSettings

    settings = LocalSettings.from_env()
    changes: dict[str, object] = {"load_in_4bit": stated.load_in_4bit}
    if stated.device is not None:
        changes["device"] = stated.device
    if stated.dtype is not None:
        changes["dtype"] = getattr(torch, stated.dtype)
    if stated.grad_accum_steps is not None:
        changes["grad_accum_chunks"] = stated.grad_accum_steps
    if stated.sampler is not None:
        changes["sampler"] = stated.sampler
    if stated.micro_batch_tokens is not None:
        changes["micro_batch_tokens"] = stated.micro_batch_tokens
    if stated.activation_checkpointing is not None:
        changes["activation_checkpointing"] = stated.activation_checkpointing
    return dataclasses.replace(settings, **changes)


def training_device(stated: BackendSettings) -> str | None:
    """The device the local backend will train on (torchrun ranks join a group on it); None: the default."""
    from rlrunbook.backend import backend_name

    return local_settings(stated).device if backend_name() == "local" else None


def default_service(stated: BackendSettings, micro_batching=None, *, concurrent_sampling: bool = False):
    """A service client of the selected backend (the local one with :func:`local_settings`). ``micro_batching``:
    a run's memory plan (:class:`rlrunbook.rl.setup.memory_plan.MemoryPlan`), whose micro-batch size and
    activation checkpointing the trainer then uses instead of deriving its own. ``concurrent_sampling``
    (an asynchronous run): the local backend samples on a worker of its own, beside the trainer's."""
    from rlrunbook.backend import backend_name, create_service_client

    if backend_name() == "local":
        settings = local_settings(stated)
        if concurrent_sampling:
            settings = dataclasses.replace(settings, concurrent_sampling=True)
        if micro_batching is not None:  # checkpointing the user chose stays; the plan's is skipped where it can be
            chosen = settings.activation_checkpointing != "auto"
            settings = dataclasses.replace(
                settings, micro_batch_tokens=micro_batching.micro_batch_tokens or 0,
                activation_checkpointing=settings.activation_checkpointing if chosen else (
                    "auto" if micro_batching.recompute_layers else "off"),
                planned_recompute=not chosen and micro_batching.recompute_layers)
        return create_service_client(settings=settings)
    return create_service_client()


def training_client(service, config):
    """The run's training client on ``service``: a LoRA adapter of ``config.lora_rank``, or every weight
    (``finetune: full``, the local backend's extension ``create_full_training_client``; the KL reference copy is
    kept only when ``loss.kl_coef > 0``)."""
    from rlrunbook.errors import ConfigError

    if config.finetune == "full":
        create = getattr(service, "create_full_training_client", None)
        if create is None:
            raise ConfigError("finetune: full trains every weight on the local backend only (TINKER_BACKEND=local); "
                              "the hosted service trains LoRA adapters: use finetune: lora there.")
        return create(config.model, with_reference=config.loss.kl_coef > 0)
    return service.create_lora_training_client(config.model, rank=config.lora_rank, seed=config.seed,
                                               train_unembed=config.train_unembed).result()


def is_local(training) -> bool:
    """Whether ``training`` is this project's local backend (which takes the local loss_fn_config keys)."""
    from rlrunbook.backend.training_client import LocalTrainingClient

    return isinstance(training, LocalTrainingClient)


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python, NumPy and torch; with ``deterministic``, make torch refuse nondeterministic kernels."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        if torch.cuda.is_available():
            torch.backends.cudnn.benchmark = False
