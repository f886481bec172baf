"""The AdamW hyperparameters of an ``optim_step``, checked before anything is applied.

A step with a learning rate of NaN, infinity or -1e30 would be applied by torch without a word and leave every
weight NaN or destroyed; so each field is refused here, naming its rule, before the step touches the
optimizer: the caller's error, answered at once (400 over HTTP), the weights as they were.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rlrunbook.errors import InputError

if TYPE_CHECKING:  # the check reads the fields only; importing the SDK would load torch
    from tinker import types

# Adam moves each weight by about the learning rate a step whatever the gradient's scale: above 1 every
# adapter weight moves by more than its own size.
MAX_LEARNING_RATE = 1.0

# field -> (lowest, highest, whether the lowest itself is allowed, the rule as stated to the caller)
RULES = {
    "learning_rate": (0.0, MAX_LEARNING_RATE, True, "from 0 to 1 (LoRA runs use 1e-6 to 1e-3)"),
    "beta1": (0.0, 1.0, True, "from 0 to below 1"),
    "beta2": (0.0, 1.0, True, "from 0 to below 1"),
    "eps": (0.0, math.inf, False, "above 0"),
    "weight_decay": (0.0, math.inf, True, "0 or more"),
    "grad_clip_norm": (0.0, math.inf, True, "0 (off) or more"),
}


def check_adam_params(params: types.AdamParams) -> None:
    """``InputError`` naming the first field of ``params`` that is not a finite number within its rule."""
    for name, (low, high, low_allowed, rule) in RULES.items():
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(f"AdamParams.{name}={value!r} is not a finite number; it must be {rule}.")
        inside = (low <= value if low_allowed else low < value) and (
            value <= high if name == "learning_rate" else value < high)
        if not inside:
            raise InputError(f"AdamParams.{name}={value!r} is out of range: it must be {rule}. The step was not "
                             "applied; the weights are unchanged.")
