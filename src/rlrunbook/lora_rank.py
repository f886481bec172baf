"""The LoRA ranks rlrunbook accepts, one bound shared by the run config's check and the backend.

16,384 is the widest layer of a published dense model (Llama 3.1 405B): a rank above a layer's width adds no
capacity. A rank above a model's own width is accepted below the bound (stand-in models run recipes written for
larger ones), but not one that could never be allocated.
"""

from __future__ import annotations

from rlrunbook.errors import ConfigError

MAX_LORA_RANK = 16_384


def check_lora_rank(rank: int) -> int:
    """``rank`` if it is from 1 to :data:`MAX_LORA_RANK`; ``ConfigError`` naming the bound otherwise."""
    if rank < 1:
        raise ConfigError(f"LoRA rank={rank} must be >= 1.")
    if rank > MAX_LORA_RANK:
        raise ConfigError(f"LoRA rank={rank} is above {MAX_LORA_RANK:,}, the widest layer of a published dense model, "
                          f"where a higher rank adds no capacity. Use a rank of at most {MAX_LORA_RANK:,}.")
    return rank
