"""Where the local backend keeps what the hosted service keeps: runs and ``tinker://`` checkpoints.

Every ``tinker://<model_id>/<kind>/<name>`` path is a folder under the storage root
(``TINKER_LOCAL_STORAGE``), so a path printed by one process is readable by another::

    <root>/<model_id>/training_run.json          base model, LoRA layout, user metadata
    <root>/<model_id>/weights/<name>/            save_state: adapter + optimizer (+ rlrunbook_state.json)
    <root>/<model_id>/sampler_weights/<name>/    save_weights_for_sampler: adapter (+ base model name)
    <root>/<model_id>/external_weights/<name>/   save_weights_external: adapter (+ base model name), files
                                                 age-encrypted (``*.age``) where recipients were given

A checkpoint is written into a hidden staging folder beside its place, its files flushed to disk, then renamed
into place (:func:`staged_folder`): a process killed while saving leaves no half-written checkpoint behind, and
a save that returned is on disk.

Adapters are peft folders (``adapter_config.json``, ``adapter_model.safetensors``); optimizer
state is a ``torch.save`` of tensors and plain numbers, read back with ``weights_only=True``.
Nothing here unpickles arbitrary objects. A TTL is recorded in the checkpoint's
``rlrunbook_checkpoint.json`` and listed as the checkpoint's ``expires_at``; once it passes the checkpoint is
gone for every use but deletion (loads, copies, a new TTL, ``weights_info``), as on the hosted service. In process
nothing deletes its files then (delete them with the RestClient), while ``rlrunbook serve`` removes expired ones
(:meth:`CheckpointStore.remove_expired`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from rlrunbook.errors import ConfigError, ModelNotFoundError

PREFIX = "tinker://"
# path segment -> SDK CheckpointType
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
RUN_FILE = "training_run.json"
ADAPTER_FILE = "adapter_model.safetensors"
ENCRYPTED_SUFFIX = ".age"  # save_weights_external's files when age recipients were given
CHECKPOINT_FILE = "rlrunbook_checkpoint.json"  # a checkpoint's expiry (the SDK's TTL)
MIN_TTL_SECONDS = 3600  # the SDK's documented bounds: 1 hour ...
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600  # ... to 10 years


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


MAX_SEGMENT_BYTES = 255  # a file name's limit on Linux file systems (NAME_MAX)


def path_segment(value: object, what: str) -> str:
    """``value`` if it can name one folder inside the storage: a non-empty string of printable characters, at
    most 255 bytes of UTF-8, without ``/`` or ``\\``, not starting with ``.`` (hidden folders are saves in
    progress, and ``..`` leaves the folder); ``ConfigError`` naming ``what`` and the rule otherwise."""
    shown = repr(value) if not isinstance(value, str) or len(value) <= 80 else repr(value[:77] + "...")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} {shown} must be a non-empty string.")
    if "/" in value or "\\" in value or value.startswith(".") or not value.isprintable():
        raise ConfigError(f"{what} {shown} must be one plain name: no '/', '\\', leading '.', or control "
                          "character.")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES:
        raise ConfigError(f"{what} {shown} is longer than {MAX_SEGMENT_BYTES} bytes, the file system's limit for a "
                          "name; choose a shorter one.")
    return value


def checkpoint_name(name: str) -> str:
    """``name`` if it can be one path segment (:func:`path_segment`); ``ConfigError`` otherwise."""
    return path_segment(name, "checkpoint name")


def parse_tinker_path(path: str, kind: str | None = None) -> TinkerPath:
    """Parse ``path``; with ``kind`` it must be of that kind (``weights`` or ``sampler_weights``)."""
    parts = path[len(PREFIX):].split("/") if isinstance(path, str) and path.startswith(PREFIX) else []
    expected = f"tinker://<model_id>/{kind or '<weights|sampler_weights|external_weights>'}/<name>"
    shown = repr(path) if not isinstance(path, str) or len(path) <= 200 else repr(path[:197] + "...")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise ConfigError(f"{shown} is not a checkpoint path of the form {expected}.")
    path_segment(parts[0], "the model id of a tinker:// path,")
    path_segment(parts[2], "the checkpoint name of a tinker:// path,")
    if kind is not None and parts[1] != kind:
        hint = ("save_state() paths (…/weights/…) restore training; save_weights_for_sampler() paths "
                "(…/sampler_weights/…) make sampling clients")
        raise ConfigError(f"{shown} is a {parts[1]} path, but {expected} is needed here: {hint}.")
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
    session_id: str = ""  # the ServiceClient (session) that created the run; "" in records written before


class CheckpointStore:
    """The storage root: run records and checkpoint folders, addressed by ``tinker://`` paths."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def run_folder(self, model_id: str) -> Path:
        """The folder of run ``model_id``, inside the root whatever links lie on the way; ``ConfigError`` for an
        id that is not one plain name or a folder that resolves outside the root."""
        return self._inside(self.root / path_segment(model_id, "model id"), model_id)

    def folder(self, path: TinkerPath) -> Path:
        """The folder of checkpoint ``path`` (which need not exist yet), confined to the root."""
        if path.kind not in KINDS:
            raise ConfigError(f"{path.kind!r} is not a checkpoint kind ({', '.join(KINDS)}).")
        folder = self.run_folder(path.model_id) / path.kind / path_segment(path.name, "checkpoint name")
        return self._inside(folder, path.path)

    def _inside(self, folder: Path, named: str) -> Path:
        root = self.root.resolve()
        if not folder.resolve().is_relative_to(root):  # a symbolic link that leads out of the storage
            raise ConfigError(f"{named!r} leads outside the checkpoint storage (through a symbolic link); "
                              "it cannot be read or written here.")
        return folder

    def _leads_out(self, folder: Path) -> bool:
        """Whether ``folder``, or anything in it, is a symbolic link that resolves outside the root (links inside
        are not followed: each is checked where it points)."""
        root = self.root.resolve()
        if not folder.resolve().is_relative_to(root):
            return True
        for here, dirs, files in os.walk(folder):
            if any(not (Path(here) / name).resolve().is_relative_to(root) for name in dirs + files):
                return True
        return False

    def existing_folder(self, path: TinkerPath, *, encrypted_ok: bool = False, expired_ok: bool = False) -> Path:
        """The folder of a saved checkpoint; ``ModelNotFoundError`` naming the fix if it is absent, or expired
        (unless ``expired_ok``: deleting it).

        An age-encrypted export (``save_weights_external`` with recipients) counts only with ``encrypted_ok``:
        nothing in process can load it."""
        folder = self.folder(path)
        if folder.is_dir() and self._leads_out(folder):
            raise ConfigError(f"{path.path} holds a symbolic link that leads outside the checkpoint storage; it "
                              "cannot be read or written here.")
        if not expired_ok and folder.is_dir():
            try:
                expires = expires_at(folder)
            except (OSError, ValueError, KeyError, TypeError):  # an unreadable record is not an expiry
                expires = None
            if expires is not None and expires <= datetime.now(timezone.utc):
                raise ModelNotFoundError(f"the checkpoint at {path.path} expired at {expires.isoformat()} (its TTL "
                                         "passed): save it again, or save with a longer ttl_seconds.")
        if (folder / ADAPTER_FILE).is_file():
            return folder
        if (folder / (ADAPTER_FILE + ENCRYPTED_SUFFIX)).is_file():
            if encrypted_ok:
                return folder
            raise ConfigError(f"{path.path} holds age-encrypted files: download and decrypt them "
                              "(tinker_cookbook.weights.download), or export again without "
                              "age_encryption_recipients.")
        saver = {"weights": "save_state(name)", "sampler_weights": "save_weights_for_sampler(name)",
                 "external_weights": "save_weights_external(name)"}[path.kind]
        raise ModelNotFoundError(
            f"no checkpoint at {path.path}; save it first with training_client.{saver}, or point "
            "TINKER_LOCAL_STORAGE at the storage the run wrote to."
        )

    def write_run(self, record: RunRecord) -> None:
        folder = self.run_folder(record.model_id)
        folder.mkdir(parents=True, exist_ok=True)
        write_durably(folder / RUN_FILE, json.dumps(asdict(record), indent=1))

    def read_run(self, model_id: str) -> RunRecord:
        file = self._inside(self.run_folder(model_id) / RUN_FILE, model_id)
        if not file.is_file():
            raise ModelNotFoundError(f"no training run {model_id!r} in this storage.")
        return RunRecord(**json.loads(file.read_text()))

    def run_ids(self) -> list[str]:
        """Model ids of every run, oldest first: the folders of the root that hold a run record, not hidden and
        not leading outside the root."""
        root = self.root.resolve()
        runs = [p.parent for p in self.root.glob(f"*/{RUN_FILE}")
                if not p.parent.name.startswith(".") and p.resolve().is_relative_to(root)]
        return [p.name for p in sorted(runs, key=lambda p: (p / RUN_FILE).stat().st_mtime)]

    def checkpoints(self, model_id: str) -> list[tuple[TinkerPath, Path]]:
        """Every saved checkpoint of a run, oldest first."""
        found = []
        run = self.run_folder(model_id)
        root = self.root.resolve()
        for kind in KINDS:
            if not (run / kind).resolve().is_relative_to(root):
                continue  # a symbolic link that leads out of the storage
            for folder in (run / kind).glob("*"):
                if folder.name.startswith(".") or not folder.is_dir():
                    continue  # a staging folder (a save in progress, or cut off)
                if self._leads_out(folder):
                    continue  # a link out of the storage, or a folder holding one
                if any((folder / name).is_file() for name in (ADAPTER_FILE, ADAPTER_FILE + ENCRYPTED_SUFFIX)):
                    found.append((TinkerPath(model_id, kind, folder.name), folder))
        return sorted(found, key=lambda item: item[1].stat().st_mtime)

    def delete(self, path: TinkerPath) -> None:
        shutil.rmtree(self.existing_folder(path, encrypted_ok=True, expired_ok=True))

    def remove_expired(self, now: datetime | None = None) -> list[TinkerPath]:
        """Remove every checkpoint whose recorded expiry (:func:`set_expiry`) is at or before ``now`` (UTC; default
        the current time): its folder (adapter, optimizer state, expiry record) is first renamed hidden, so it
        is no longer listed or loaded, then deleted. The paths removed."""
        now = now or datetime.now(timezone.utc)
        removed = []
        for model_id in self.run_ids():
            for path, folder in self.checkpoints(model_id):
                try:
                    expires = expires_at(folder)
                except (OSError, ValueError, KeyError, TypeError):  # an unreadable record is not an expiry
                    continue
                if expires is None or expires > now:
                    continue
                doomed = folder.with_name(f".{folder.name}.expired-{secrets.token_hex(4)}")
                try:
                    folder.rename(doomed)
                except OSError:  # removed or replaced meanwhile
                    continue
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(path)
        return removed

    def copy(self, source: TinkerPath, model_id: str) -> TinkerPath:
        """A byte copy of ``source`` as the same kind and name under run ``model_id``, without its expiry."""
        target = TinkerPath(model_id, source.kind, source.name)
        shutil.copytree(self.existing_folder(source, encrypted_ok=True), self.folder(target),
                        ignore=shutil.ignore_patterns(CHECKPOINT_FILE))
        return target


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_durably(file: Path, text: str) -> None:
    """``file`` holds ``text`` completely or keeps what it held: written beside it, flushed, renamed over it."""
    staging = file.with_name(f".{file.name}.{secrets.token_hex(4)}")
    with open(staging, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, file)
    _fsync(file.parent)


@contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """Write a checkpoint into the yielded staging folder; when the block ends without error its files are
    flushed to disk and it replaces ``folder`` in one rename (a folder there before is removed after). On an
    error, or a kill, ``folder`` is as it was; a staging folder left by a kill is hidden (its name starts with
    a dot) and never listed or loaded."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(4)
    staging = folder.with_name(f".{folder.name}.saving-{tag}")
    staging.mkdir()
    try:
        yield staging
        for file in staging.rglob("*"):
            if file.is_file():
                _fsync(file)
        old = None
        if folder.exists():
            old = folder.with_name(f".{folder.name}.replaced-{tag}")
            folder.rename(old)
        staging.rename(folder)
        _fsync(folder.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_ttl(ttl_seconds: int | None) -> None:
    """``ConfigError`` unless ``ttl_seconds`` is None (no expiry) or within the SDK's bounds (1 hour to
    10 years)."""
    if ttl_seconds is None:
        return
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) \
            or not MIN_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
        raise ConfigError(f"ttl_seconds={ttl_seconds!r} must be None (no expiry) or an int from "
                          f"{MIN_TTL_SECONDS} (1 hour) to {MAX_TTL_SECONDS} (10 years), as the Tinker "
                          "service requires.")


def set_expiry(folder: Path, ttl_seconds: int | None, now: datetime | None = None) -> None:
    """Record that the checkpoint in ``folder`` expires ``ttl_seconds`` from ``now`` (None: never).

    Only recorded: :func:`expires_at` reads it back for listings; nothing deletes the folder when it
    passes."""
    check_ttl(ttl_seconds)
    now = now or datetime.now(timezone.utc)
    expires = None if ttl_seconds is None else (now + timedelta(seconds=ttl_seconds)).isoformat()
    (folder / CHECKPOINT_FILE).write_text(json.dumps({"expires_at": expires}))


def expires_at(folder: Path) -> datetime | None:
    """When the checkpoint in ``folder`` expires, as recorded by :func:`set_expiry`; None for never."""
    file = folder / CHECKPOINT_FILE
    if not file.is_file():
        return None
    recorded = json.loads(file.read_text())["expires_at"]
    return None if recorded is None else datetime.fromisoformat(recorded)


def modified_at(folder: Path) -> datetime:
    return datetime.fromtimestamp(folder.stat().st_mtime, tz=timezone.utc)


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
