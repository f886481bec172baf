"""A plug-in task for the tests of secrets: qa with credentials among its options, as a task that calls a
hosted service (a judge, a grader) would declare them.

``extra.*`` keys must be options the task declares (``rlrunbook.rl.rollout.task_options``), so a run that
passes ``extra.api_key=...`` needs a task that reads it; the built-in ``qa`` reads none. Importing this module
registers ``qa_keyed_test``: ``--env qa_keyed_test`` then trains exactly as ``--env qa``.
"""

from __future__ import annotations

from rlrunbook.rl.rollout.task_options import TaskOption
from rlrunbook.rl.rollout.tasks import TASKS, QATask, register_task

KEYED_TASK = "qa_keyed_test"
CREDENTIAL_OPTIONS = ("api_key", "openai_key", "passphrase", "model_key", "endpoint")


class KeyedQATask(QATask):
    """``qa`` that also declares string options holding credentials (it reads none of them)."""

    name = KEYED_TASK
    declared_options = {**QATask.declared_options,
                        **{key: TaskOption(str, "", f"{key} of a hosted service") for key in CREDENTIAL_OPTIONS}}


if KEYED_TASK not in TASKS:
    register_task(KeyedQATask)
