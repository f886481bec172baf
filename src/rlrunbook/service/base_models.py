"""Which base models a server loads for its clients: named at start (``rlrunbook serve --base-models``).

Each value of ``--base-models`` is a folder on the server's disk, whose model folders (any folder inside it,
itself included) may be loaded by their path, or a name the project's model registry resolves
(:func:`rlrunbook.models.resolve_model`: a built-in such as ``tiny``, or a Hugging Face repo id, fetched where
the network allows). Without the option the server loads what it could load offline before it was asked: the
built-in names, the model folders of rlrunbook's cache (where ``rlrunbook resolve-model NAME`` builds a
built-in, so the folder it prints may be named), and the models already in the Hugging Face cache (by repo id
or by their folder there). Any other base model, an arbitrary folder of the server's disk included, is refused
with 400 naming the option, before anything is read from it; the refusal does not say whether such a folder
exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.errors import RlrunbookError
from rlrunbook.models import BUILTIN_MODELS, default_cache_dir


class BaseModelRefusedError(RlrunbookError, PermissionError):
    """A base model this server does not offer (HTTP 400 naming ``--base-models``)."""


def _hub_cache() -> Path | None:
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return Path(constants.HF_HUB_CACHE)


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds ``repo_id``'s ``config.json`` (read offline; never fetched)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - a name that is not a repo id is simply not in the cache
        return False


@dataclass(frozen=True)
class BaseModels:
    """The base models a server offers.

    Attributes:
        names: registry names and repo ids that may be loaded by name.
        folders: folders (resolved) inside which any model folder may be loaded by its path.
        cached_hub_ids: also any repo id already in the Hugging Face cache (the default without the option).
    """

    names: frozenset[str]
    folders: tuple[Path, ...]
    cached_hub_ids: bool = False

    @classmethod
    def from_option(cls, values: Iterable[str] | None) -> BaseModels:
        """The policy of ``--base-models VALUES`` (each an existing folder, else a name); None: the default."""
        if values is None:
            folders = [default_cache_dir() / "models"]
            hub = _hub_cache()
            if hub is not None:
                folders.append(hub)
            return cls(frozenset(BUILTIN_MODELS), tuple(f.resolve() for f in folders), cached_hub_ids=True)
        values = [value.strip() for value in values if value.strip()]
        folders = tuple(Path(v).expanduser().resolve() for v in values if Path(v).expanduser().is_dir())
        names = frozenset(v for v in values if not Path(v).expanduser().is_dir())
        return cls(names, folders)

    def check(self, name: str | None) -> None:
        """Nothing for a base model this server offers (None: none named); ``BaseModelRefusedError`` otherwise."""
        if name is None or name in self.names:
            return
        folder = Path(name).expanduser()
        if folder.is_dir():
            resolved = folder.resolve()
            if any(resolved.is_relative_to(allowed) for allowed in self.folders):
                return
        elif self.cached_hub_ids and _in_hub_cache(name):
            return
        offered = ", ".join(sorted(self.names)[:12]) or "no names"
        folders = f" and the model folders inside {len(self.folders)} folder(s)" if self.folders else ""
        cached = " and the models already in its Hugging Face cache" if self.cached_hub_ids else ""
        shown = repr(name) if len(name) <= 200 else repr(name[:197] + "...")
        raise BaseModelRefusedError(
            f"base model {shown} is not one this server loads: it offers {offered}{folders}{cached} (rlrunbook "
            "serve --base-models); name one of them, or ask the server's operator to add it to --base-models.")
