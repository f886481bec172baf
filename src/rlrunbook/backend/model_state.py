"""Reading and writing checkpoint folders: adapters (peft safetensors) and optimizer state.

Every function here runs on the backend's worker thread, where the live adapter is in place.
A training-state folder (``save_state``) is also a valid sampler-weights folder: both hold a
peft adapter, so ``create_sampling_client(model_path=...)`` accepts either kind of path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from rlrunbook.backend.model_host import ModelHost
from rlrunbook.backend.lora import adapter_parameters, clone_adapter, load_adapter
from rlrunbook.backend.trainer import Trainer
from rlrunbook.errors import ConfigError

BASE_MODEL_FILE = "rlrunbook_base_model.json"
STATE_FILE = "rlrunbook_state.json"
OPTIMIZER_FILE = "optimizer.pt"


def write_adapter(host: ModelHost, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """The live adapter, or the snapshot ``weights`` (keyed like the model's parameters; the live adapter is
    then only read for its peft config), as a peft folder, plus the name of its base model."""
    folder.mkdir(parents=True, exist_ok=True)
    host.model.save_pretrained(str(folder), save_embedding_layers=False, state_dict=weights)
    (folder / BASE_MODEL_FILE).write_text(json.dumps({"base_model": host.name}))


def read_adapter(host: ModelHost, folder: Path) -> dict[str, torch.Tensor]:
    """The adapter saved in ``folder`` as a snapshot (name -> tensor), leaving the live adapter as it was.

    ``ConfigError`` if the folder's LoRA layout (targets, rank) differs from the live model's.
    """
    live = clone_adapter(host.model)
    try:
        result = set_peft_model_state_dict(host.model, load_file(str(folder / "adapter_model.safetensors")))
        problems = list(result.unexpected_keys) + [k for k in result.missing_keys if "lora_" in k]
        if problems:
            raise ConfigError(
                f"the adapter in {folder} does not fit this model's LoRA layout ({problems[:2]} ...): it was "
                "trained with other LoRA targets or on another base model."
            )
        return clone_adapter(host.model)
    except RuntimeError as error:  # a shape mismatch: another rank
        raise ConfigError(f"the adapter in {folder} does not fit this model's LoRA layout: {error}") from None
    finally:
        load_adapter(host.model, live)


def save_training_state(host: ModelHost, trainer: Trainer, folder: Path) -> None:
    """Adapter, AdamW state (if a step was taken) and the parameter order the state is keyed by."""
    write_adapter(host, folder)
    optimizer = trainer.optimizer_state()
    if optimizer is not None:
        torch.save(optimizer, folder / OPTIMIZER_FILE)
    (folder / STATE_FILE).write_text(json.dumps({
        "parameter_names": trainer.parameter_names(),
        "has_optimizer_state": optimizer is not None,
        "weights_version": trainer.weights_version,
    }))


def load_training_state(host: ModelHost, trainer: Trainer, folder: Path, *, with_optimizer: bool) -> None:
    """Copy a ``save_state`` folder's adapter into the live model; with the optimizer state if asked."""
    meta_file = folder / STATE_FILE
    if not meta_file.is_file():
        raise ConfigError(
            f"{folder} holds sampler weights, not a training state (no {STATE_FILE}); restore training from a "
            "save_state() path (tinker://<model_id>/weights/<name>)."
        )
    meta = json.loads(meta_file.read_text())
    names = trainer.parameter_names()
    if meta["parameter_names"] != names:
        raise ConfigError(f"the training state in {folder} was saved from a different LoRA layout than this model's.")
    snapshot = read_adapter(host, folder)
    optimizer = None
    if with_optimizer and meta["has_optimizer_state"]:
        optimizer = torch.load(folder / OPTIMIZER_FILE, map_location=trainer.device, weights_only=True)
    with torch.no_grad():
        for name, param in adapter_parameters(host.model).items():
            param.copy_(snapshot[name])
    trainer.weights_loaded(optimizer, keep_optimizer=with_optimizer)


MAX_AGE_RECIPIENTS = 10  # the SDK's limit on save_weights_external's age_encryption_recipients


def age_recipients(recipients: list[str] | None) -> list:
    """``save_weights_external``'s ``age_encryption_recipients`` parsed by pyrage (``age1...`` keys or SSH
    public keys); ``ConfigError`` naming the bad one. An empty list for None."""
    if not recipients:
        return []
    if isinstance(recipients, str) or len(recipients) > MAX_AGE_RECIPIENTS:
        raise ConfigError(f"age_encryption_recipients must be a list of at most {MAX_AGE_RECIPIENTS} keys, "
                          f"got {recipients!r}.")
    try:
        import pyrage
    except ImportError:
        raise ConfigError("age_encryption_recipients needs the pyrage package (pip install pyrage, or the "
                          "rlrunbook[cookbook] extra); or export without encryption.") from None
    parsed = []
    for key in recipients:
        kind = pyrage.ssh if isinstance(key, str) and key.startswith(("ssh-", "ecdsa-")) else pyrage.x25519
        try:
            parsed.append(kind.Recipient.from_str(key))
        except (pyrage.RecipientError, TypeError) as error:
            raise ConfigError(f"age recipient {key!r} is neither an age1... key nor an SSH public key "
                              f"({error}).") from None
    return parsed


def write_external_weights(host: ModelHost, folder: Path, recipients: list) -> None:
    """The live adapter as a peft folder (what ``save_weights_external`` exports for a LoRA run), replacing
    whatever ``folder`` held; with age ``recipients`` every file is encrypted to them as ``<file>.age``."""
    if folder.exists():
        shutil.rmtree(folder)
    write_adapter(host, folder)
    if recipients:
        import pyrage

        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            pyrage.encrypt_file(str(file), f"{file}.age", recipients)
            file.unlink()
