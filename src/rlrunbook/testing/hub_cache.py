"""A Hugging Face cache, written from local folders and files, that hub names resolve in offline mode.

For processes that never import rlrunbook (an unmodified recipe run against ``rlrunbook serve``) and still
load hub models and data sets by name: with ``HF_HOME`` pointing at the folder and ``HF_HUB_OFFLINE=1``,
``transformers``/``huggingface_hub`` find a staged model as a cached snapshot, and ``datasets.load_dataset(NAME)``
(``HF_DATASETS_OFFLINE=1``) finds a staged data set as a prepared cache, exactly as after a real download.

Layouts written (those of ``huggingface_hub`` 0.2x-1.x and ``datasets`` 3-5):

- model ``org/name`` -> ``HF_HOME/hub/models--org--name/{refs/main, snapshots/<rev>/<the folder's files>}``;
- data set ``org/name`` -> ``HF_HOME/datasets/org___name/default/0.0.0/<hash>/`` with one arrow file per split,
  prepared by ``datasets``' own json/parquet/csv builder.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from pathlib import Path

REVISION = "0" * 40  # the snapshot's commit id: any 40 hex digits


def stage_model(hf_home: Path, repo_id: str, folder: Path) -> Path:
    """Cache ``folder``'s files (config, weights, tokenizer) as hub model ``repo_id``; the snapshot folder."""
    if repo_id.count("/") != 1:
        raise ValueError(f"{repo_id!r}: a hub model id is 'org/name'")
    repo = Path(hf_home) / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    if snapshot.exists():
        shutil.rmtree(snapshot)
    shutil.copytree(folder, snapshot, ignore=shutil.ignore_patterns(".*"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def stage_dataset(hf_home: Path, repo_id: str, file: Path, splits: Iterable[str] = ("train", "test")) -> Path:
    """Cache the rows of ``file`` as hub data set ``repo_id``, the same rows as each of ``splits``; the folder.

    A staged data set also streams (``streaming=True`` reads the cached arrow files)."""
    from datasets.data_files import DataFilesDict
    from datasets.load import import_main_class

    file = Path(file).resolve()
    if file.suffix not in _BUILDERS:
        raise ValueError(f"{file}: stage a {', '.join(_BUILDERS)} file")
    namespace, _, name = repo_id.rpartition("/")
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    builder_class = import_main_class(f"datasets.packaged_modules.{_BUILDERS[file.suffix]}."
                                      f"{_BUILDERS[file.suffix]}")
    scratch = Path(hf_home) / "datasets" / ".staging"
    builder = builder_class(cache_dir=str(scratch), dataset_name=_snake_case(name), hash=digest,
                            data_files=DataFilesDict.from_patterns({split: [str(file)] for split in splits}))
    builder.download_and_prepare()
    # The prepared folder sits where datasets' offline lookup of repo_id looks: <namespace>___<name>/<config>/...
    prepared = Path(builder.cache_dir)
    target = Path(hf_home) / "datasets" / "___".join(filter(None, [namespace, _snake_case(name)])) / "default" \
        / prepared.parent.name / prepared.name
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(prepared, target)
    shutil.rmtree(scratch)
    return target


def _snake_case(name: str) -> str:
    """``datasets``' own folder name for a data set name (``OpenThoughts3-1.2M`` -> ``open_thoughts3-1.2_m``)."""
    from datasets.naming import camelcase_to_snakecase

    return camelcase_to_snakecase(name)
