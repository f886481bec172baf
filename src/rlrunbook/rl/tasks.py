"""Where users import tasks from: a task plugs in with ``rlrunbook.rl.tasks.register_task``.

The tasks live in :mod:`rlrunbook.rl.rollout.tasks`; this module hands their public names on.
"""

from rlrunbook.rl.rollout.tasks import (
    TASKS,
    MathTask,
    Problem,
    QATask,
    SummaryTask,
    Task,
    get_task_class,
    register_task,
)

__all__ = ["TASKS", "MathTask", "Problem", "QATask", "SummaryTask", "Task", "get_task_class", "register_task"]
