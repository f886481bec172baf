"""An optional Weights & Biases mirror of a run's logs, on only when ``WANDB_PROJECT`` is set.

The run directory stays the record; W&B gets a copy of each ``train_log.jsonl`` row and each
``validation.jsonl`` row (keys prefixed ``val/``) as they are written. ``RunWriter`` drives the
sink, so the config it sends is the one ``run_metadata.json`` holds, secrets already redacted.

``wandb`` is imported only when the variable is set; if it is set and the package is missing,
:func:`from_environ` raises ``ConfigError`` at once, before a run directory or a model exists,
instead of training for an hour and losing the dashboard.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from rlrunbook.errors import ConfigError

PROJECT_ENV = "WANDB_PROJECT"


def scalars(row: Mapping[str, Any], prefix: str = "") -> dict[str, float | int]:
    """The numbers of ``row`` as W&B scalars: a ``[low, high]`` interval becomes ``<key>_low``/``<key>_high``.

    Strings, ids and other lists are left out (they are in the run directory); ``step`` is not
    a metric (it is passed as W&B's step).
    """
    out: dict[str, float | int] = {}
    for key, value in row.items():
        if key == "step":
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = value
        elif (isinstance(value, (list, tuple)) and len(value) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            out[f"{prefix}{key}_low"], out[f"{prefix}{key}_high"] = value
    return out


class WandbSink:
    """Forwards rows to an open ``wandb`` run: ``start`` → ``log``... → ``finish``."""

    def __init__(self, wandb: Any, project: str):
        self._wandb = wandb
        self.project = project
        self._started = False

    def start(self, name: str, config: Mapping[str, Any]) -> None:
        """``wandb.init`` with the run directory's name and the (redacted) config."""
        self._wandb.init(project=self.project, name=name, config=dict(config))
        self._started = True

    def log(self, row: Mapping[str, Any], step: int, prefix: str = "") -> None:
        if not self._started:
            raise RuntimeError("WandbSink.log before start(): RunWriter.write_metadata starts the sink")
        self._wandb.log(scalars(row, prefix), step=step)

    def finish(self, status: str) -> None:
        """``wandb.finish`` once (a failed run exits with code 1, so W&B marks it failed)."""
        if self._started:
            self._started = False
            self._wandb.finish(exit_code=0 if status == "completed" else 1)


def from_environ(environ: Mapping[str, str]) -> WandbSink | None:
    """A sink for ``$WANDB_PROJECT``, or None when it is unset or empty (then ``wandb`` is never imported)."""
    project = environ.get(PROJECT_ENV, "").strip()
    if not project:
        return None
    try:
        wandb = importlib.import_module("wandb")
    except ImportError as exc:
        raise ConfigError(
            f"{PROJECT_ENV}={project!r} asks for W&B logging, but the wandb package is not installed. "
            f"Run `pip install wandb`, or unset {PROJECT_ENV} to log only to the run directory."
        ) from exc
    return WandbSink(wandb, project)
