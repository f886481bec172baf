"""The sampler-trainer mismatch keys of ``loss_fn_config`` (a LOCAL EXTENSION of the Tinker API).

The hosted service compares nothing: its losses read the sampler's logprobs ``q`` as given. Locally,
``forward_backward`` also measures how far the trainer is from the sampler on the sampled tokens,
like with like: the trainer's logprobs under the sampler's transform (``logits / T`` and its
filters, stated by the ``sampling_*`` keys; default T = 1, no filter) against ``q``. With
``is_correction`` it also corrects the numerical mismatch by per-token importance weights
(:func:`rlrunbook.regularizers.importance_correction`): the loss then reads the trainer's own T = 1
logprobs before the update in place of ``q``, and every token's advantage is multiplied by its
weight, which is truncated importance sampling for every policy-gradient loss. Off by default, so
the Tinker loss semantics hold unless asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.errors import ConfigError

CORRECTIONS = ("none", "truncate", "mask")
MISMATCH_KEYS = ("sampling_temperature", "sampling_top_k", "sampling_top_p", "sampling_min_p",
                 "is_correction", "is_cap", "is_mask_low", "is_mask_high")


@dataclass(frozen=True)
class MismatchConfig:
    """What the sampler drew from, and whether and how the trainer corrects for it."""

    filters: SamplingFilters = field(default_factory=SamplingFilters)
    correction: str = "none"
    cap: float = 2.0
    mask_low: float = 0.125
    mask_high: float = 8.0
    stated: bool = False  # the caller named the sampler's transform: outputs carry ``sampling_logprobs``

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ConfigError(f"loss_fn_config['is_correction'] = {self.correction!r} must be one of {CORRECTIONS}.")
        if not (math.isfinite(self.cap) and self.cap >= 1):
            raise ConfigError(f"loss_fn_config['is_cap'] = {self.cap!r} must be a finite number >= 1 (default 2).")
        if not (0 < self.mask_low < 1 < self.mask_high and math.isfinite(self.mask_high)):
            raise ConfigError(f"is_mask_low {self.mask_low!r} and is_mask_high {self.mask_high!r} must satisfy "
                              "0 < low < 1 < high (default 1/8 and 8).")


def split_mismatch_config(config: Mapping[str, float | str]) -> tuple[MismatchConfig, dict[str, float | str]]:
    """Separate the mismatch keys from a ``loss_fn_config``; the rest goes on to the loss."""
    rest = dict(config)
    own = {key: rest.pop(key) for key in MISMATCH_KEYS if key in rest}

    def number(key: str, default: float, cast=float):
        value = own.get(key, default)
        try:
            return cast(value)
        except (TypeError, ValueError):
            raise ConfigError(f"loss_fn_config[{key!r}] = {value!r} is not a number.") from None

    filters = SamplingFilters(temperature=number("sampling_temperature", 1.0), top_k=number("sampling_top_k", -1, int),
                              top_p=number("sampling_top_p", 1.0), min_p=number("sampling_min_p", 0.0))
    mismatch = MismatchConfig(filters, str(own.get("is_correction", "none")), number("is_cap", 2.0),
                              number("is_mask_low", 0.125), number("is_mask_high", 8.0),
                              stated=any(key.startswith("sampling_") for key in own))
    return mismatch, rest
