"""Checkpoint folders of a run: ``<run_dir>/checkpoints/step_<k>/``, written atomically, read back verified.

A checkpoint taken after ``k`` completed steps holds everything an exact resume needs::

    step_000004/
      adapter.safetensors   trainable LoRA tensors, keyed by the live model's parameter names
      optimizer.pt          AdamW state_dict (tensors and plain numbers; read with weights_only=True)
      rng.json              Python ``random`` and NumPy MT19937 states
      rng.safetensors       torch CPU generator state, and one tensor per CUDA device (``cuda_<i>``)
      sampler_adapters.safetensors   asynchronous runs only: the snapshots the next batches are sampled
                            from, keyed ``<step>/<parameter name>`` (see rl/training/off_policy.py)
      checkpoint.json       manifest, written last: format version, step, data cursor, config
                            (secret values redacted; ``withheld`` names them), sha256 and size of every
                            other file, and the sha256 of the manifest itself (``manifest_sha256``, format 2)

A full-parameter run sharded over W ranks (torchrun) writes no ``adapter.safetensors``/``optimizer.pt``: each
rank writes its own shards of the float32 weights and of AdamW's state, and the manifest says ``shards: W``::

      shard_00000_of_00002.safetensors   rank 0's shards: ``weights/<name>``, ``optimizer/<key>/<name>``; the
      shard_00001_of_00002.safetensors   optimizer's param_groups as JSON in the file's metadata

A resume at the same world size reads each rank's own file only; any other reader (another world size, one
process, ``eval-checkpoints``) joins the shards into whole tensors (first dimensions in rank order: how FSDP2
shards), so the checkpoint loads anywhere. Every rank writes into one staging folder, rank 0 last, then the
manifest and the rename as below.

Nothing here unpickles: safetensors, JSON, and ``torch.load(weights_only=True)`` only.

Atomicity: the files go into ``checkpoints/.tmp-step_<k>-<random>/``, each fsynced, then the folder
is renamed to ``step_<k>`` in one ``os.rename``. A crash (or an error) before the rename leaves a
hidden temp folder that readers ignore and the next save deletes; the checkpoints before it are
untouched. A folder counts as a checkpoint when its name is ``step_<k>`` and its manifest is there;
:func:`verify_checkpoint` also checks every file's checksum and the manifest's own, so a truncated or edited
file, config included, is refused. The manifest's checksum is the sha256 of its canonical JSON
(:func:`manifest_sha256`: sorted keys, no spaces) without the ``manifest_sha256`` key. Format 1 (before that
key) is still read: its data files are verified, its manifest cannot be.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlrunbook.errors import InputError
from rlrunbook.run.jsonio import fsync_dir
from rlrunbook.run.redaction import redact_config, withheld_paths

FORMAT_VERSION = 2  # bump when the layout changes; versions not in READABLE_VERSIONS are refused, not guessed at
READABLE_VERSIONS = (1, 2)  # 1: no manifest_sha256 (its manifest is read unverified)
MANIFEST_CHECKSUM = "manifest_sha256"
CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "checkpoint.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_JSON_FILE = "rng.json"
RNG_TENSOR_FILE = "rng.safetensors"
SAMPLER_ADAPTERS_FILE = "sampler_adapters.safetensors"
TEMP_PREFIX = ".tmp-"
_SHARD_PARAM_GROUPS = "param_groups"  # the shard file's metadata key of the optimizer's param_groups (JSON)
_STEP_DIR = re.compile(r"step_(\d{6,})")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint in memory. ``step`` is the number of completed steps, hence the next step to run;
    ``data_cursor`` the next problem in the run's (seeded) order and the skipped-steps-in-a-row count."""

    step: int
    config: dict[str, Any]
    adapter: dict[str, torch.Tensor]
    optimizer: dict | None
    rng: dict[str, Any]
    weights_version: int = 0
    path: Path | None = None
    # Where the data order stands (``rl.setup.data_order.DataCursor``): with dynamic sampling a step may
    # draw more problems than it trains on, so the step index alone does not say which problem is next.
    data_cursor: dict[str, int] | None = None
    # An asynchronous run's in-flight sampler weights, by the step whose weights they are (empty: synchronous).
    sampler_adapters: dict[int, dict[str, torch.Tensor]] | None = None
    # The dotted config keys whose values the manifest withheld (secret-named, or holding a credential): a resume
    # takes each again. None for a manifest written before the list existed (then only secret-named keys were).
    withheld: tuple[str, ...] | None = None
    # (rank, world): ``adapter`` and ``optimizer`` hold that rank's shards of a full-parameter state sharded over
    # ``world`` ranks (see the module docstring); None: whole tensors.
    shard: tuple[int, int] | None = None


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def shard_file_name(rank: int, world: int) -> str:
    return f"shard_{rank:05d}_of_{world:05d}.safetensors"


def sharded_staging(run_dir: str | os.PathLike[str], step: int) -> Path:
    """The folder every rank writes its shard file into before rank 0 finishes a sharded checkpoint of ``step``
    (one name, so each rank knows it without a message)."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"{TEMP_PREFIX}{step_dir_name(step)}-shards"


def stage_sharded(run_dir: str | os.PathLike[str], step: int) -> Path:
    """Rank 0, before the ranks write their shards: remove stale temp folders, refuse an existing ``step_<k>``,
    create :func:`sharded_staging`'s folder."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(exist_ok=True)
    remove_stale_temps(root)
    _refuse_existing(root / step_dir_name(step))
    staging = sharded_staging(run_dir, step)
    staging.mkdir()
    return staging


def write_shard(folder: Path, rank: int, world: int, weights: dict[str, torch.Tensor], optimizer: dict | None) -> str:
    """Write one rank's shards (``sharding.local_state``'s output) into ``folder`` (fsynced); the file's name."""
    tensors = {f"weights/{name}": t.detach().to("cpu").contiguous() for name, t in weights.items()}
    metadata = {}
    if optimizer is not None:
        for name, entry in optimizer["state"].items():
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {name}/{key} is {type(value).__name__}, not a tensor")
                tensors[f"optimizer/{key}/{name}"] = value.detach().to("cpu").contiguous()
        metadata[_SHARD_PARAM_GROUPS] = json.dumps(optimizer["param_groups"], allow_nan=False)
    name = shard_file_name(rank, world)
    save_file(tensors, str(folder / name), metadata=metadata)
    _fsync_file(folder / name)
    return name


def _read_shard(path: Path, map_location) -> tuple[dict[str, torch.Tensor], dict | None]:
    """One rank's (weights, optimizer state) from its shard file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(map_location)) as handle:
        groups = (handle.metadata() or {}).get(_SHARD_PARAM_GROUPS)
        weights, state = {}, {}
        for key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            kind, _, rest = key.partition("/")
            if kind == "weights" and rest:
                weights[rest] = handle.get_tensor(key)
            elif kind == "optimizer" and "/" in rest:
                field, _, name = rest.partition("/")
                state.setdefault(name, {})[field] = handle.get_tensor(key)
            else:
                raise ValueError(f"tensor {key!r} is neither weights/<name> nor optimizer/<key>/<name>")
    if groups is None:
        if state:
            raise ValueError("optimizer tensors without their param_groups")
        return weights, None
    return weights, {"state": state, "param_groups": json.loads(groups)}


def join_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor of the ranks' shards of it, in rank order (FSDP2 shards along the first dimension,
    ``torch.chunk``-wise); a tensor without dimensions (AdamW's step count) is every rank's alike: rank 0's."""
    return shards[0].clone() if shards[0].dim() == 0 else torch.cat(shards, dim=0)


def _joined(parts: list[tuple[dict, dict | None]]) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Whole tensors from every rank's shards (:func:`join_shards`)."""
    names = parts[0][0].keys()
    if any(weights.keys() != names for weights, _ in parts):
        raise ValueError("the ranks' shard files name different weights")
    weights = {name: join_shards([w[name] for w, _ in parts]) for name in names}
    if parts[0][1] is None:
        return weights, None
    state = {name: {key: join_shards([o["state"][name][key] for _, o in parts]) for key in entry}
             for name, entry in parts[0][1]["state"].items()}
    return weights, {"state": state, "param_groups": parts[0][1]["param_groups"]}


def checkpoint_dirs(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoints/step_<k>`` folder with a manifest, by step; temp folders
    of an interrupted save are left out. Checksums are not read here: see :func:`verify_checkpoint`."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        match = _STEP_DIR.fullmatch(folder.name)
        if match and folder.is_dir() and (folder / MANIFEST_FILE).is_file():
            found.append((int(match.group(1)), folder))
    return sorted(found)


# --- RNG states ---------------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """The global generators' states: Python ``random``, NumPy's legacy generator, torch CPU and CUDA."""
    version, state, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    rng: dict[str, Any] = {
        "python": {"version": version, "state": list(state), "gauss_next": gauss},
        "numpy": {"bit_generator": name, "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    """Set the global generators to ``rng`` (from :func:`capture_rng`). CUDA states are restored when
    this machine has as many devices; a checkpoint from a GPU machine resumed on CPU skips them."""
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    nps = rng["numpy"]
    np.random.set_state((nps["bit_generator"], np.asarray(nps["key"], dtype=np.uint32), nps["pos"],
                         nps["has_gauss"], nps["cached_gaussian"]))
    torch.set_rng_state(rng["torch_cpu"])
    if rng["cuda"] and torch.cuda.is_available() and torch.cuda.device_count() == len(rng["cuda"]):
        torch.cuda.set_rng_state_all(rng["cuda"])


# --- writing ------------------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _write_json(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document, indent=1, allow_nan=False), encoding="utf-8")


def _write_payload(folder: Path, checkpoint: Checkpoint) -> list[str]:
    """The data files of ``checkpoint`` in ``folder``; returns their names (the manifest comes after). A sharded
    checkpoint (rank 0's) writes rank 0's shard file; the other ranks' must be in ``folder`` already."""
    if checkpoint.shard is not None:
        rank, world = checkpoint.shard
        write_shard(folder, rank, world, checkpoint.adapter, checkpoint.optimizer)
        names = [shard_file_name(r, world) for r in range(world)]
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise InputError(f"a sharded checkpoint lacks the shard files {missing[:3]} of other ranks in {folder}")
    else:
        save_file({name: t.detach().to("cpu").contiguous() for name, t in checkpoint.adapter.items()},
                  str(folder / ADAPTER_FILE))
        names = [ADAPTER_FILE]
        if checkpoint.optimizer is not None:
            torch.save(checkpoint.optimizer, folder / OPTIMIZER_FILE)
            names.append(OPTIMIZER_FILE)
    rng = checkpoint.rng
    _write_json(folder / RNG_JSON_FILE, {"python": rng["python"], "numpy": rng["numpy"]})
    tensors = {"torch_cpu": rng["torch_cpu"], **{f"cuda_{i}": s for i, s in enumerate(rng["cuda"])}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / RNG_TENSOR_FILE))
    names += [RNG_JSON_FILE, RNG_TENSOR_FILE]
    if checkpoint.sampler_adapters:
        save_file({f"{step}/{name}": t.detach().to("cpu").contiguous()
                   for step, adapter in checkpoint.sampler_adapters.items() for name, t in adapter.items()},
                  str(folder / SAMPLER_ADAPTERS_FILE))
        names.append(SAMPLER_ADAPTERS_FILE)
    return names


def manifest_sha256(manifest: dict[str, Any]) -> str:
    """The sha256 of ``manifest`` without its ``manifest_sha256`` key, as canonical JSON (sorted keys, no spaces,
    ASCII): what a format-2 manifest records of itself. Python's JSON round trip keeps every value exact."""
    body = {key: value for key, value in manifest.items() if key != MANIFEST_CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _write_manifest(folder: Path, checkpoint: Checkpoint, names: list[str]) -> None:
    files = {name: {"sha256": _sha256(folder / name), "bytes": (folder / name).stat().st_size} for name in names}
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": checkpoint.step,
        "data_cursor": {"next_step": checkpoint.step, **(checkpoint.data_cursor or {})},
        "weights_version": checkpoint.weights_version,
        "has_optimizer": checkpoint.optimizer is not None,
        **({"shards": checkpoint.shard[1]} if checkpoint.shard is not None else {}),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # Secrets are never stored: a resume takes them again from the command line or the environment.
        "config": redact_config(checkpoint.config),
        "withheld": withheld_paths(checkpoint.config),
        "files": files,
    }
    _write_json(folder / MANIFEST_FILE, {**manifest, MANIFEST_CHECKSUM: manifest_sha256(manifest)})


def remove_stale_temps(checkpoints_dir: Path) -> list[Path]:
    """Delete the temp folders that interrupted saves left behind; returns what was removed."""
    stale = [p for p in checkpoints_dir.glob(f"{TEMP_PREFIX}*") if p.is_dir()] if checkpoints_dir.is_dir() else []
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale


def _refuse_existing(final: Path) -> None:
    if final.exists():
        raise InputError(f"checkpoint {final} exists already: a run saves each step once; "
                         "resume into a new run directory instead of writing into an old one.")


def save_checkpoint(run_dir: str | os.PathLike[str], checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` as ``<run_dir>/checkpoints/step_<k>/`` atomically (see the module docstring). A sharded
    one (``checkpoint.shard`` = (0, W), rank 0's state) is finished in :func:`stage_sharded`'s folder, where the
    other ranks wrote their shard files.

    An existing ``step_<k>`` is never replaced (``InputError``): a run writes each step once.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / step_dir_name(checkpoint.step)
    if checkpoint.shard is not None:
        temp = sharded_staging(run_dir, checkpoint.step)
        _refuse_existing(final)
    else:
        root.mkdir(exist_ok=True)
        remove_stale_temps(root)
        _refuse_existing(final)
        # Not cleaned up on error: an exception here leaves what a crash would, and the next save removes it.
        temp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{final.name}-", dir=root))
    names = _write_payload(temp, checkpoint)
    for name in names:
        _fsync_file(temp / name)
    _write_manifest(temp, checkpoint, names)
    _fsync_file(temp / MANIFEST_FILE)
    fsync_dir(temp)
    os.rename(temp, final)
    fsync_dir(root)
    return final


# --- reading ------------------------------------------------------------------------------------------------

def _corrupt(folder: Path, what: str) -> InputError:
    return InputError(f"checkpoint {folder} is corrupted or incomplete: {what}. Resume from another checkpoint "
                      f"(pass its folder to --resume-from, or delete this one to fall back to the previous).")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a manifest (before any file is trusted), or None."""
    if not _is_int(manifest.get("step")) or manifest["step"] < 0:
        return f"{MANIFEST_FILE} has no step count (a whole number >= 0): {manifest.get('step')!r}"
    if not isinstance(manifest.get("has_optimizer"), bool):
        return f"{MANIFEST_FILE} does not say whether it holds the optimizer (has_optimizer: true or false)"
    if not isinstance(manifest.get("config"), dict):
        return f"{MANIFEST_FILE} holds no config (an object)"
    if not isinstance(manifest.get("data_cursor", {}), (dict, type(None))):
        return f"{MANIFEST_FILE} has a data_cursor that is not an object"
    if not _is_int(manifest.get("weights_version", 0)):
        return f"{MANIFEST_FILE} has a weights_version that is not a whole number"
    shards = manifest.get("shards")
    if shards is not None and (not _is_int(shards) or shards < 1):
        return f"{MANIFEST_FILE} has a shard count that is not a whole number >= 1: {shards!r}"
    files = manifest.get("files")
    if shards is None:
        required = {ADAPTER_FILE} | ({OPTIMIZER_FILE} if manifest["has_optimizer"] else set())
    else:
        required = {shard_file_name(rank, shards) for rank in range(shards)}
    required |= {RNG_JSON_FILE, RNG_TENSOR_FILE}
    if not isinstance(files, dict) or not required <= files.keys():
        return f"{MANIFEST_FILE} lacks the checksums of {sorted(required)}"
    for name, expected in files.items():
        if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
            return f"{MANIFEST_FILE} lists {name!r}, which is not a file name inside the checkpoint"
        if not (isinstance(expected, dict) and isinstance(expected.get("sha256"), str) and _is_int(expected.get("bytes"))):
            return f"{MANIFEST_FILE} has no sha256 and size for {name}"
    return None


def verify_checkpoint(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of ``folder`` after checking its format version, its own sha256 (format 2), its fields and
    every file's size and sha256."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        raise _corrupt(folder, f"no {MANIFEST_FILE} (a save that never finished, or not a checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _corrupt(folder, f"{MANIFEST_FILE} is not readable JSON ({error})") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS or not _is_int(version):
        raise InputError(f"checkpoint {folder} has format version {version!r}; this rlrunbook reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}. Load it with the rlrunbook version that wrote it.")
    if version >= 2 and manifest.get(MANIFEST_CHECKSUM) != manifest_sha256(manifest):
        raise _corrupt(folder, f"{MANIFEST_FILE} does not match its own sha256 ({MANIFEST_CHECKSUM}): it was edited "
                               "or damaged after it was written, so its config and step cannot be trusted")
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise _corrupt(folder, problem)
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise _corrupt(folder, f"{name} is missing")
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            raise _corrupt(folder, f"{name} does not match its sha256 in {MANIFEST_FILE} (truncated or modified)")
    match = _STEP_DIR.fullmatch(folder.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise _corrupt(folder, f"the folder name says step {int(match.group(1))}, the manifest {manifest['step']}")
    return manifest


def _read(folder: Path, name: str, reader: Callable[[Path], Any]) -> Any:
    try:
        return reader(folder / name)
    except (OSError, SafetensorError, RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError,
            OverflowError) as error:
        raise _corrupt(folder, f"{name} cannot be read ({type(error).__name__}: {error})") from None


def _check_rng_json(rng: Any) -> None:
    """Set fresh generators (never the global ones) to the saved Python and NumPy states: a state they refuse
    raises here, while the checkpoint is read, not in :func:`restore_rng` after the model has loaded."""
    python, numpy = rng["python"], rng["numpy"]
    random.Random().setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
    np.random.RandomState().set_state((numpy["bit_generator"], np.asarray(numpy["key"], dtype=np.uint32),
                                       numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))


def load_checkpoint(folder: str | os.PathLike[str], map_location: str | torch.device = "cpu", *,
                    shard: tuple[int, int] | None = None) -> Checkpoint:
    """Verify and read ``folder``; ``InputError`` naming the file and the fix if anything is off.

    A sharded checkpoint is read as rank ``shard`` = (rank, world)'s shards when it was written by that many
    ranks (the returned checkpoint's ``shard``), else joined into whole tensors."""
    folder = Path(folder)
    manifest = verify_checkpoint(folder)
    shards, kept = manifest.get("shards"), None
    if shards is None:
        adapter = _read(folder, ADAPTER_FILE, lambda p: load_file(str(p), device=str(map_location)))
        optimizer = None
        if manifest["has_optimizer"]:
            optimizer = _read(folder, OPTIMIZER_FILE,
                              lambda p: torch.load(p, map_location=map_location, weights_only=True))
    elif shard is not None and shard[1] == shards:
        adapter, optimizer = _read(folder, shard_file_name(*shard), lambda p: _read_shard(p, map_location))
        kept = shard
    else:
        parts = [_read(folder, name, lambda p: _read_shard(p, map_location))
                 for name in (shard_file_name(rank, shards) for rank in range(shards))]
        adapter, optimizer = _read(folder, shard_file_name(0, shards), lambda p: _joined(parts))
    if (optimizer is not None) != manifest["has_optimizer"]:
        raise _corrupt(folder, f"{MANIFEST_FILE} says has_optimizer {manifest['has_optimizer']}, the files disagree")
    rng = _read(folder, RNG_JSON_FILE, lambda p: json.loads(p.read_text(encoding="utf-8")))
    tensors = _read(folder, RNG_TENSOR_FILE, lambda p: load_file(str(p)))
    _read(folder, RNG_JSON_FILE, lambda p: _check_rng_json(rng))
    _read(folder, RNG_TENSOR_FILE, lambda p: torch.Generator().set_state(tensors["torch_cpu"]))
    cuda_count = sum(1 for key in tensors if key.startswith("cuda_"))
    rng.update(torch_cpu=tensors["torch_cpu"], cuda=[tensors[f"cuda_{i}"] for i in range(cuda_count)])
    sampler_adapters: dict[int, dict[str, torch.Tensor]] = {}
    if SAMPLER_ADAPTERS_FILE in manifest["files"]:
        sampler_adapters = _read(folder, SAMPLER_ADAPTERS_FILE,
                                 lambda p: _by_step(load_file(str(p), device=str(map_location))))
    return Checkpoint(step=manifest["step"], config=manifest["config"], adapter=adapter, optimizer=optimizer,
                      rng=rng, weights_version=int(manifest.get("weights_version", 0)), path=folder,
                      data_cursor=manifest.get("data_cursor") or None, sampler_adapters=sampler_adapters or None,
                      withheld=_withheld(folder, manifest), shard=kept)


def _by_step(flat: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """``{"<step>/<parameter>": tensor}`` as ``{step: {parameter: tensor}}``; ValueError for any other key."""
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        step, slash, name = key.partition("/")
        if not (slash and step.isdigit() and name):
            raise ValueError(f"tensor {key!r} is not named <step>/<parameter>")
        snapshots.setdefault(int(step), {})[name] = tensor
    return snapshots


def _withheld(folder: Path, manifest: dict[str, Any]) -> tuple[str, ...] | None:
    """The manifest's ``withheld`` keys (None where an older manifest has no list)."""
    withheld = manifest.get("withheld")
    if withheld is None:
        return None
    if not isinstance(withheld, list) or not all(isinstance(key, str) for key in withheld):
        raise _corrupt(folder, f"{MANIFEST_FILE}'s 'withheld' is {withheld!r}, not a list of config keys")
    return tuple(withheld)
