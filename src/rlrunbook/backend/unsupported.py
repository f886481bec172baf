"""One clear error for an SDK method the local backend does not have.

A recipe that calls a hosted-only method (``publish_checkpoint_from_tinker_path``,
``forward_backward_custom``, ...) should fail naming the method and why, not with a bare
``AttributeError: 'LocalTrainingClient' object has no attribute ...``.
"""

from __future__ import annotations


def refuse_sdk_attribute(owner: str, sdk_class: type, name: str) -> AttributeError:
    """The ``AttributeError`` to raise from a local client's ``__getattr__`` for ``name``."""
    if not name.startswith("_") and hasattr(sdk_class, name):
        return AttributeError(
            f"{owner}.{name} is part of the Tinker SDK but not of the rlrunbook local backend (it has no "
            "local equivalent yet). Run this code against the hosted service (TINKER_BACKEND=api), or "
            "avoid the call when TINKER_BACKEND=local."
        )
    return AttributeError(f"local {owner} has no attribute {name!r}")
