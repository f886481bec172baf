"""The whole case table of the hostile-input run: every class's cases, in the order the run lists them.

``cases()`` calls each class's table (cases_inputs, cases_files, cases_runs) in ``CLASSES`` order with an
``add`` that sets each case's class and appends it; a table may change a class afterwards (``no-proxy-no-effect``
is listed among the silent accepts but is a control). Case ids are unique (checked by ``main``).
"""

from __future__ import annotations

from . import cases_files, cases_inputs, cases_runs
from .case import Case

CLASSES = (
    cases_inputs.controls,
    cases_inputs.limits,
    cases_files.filesystem,
    cases_files.model_folders,
    cases_inputs.encodings,
    cases_files.yaml_configs,
    cases_files.resume,
    cases_inputs.task_options,
    cases_runs.signals,
    cases_runs.cookbook,
    cases_runs.api_backend,
    cases_runs.async_training,
    cases_files.overwrites,
    cases_inputs.silent_accepts,
    cases_files.secrets,
    cases_inputs.misleading,
)


def cases() -> list[Case]:
    """Every case, fresh objects on each call, in the order of ``CLASSES``."""
    out: list[Case] = []

    def add(cls: str, *items: Case) -> None:
        for c in items:
            c.cls = cls
            out.append(c)

    for table in CLASSES:
        table(add)
    return out
