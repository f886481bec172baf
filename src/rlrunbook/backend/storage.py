"""Where the local backend keeps what the hosted service keeps: runs and ``tinker://`` checkpoints.

Every ``tinker://<model_id>/<kind>/<name>`` path is a folder under the storage root
(``TINKER_LOCAL_STORAGE``), so a path printed by one process is readable by another::

    <root>/<model_id>/training_run.json          base model, LoRA layout, user metadata
    <root>/<model_id>/weights/<name>/            save_state: adapter + optimizer (+ rlrunbook_state.json)
    <root>/<model_id>/sampler_weights/<name>/    save_weights_for_sampler: adapter (+ base model name)

Adapters are peft folders (``adapter_config.json``, ``adapter_model.safetensors``); optimizer
state is a ``torch.save`` of tensors and plain numbers, read back with ``weights_only=True``.
Nothing here unpickles arbitrary objects. TTLs are accepted and ignored: local checkpoints
never expire.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rlrunbook.errors import ConfigError, ModelNotFoundError

PREFIX = "tinker://"
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> SDK CheckpointType
RUN_FILE = "training_run.json"


@dataclass(frozen=True)
class TinkerPath:
    """A parsed ``tinker://<model_id>/<kind>/<name>`` path."""

    model_id: str
    kind: str  # "weights" | "sampler_weights"
    name: str

    @property
    def path(self) -> str:
        return f"{PREFIX}{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return KINDS[self.kind]


def checkpoint_name(name: str) -> str:
    """``name`` if it can be one path segment; ``ConfigError`` otherwise."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"checkpoint name {name!r} must be a non-empty string without '/'.")
    return name


def parse_tinker_path(path: str, kind: str | None = None) -> TinkerPath:
    """Parse ``path``; with ``kind`` it must be of that kind (``weights`` or ``sampler_weights``)."""
    parts = path[len(PREFIX):].split("/") if isinstance(path, str) and path.startswith(PREFIX) else []
    expected = f"tinker://<model_id>/{kind or '<weights|sampler_weights>'}/<name>"
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise ConfigError(f"{path!r} is not a checkpoint path of the form {expected}.")
    if kind is not None and parts[1] != kind:
        hint = ("save_state() paths (…/weights/…) restore training; save_weights_for_sampler() paths "
                "(…/sampler_weights/…) make sampling clients")
        raise ConfigError(f"{path!r} is a {parts[1]} path, but {expected} is needed here: {hint}.")
    return TinkerPath(parts[0], parts[1], parts[2])


@dataclass(frozen=True)
class RunRecord:
    """What ``training_run.json`` holds: enough to rebuild the run's LoRA model from a checkpoint."""

    model_id: str
    base_model: str
    lora_rank: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    user_metadata: dict[str, str] = field(default_factory=dict)
    created: float = field(default_factory=time.time)


class CheckpointStore:
    """The storage root: run records and checkpoint folders, addressed by ``tinker://`` paths."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def folder(self, path: TinkerPath) -> Path:
        return self.root / path.model_id / path.kind / path.name

    def existing_folder(self, path: TinkerPath) -> Path:
        """The folder of a saved checkpoint; ``ModelNotFoundError`` naming the fix if it is absent."""
        folder = self.folder(path)
        if not (folder / "adapter_model.safetensors").is_file():
            saver = "save_state(name)" if path.kind == "weights" else "save_weights_for_sampler(name)"
            raise ModelNotFoundError(
                f"no checkpoint at {path.path} (looked in {folder}); save it first with training_client.{saver}, "
                "or point TINKER_LOCAL_STORAGE at the storage the run wrote to."
            )
        return folder

    def write_run(self, record: RunRecord) -> None:
        folder = self.root / record.model_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RUN_FILE).write_text(json.dumps(asdict(record), indent=1))

    def read_run(self, model_id: str) -> RunRecord:
        file = self.root / model_id / RUN_FILE
        if not file.is_file():
            raise ModelNotFoundError(f"no training run {model_id!r} under {self.root} ({RUN_FILE} missing).")
        return RunRecord(**json.loads(file.read_text()))

    def run_ids(self) -> list[str]:
        """Model ids of every run, oldest first."""
        runs = [p.parent for p in self.root.glob(f"*/{RUN_FILE}")]
        return [p.name for p in sorted(runs, key=lambda p: (p / RUN_FILE).stat().st_mtime)]

    def checkpoints(self, model_id: str) -> list[tuple[TinkerPath, Path]]:
        """Every saved checkpoint of a run, oldest first."""
        found = []
        for kind in KINDS:
            for folder in (self.root / model_id / kind).glob("*"):
                if (folder / "adapter_model.safetensors").is_file():
                    found.append((TinkerPath(model_id, kind, folder.name), folder))
        return sorted(found, key=lambda item: item[1].stat().st_mtime)

    def delete(self, path: TinkerPath) -> None:
        shutil.rmtree(self.existing_folder(path))


def modified_at(folder: Path) -> datetime:
    return datetime.fromtimestamp(folder.stat().st_mtime, tz=timezone.utc)


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
