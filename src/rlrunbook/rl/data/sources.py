"""Where a data set comes from: a local JSONL file, a folder holding one, or a Hugging Face hub name.

A ``source`` that exists on disk is always read locally, so a local copy wins over the hub even when
its name looks like a hub id. Anything else must be one of the hub names a loader knows; only then
is ``datasets`` imported, so the package works offline without the ``data`` extra.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.errors import ConfigError
from rlrunbook.rl.data.errors import DatasetError

DATA_DIR_ENV = "RLRUNBOOK_DATA_DIR"

# kind -> the file inside <data root>/<kind>/ (the layout of the project's shared/data).
LOCAL_FILES: Mapping[str, str] = {
    "gsm8k": "test.jsonl",
    "nq_open": "NQ-open.dev.jsonl",
    "cnn_dailymail": "cnndm_80.jsonl",
}


@dataclass(frozen=True)
class HubSpec:
    """How one data set is loaded from the hub: ``load_dataset(name, config, split=split)``."""

    name: str
    config: str | None
    split: str
    aliases: tuple[str, ...]


HUB_SPECS: Mapping[str, HubSpec] = {
    "gsm8k": HubSpec("openai/gsm8k", "main", "test", ("gsm8k",)),
    "nq_open": HubSpec("google-research-datasets/nq_open", None, "validation", ("nq_open",)),
    "cnn_dailymail": HubSpec("abisee/cnn_dailymail", "3.0.0", "test", ("cnn_dailymail",)),
}


def default_local_path(kind: str) -> Path | None:
    """The project's local copy of data set ``kind`` (``gsm8k``, ``nq_open``, ``cnn_dailymail``), or None.

    The data root is ``$RLRUNBOOK_DATA_DIR`` when set (and then only that root is looked at, so an
    explicit choice is never silently replaced); otherwise ``shared/data`` beside the repository
    root, the first folder above this package that holds ``pyproject.toml``. None when the file is
    absent, for example in an installed wheel far from any checkout.
    """
    if kind not in LOCAL_FILES:
        raise ConfigError(f"unknown data set kind {kind!r}; choose one of {sorted(LOCAL_FILES)}.")
    root = _data_root()
    if root is None:
        return None
    path = root / kind / LOCAL_FILES[kind]
    return path if path.is_file() else None


def data_roots_searched() -> list[Path]:
    """The data roots :func:`default_local_path` looks in, in order: ``$RLRUNBOOK_DATA_DIR`` alone when set,
    else ``shared/data`` beside each folder above this package that holds ``pyproject.toml`` (the repository
    root, in a checkout). The first root that exists is used."""
    override = os.environ.get(DATA_DIR_ENV, "").strip()
    if override:
        return [Path(override).expanduser()]
    return [folder.parent / "shared" / "data" for folder in Path(__file__).resolve().parents
            if (folder / "pyproject.toml").is_file()]


def _data_root() -> Path | None:
    if os.environ.get(DATA_DIR_ENV, "").strip():
        return data_roots_searched()[0]
    return next((root for root in data_roots_searched() if root.is_dir()), None)


def resolve_local(source: str | os.PathLike) -> Path | None:
    """The JSONL file ``source`` names if it exists on disk (a folder must hold exactly one), else None."""
    path = Path(source).expanduser()
    if not path.exists():
        return None
    if path.is_dir():
        found = sorted(path.glob("*.jsonl"))
        if len(found) != 1:
            listed = ", ".join(p.name for p in found) or "none"
            raise DatasetError(f"{path}: a folder must hold exactly one .jsonl file, found {len(found)} "
                               f"({listed}). Pass the file itself.")
        return found[0]
    return path


def hub_spec_for(kind: str, source: str) -> HubSpec:
    """The hub spec of ``kind`` if ``source`` is one of its names; a missing local file otherwise."""
    spec = HUB_SPECS[kind]
    if source in (spec.name, *spec.aliases):
        return spec
    names = ", ".join(repr(n) for n in (spec.name, *spec.aliases))
    raise DatasetError(f"{source}: no such file or folder, and not a hub name for {kind} ({names}). "
                       f"Check the path; the project's copy is at "
                       f"{default_local_path(kind) or '../shared/data'}.")


def load_hub_rows(spec: HubSpec, split: str | None = None) -> list[dict]:
    """Rows of a hub data set as plain dicts; ``datasets`` is imported only here."""
    split = split or spec.split
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(f"{spec.name}: loading a hub data set needs the 'datasets' package, which is not "
                           "installed. Run `pip install 'rlrunbook[data]'`, or pass a local JSONL path "
                           "(the project's copies live in ../shared/data).") from exc
    try:
        dataset = datasets.load_dataset(spec.name, spec.config, split=split)
    except Exception as exc:  # network, auth and cache failures all mean the same to the user
        raise DatasetError(f"{spec.name} (config {spec.config}, split {split}): load_dataset failed "
                           f"({type(exc).__name__}: {exc}). Without network access pass a local "
                           "JSONL path instead.") from exc
    return [dict(row) for row in dataset]


_TRUTHY = {"1", "on", "yes", "true"}


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot serve a data set now, or None when it is worth asking.

    None also when ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` is set: then ``datasets`` answers from its
    local cache, at once. Otherwise one TCP connection to the endpoint (``HF_ENDPOINT``) within
    ``timeout_s``: without this check ``load_dataset`` retries on its own schedule before giving up.
    """
    if any(os.environ.get(name, "").strip().lower() in _TRUTHY for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None
    try:
        import datasets  # noqa: F401
    except ImportError:
        return "the 'datasets' package is not installed"
    from urllib.parse import urlsplit

    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        return f"no connection to {host}:{port} ({error})"
    return None
