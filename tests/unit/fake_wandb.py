"""A stand-in for the ``wandb`` module that records every call a run makes (wandb is not installed here)."""

from __future__ import annotations

import importlib.machinery
import types


class FakeWandb(types.ModuleType):
    """Records ``init`` / ``log`` / ``finish`` calls as ``(name, args, kwargs)`` in ``calls``."""

    def __init__(self):
        super().__init__("wandb")
        # Libraries probe optional packages with importlib.util.find_spec, which needs a spec.
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.calls: list[tuple[str, tuple, dict]] = []

    def init(self, *args, **kwargs):
        self.calls.append(("init", args, kwargs))

    def log(self, *args, **kwargs):
        self.calls.append(("log", args, kwargs))

    def finish(self, *args, **kwargs):
        self.calls.append(("finish", args, kwargs))
