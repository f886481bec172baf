"""Checks of a run's surroundings, made before any model loads and before a run directory exists.

:func:`rlrunbook.rl.setup.prepare.prepare` checks the options and the data; this module checks what they
point at: where run directories go (``--log-root``, ``--name``), which backend runs the model and
whether it can (a device this machine has, credentials for the hosted service) and whether the model
folders are complete. A mistake found here is a ``ConfigError`` naming the cause and the fix, and it
leaves nothing behind: no ``failed`` run directory, no model loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.run.paths import check_log_root, check_run_dir_name, log_root


def check_run_location(config: TrainConfig, environ: Mapping[str, str] | None = None) -> None:
    """The log root can hold a new run directory, and the directory's name fits the file system."""
    root = log_root(config.log_root, os.environ if environ is None else environ)
    check_log_root(root)
    check_run_dir_name(root, config.run_mode, config.env, config.name)


def check_api_credentials(environ: Mapping[str, str]) -> None:
    """``TINKER_BACKEND=api`` needs a credential and a service that answers (see
    :func:`rlrunbook.backend.api_access.check_api_access`): both checked before anything loads."""
    from rlrunbook.backend.api_access import check_api_access

    check_api_access(environ)


def check_backend(config: TrainConfig, environ: Mapping[str, str] | None = None) -> None:
    """The selected backend can run ``config``: credentials for ``api``; for ``local``, valid
    ``TINKER_LOCAL_*`` settings with a device this machine has, and complete model folders."""
    from rlrunbook.backend import backend_name

    environ = os.environ if environ is None else environ
    if backend_name(dict(environ)) == "api":
        check_api_credentials(environ)
        return
    from rlrunbook.models import resolve_model
    from rlrunbook.rl.setup.service import local_settings

    local_settings(config.backend)  # ConfigError for a bad TINKER_LOCAL_* value or a device this machine lacks
    resolve_model(config.model)  # built-ins are built here; a folder must hold weights and a tokenizer
    if config.mode == "debate" and not config.mock_judge and config.judge_model:
        resolve_model(config.judge_model)


def preflight(config: TrainConfig, environ: Mapping[str, str] | None = None, *, writes_run_dir: bool = True) -> None:
    """Every check of this module; ``writes_run_dir=False`` for commands that write no run directory (eval)."""
    if writes_run_dir:
        check_run_location(config, environ)
    check_backend(config, environ)


def check_output_file(path: str | os.PathLike[str], flag: str = "--out") -> None:
    """``ConfigError`` unless a file can be written at ``path``: not a directory, not a file of a run directory
    (:func:`rlrunbook.run.outputs.check_not_a_run_file`), its folder creatable and writable. Checked before the
    work whose result it holds, so a bad ``--out`` never costs the results."""
    from pathlib import Path

    from rlrunbook.run.outputs import check_not_a_run_file

    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory; it names the file to write. Pass a file path, "
                          f"e.g. {flag} {str(target / 'results.json')!r}.")
    check_not_a_run_file(target, flag)
    check_log_root(target.parent, flag)
