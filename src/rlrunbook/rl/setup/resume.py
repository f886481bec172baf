"""Checkpoints of a training run and exact resume (``--checkpoint-every N``, ``--resume-from PATH``).

The loop calls :meth:`CheckpointSchedule.save_if_due` after each step and, for a resumed run, :func:`plan_resume`
before anything loads, :meth:`Resume.check_dataset` once the data set is loaded,
:meth:`Resume.begin` once the new run directory exists and :meth:`Resume.restore` once the
training client exists. The file format is in
:mod:`rlrunbook.run.checkpoint_format`.

Why a resumed run repeats the straight run exactly: the adapter and AdamW state are restored bit
for bit; problems are drawn from ``order`` (a pure function of the seed) at the data cursor, which
the checkpoint stores (dynamic sampling may draw more than ``num_groups`` problems in a step, see
:mod:`rlrunbook.rl.training.dynamic_sampling`); every sampling request is seeded with
``mix_seed(seed, step, group)`` and the sampler's noise is counter-based, so the same weights draw
the same tokens; the global RNGs (not used by the single-turn loop, but perhaps by plug-ins)
are restored too.

A resumed run takes the checkpoint's config. Only ``steps`` (to extend the run), ``name`` and
``log_root`` may differ; any other option stated on the command line, in a file or an override
with another value is refused. It writes a new run directory that starts with copies of the old
run's records of the steps before the checkpoint; the old directory is only read.

Secret values (config keys such as ``extra.api_key``, and values holding a credential under any key, such
as ``extra.openai_key=sk-...``; see :mod:`rlrunbook.run.redaction`) are never stored in a checkpoint, so
they are not compared either: a resumed run takes each one again from the command line
(``extra.api_key=...``), else from the environment (``RLRUNBOOK_EXTRA_API_KEY``), and refuses to start,
naming both, when neither gives it. The checkpoint lists them (``withheld``); one written before that list
existed withheld the secret-named keys only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlrunbook import distributed
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.config_sources import flatten, leaf_keys
from rlrunbook.rl.setup.data_order import DataCursor
from rlrunbook.run.checkpoint_format import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    Checkpoint,
    capture_rng,
    checkpoint_dirs,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    sharded_staging,
    stage_sharded,
    write_shard,
)
from rlrunbook.run.redaction import (
    REDACTED,
    is_secret_path,
    redact_config,
    redacted_paths,
    secret_env_name,
    secret_from_environment,
)
from rlrunbook.run.schema import METADATA_FILE, rollout_kind
from rlrunbook.run.writer import step_records

RESUMABLE_FIELDS = ("steps", "name", "log_root")  # what a resumed run may change


def _exporter(training):
    export = getattr(type(training), "export_training_state", None)
    if export is None:
        raise ConfigError("checkpoint.every / --resume-from need the local backend's training state export "
                          "(TINKER_BACKEND=local); on the hosted service use save_state() instead.")
    return training


@dataclass(frozen=True)
class CheckpointSchedule:
    """When a run saves checkpoints (``checkpoint.every``, and after the last of ``steps``) and the
    config each one records."""

    every: int
    steps: int
    config_record: dict[str, Any]

    @classmethod
    def of(cls, config: TrainConfig) -> CheckpointSchedule:
        return cls(config.checkpoint.every, config.steps, config.to_dict())

    def due(self, completed: int) -> bool:
        """Whether a checkpoint is taken after ``completed`` steps: every ``every``, and after the last."""
        return self.every > 0 and (completed % self.every == 0 or completed == self.steps)

    def save_if_due(self, training, run_dir: Path, completed: int, cursor: DataCursor, log=print,
                    sampler_adapters: dict[int, dict] | None = None) -> Path | None:
        """Save ``<run_dir>/checkpoints/step_<completed>`` when :meth:`due`; the saved folder or None.

        ``cursor``: where the data order stands after ``completed`` steps (an asynchronous run: before the
        batch of step ``completed``, which may have been sampled already). ``sampler_adapters`` (an asynchronous
        run): the snapshots its next batches are sampled from, by step (rl/training/off_policy.py).

        Under torchrun every rank calls it: a sharded full-parameter state is written by every rank (its shards),
        anything else by rank 0 (a LoRA adapter is every rank's alike)."""
        if not self.due(completed):
            return None
        state = _exporter(training).export_training_state(sharded=True)
        if state.shard is None and not distributed.is_main():
            return None
        checkpoint = Checkpoint(step=completed, config=self.config_record, adapter=state.adapter,
                                optimizer=state.optimizer, rng=capture_rng(), weights_version=state.weights_version,
                                data_cursor=cursor.to_dict(), sampler_adapters=sampler_adapters or None,
                                shard=state.shard)
        if state.shard is None:
            folder = save_checkpoint(run_dir, checkpoint)
        else:  # rank 0 stages, the others write their shards into it, rank 0 writes its own and finishes
            rank, world = state.shard
            _together(lambda: stage_sharded(run_dir, completed) if rank == 0 else None)
            _together(lambda: write_shard(sharded_staging(run_dir, completed), rank, world, state.adapter,
                                          state.optimizer) if rank else None)
            folder = _together(lambda: save_checkpoint(run_dir, checkpoint) if rank == 0 else None)
            if folder is None:
                return None
        log(f"[checkpoint] {folder}")
        return folder


def _together(part: Callable[[], Any]) -> Any:
    """``part()`` on this rank, and the ranks' outcomes shared: a rank that failed raises its own error, every
    other rank a ``ConfigError`` naming the first failure (none goes on to wait for a rank that stopped)."""
    error = None
    try:
        result = part()
    except Exception as caught:  # noqa: BLE001 - shared with the other ranks, then raised
        error, result = caught, None
    failures = [f for f in distributed.gather_objects(None if error is None else f"{type(error).__name__}: {error}")
                if f is not None]
    if error is not None:
        raise error
    if failures:
        raise ConfigError(f"another rank could not write its part of the checkpoint: {failures[0]}")
    return result


def find_checkpoint(path: str | Path) -> Path:
    """``path`` if it is a checkpoint folder; the latest checkpoint if it is a run directory."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"--resume-from {path} does not exist. Pass a run directory (logs/<run>) or one of "
                          "its checkpoints (logs/<run>/checkpoints/step_000004).")
    if path.is_dir() and ((path.parent.name == CHECKPOINTS_DIR and path.name.startswith("step_"))
                          or (path / MANIFEST_FILE).is_file()):
        return path
    if path.is_dir() and (path / METADATA_FILE).is_file():
        found = checkpoint_dirs(path)
        if not found:
            raise ConfigError(f"run {path} has no complete checkpoint (no checkpoints/step_<k>/checkpoint.json): "
                              "it ran without --checkpoint-every, or died before the first save. Start a new run "
                              "with --checkpoint-every N.")
        return found[-1][1]
    raise ConfigError(f"--resume-from {path} is neither a run directory (no {METADATA_FILE}) nor a checkpoint "
                      "(logs/<run>/checkpoints/step_<k>). Pass one of those.")


def _stated(config: TrainConfig, sources: Mapping[str, str]) -> set[str]:
    """Dotted keys the caller set explicitly: by their sources, else those that differ from the defaults."""
    if sources:
        return {key for key, origin in sources.items() if origin != "default"}
    ours, defaults = flatten(config.to_dict()), flatten(TrainConfig().to_dict())
    return {key for key in leaf_keys() if ours.get(key) != defaults.get(key)}


def _value(flat: Mapping[str, Any], key: str) -> Any:
    if key.startswith("extra."):
        node: Any = flat.get("extra") or {}
        for part in key.removeprefix("extra.").split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        return node
    return flat.get(key)


def _with_value(tree: Mapping[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of the nested ``tree`` with ``dotted`` set to ``value``."""
    head, _, rest = dotted.partition(".")
    out = dict(tree)
    out[head] = _with_value(tree.get(head) or {}, rest, value) if rest else value
    return out


def withheld_keys(stored: Mapping[str, Any], withheld: tuple[str, ...] | None) -> list[str]:
    """The keys of the checkpoint's config whose values it withheld: its ``withheld`` list, or for an older
    checkpoint without one the secret-named keys that read ``<redacted>`` (a value that merely reads so under
    another name is data, not a withheld secret)."""
    if withheld is not None:
        return [key for key in withheld if _value(flatten(stored), key) == REDACTED]
    return [key for key in redacted_paths(stored) if is_secret_path(key)]


def _restore_secrets(stored: Mapping[str, Any], requested: TrainConfig, stated: set[str],
                     environ: Mapping[str, str],
                     withheld: tuple[str, ...] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The checkpoint's config with each withheld secret filled from the command line or the environment,
    and the source of each (``cli``/``override``/... or ``env:<NAME>``); ``ConfigError`` if one is missing."""
    new = flatten(requested.to_dict())
    filled, sources = dict(stored), {}
    for key in withheld_keys(stored, withheld):
        if any(key == given or key.startswith(f"{given}.") for given in stated):  # extra.api_key, or all of extra
            value, origin = _value(new, key), "cli"
        else:
            value, origin = secret_from_environment(key, environ), f"env:{secret_env_name(key)}"
        if value is None:
            raise ConfigError(
                f"--resume-from: {key} is a secret, so the checkpoint does not hold its value. Pass it again "
                f"({key}=...) or set {secret_env_name(key)} in the environment.")
        filled = _with_value(filled, key, value)
        sources[key] = origin
    return filled, sources


def resumed_config(stored: Mapping[str, Any], requested: TrainConfig, sources: Mapping[str, str],
                   origin: str, environ: Mapping[str, str] | None = None,
                   withheld: tuple[str, ...] | None = None) -> tuple[TrainConfig, dict[str, str]]:
    """The checkpoint's config with the allowed changes of ``requested`` applied, and each value's source.

    ``ConfigError`` naming the field if ``requested`` states another value for any other field. Secret
    keys the checkpoint withheld (``withheld``, the manifest's list; see :func:`withheld_keys`) are filled
    from ``requested`` or ``environ`` (default ``os.environ``).
    """
    stated = _stated(requested, sources)
    secret_keys = set(withheld_keys(stored, withheld))
    stored, secret_sources = _restore_secrets(stored, requested, stated, environ if environ is not None
                                              else os.environ, withheld)
    stored_config = TrainConfig.from_stored(stored)
    # Compared redacted: a secret is never stored, so the value given now is the one used.
    old = flatten(redact_config(stored_config.to_dict()))
    new = flatten(redact_config(requested.to_dict()))
    for key in sorted(stated - set(RESUMABLE_FIELDS)):
        if is_secret_path(key) or any(key == s or key.startswith(f"{s}.") or s.startswith(f"{key}.")
                                      for s in secret_keys):
            continue
        if _value(old, key) != _value(new, key):
            raise ConfigError(
                f"--resume-from: {key} is {_value(new, key)!r} here but {_value(old, key)!r} in the checkpoint's "
                f"config; a resumed run keeps its config (it may change only {', '.join(RESUMABLE_FIELDS)}). "
                f"Drop {key} from the command line, or start a new run."
            )
    changes = {key: getattr(requested, key) for key in RESUMABLE_FIELDS if key in stated}
    config = stored_config.replace(**changes)
    record = {key: (sources.get(key, "cli") if key in stated else origin) for key in leaf_keys()}
    record.update({key: sources.get(key, value) if value == "cli" else value for key, value in secret_sources.items()})
    return config, record


@dataclass(frozen=True)
class Resume:
    """A planned resume: the verified checkpoint, the run it belongs to, and the config to run."""

    checkpoint: Checkpoint
    source_run: Path
    config: TrainConfig
    sources: dict[str, str]

    @property
    def step(self) -> int:
        return self.checkpoint.step

    def record(self) -> dict[str, Any]:
        """What ``run_metadata.json`` records as ``resumed_from``."""
        return {"path": str(self.checkpoint.path), "run": str(self.source_run), "step": self.step}

    def check_dataset(self, dataset: Mapping[str, Any]) -> None:
        """``ConfigError`` if the data set's fingerprint differs from the one the old run recorded."""
        old = source_metadata(self.source_run).get("dataset") or {}
        if old.get("fingerprint") and dataset.get("fingerprint") != old["fingerprint"]:
            raise ConfigError(f"the data set changed since {self.source_run} ran (fingerprint "
                              f"{dataset.get('fingerprint')} vs {old['fingerprint']}): the resumed steps would "
                              "train on other problems. Restore the data set the run used.")

    def begin(self, writer) -> None:
        """Start the new run directory with copies of the old run's records of the steps before ``step``."""
        writer.copy_steps_from(self.source_run, self.step, rollout_kind(self.config.mode, self.config.env))

    def cursor(self) -> DataCursor:
        """Where the data order stands at the checkpoint (see :class:`DataCursor`)."""
        return DataCursor.from_checkpoint(self.checkpoint.data_cursor, self.step, self.config.num_groups)

    def restore(self, training) -> int:
        """Load the adapter, optimizer and RNG states into ``training``; the first step to run."""
        from rlrunbook.backend.trainer import TrainingState

        ckpt = self.checkpoint
        _exporter(training).import_training_state(
            TrainingState(ckpt.adapter, ckpt.optimizer, ckpt.weights_version, shard=ckpt.shard), with_optimizer=True)
        restore_rng(ckpt.rng)
        return ckpt.step


def source_metadata(source_run: Path) -> dict[str, Any]:
    """The ``run_metadata.json`` of the run being resumed; ``InputError`` naming the file and the fix when it is not
    readable JSON (a resume compares its data set fingerprint, and the new run starts with that run's records)."""
    path = source_run / METADATA_FILE
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        document, why = None, f"{type(error).__name__}: {error}"
    else:
        why = f"it holds {type(document).__name__}, not an object"
    if not isinstance(document, dict):
        raise InputError(f"{path} of the run being resumed is not readable JSON ({why}): truncated or edited. Restore "
                         "it (from a `rlrunbook package` archive or a backup); the checkpoint itself is verified "
                         "separately.")
    return document


def plan_resume(path: str | Path, requested: TrainConfig, sources: Mapping[str, str] | None) -> Resume:
    """Find and verify the checkpoint, merge the config (see :func:`resumed_config`): all before a model loads."""
    folder = find_checkpoint(path)
    layout = distributed.launch_layout()
    # A sharded checkpoint written at this world size: each rank reads its own shards only.
    checkpoint = load_checkpoint(folder, shard=(layout.rank, layout.world_size))
    source_run = folder.parent.parent
    if not (source_run / METADATA_FILE).is_file():
        raise ConfigError(f"checkpoint {folder} is not inside a run directory ({source_run / METADATA_FILE} is "
                          "missing): the resumed run starts with that run's records. Keep checkpoints in their run.")
    source_metadata(source_run)  # the records a resumed run reads, readable before anything loads
    step_records(source_run, checkpoint.step, rollout_kind(checkpoint.config.get("mode", "single_turn"),
                                                            checkpoint.config.get("env", "qa")), complete=False)
    config, record = resumed_config(checkpoint.config, requested, sources or {}, f"checkpoint:{folder}",
                                    withheld=checkpoint.withheld)
    config = validate(config)
    if checkpoint.step >= config.steps:
        raise ConfigError(f"checkpoint {folder} is at step {checkpoint.step}, so -s {config.steps} has nothing left "
                          f"to run. Pass -s larger than {checkpoint.step} to extend the run.")
    if not isinstance(checkpoint.adapter, dict) or not checkpoint.adapter:
        raise InputError(f"checkpoint {folder} holds no adapter tensors.")
    return Resume(checkpoint, source_run, config, record)
