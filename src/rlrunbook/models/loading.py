"""Load a resolved model folder into a tokenizer and a causal LM, checking what RL code relies on."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlrunbook.errors import ConfigError

logger = logging.getLogger(__name__)


def load_tokenizer(folder: str | Path):
    """Load the tokenizer of ``folder`` with ``AutoTokenizer``, padded on the left.

    Left padding is what batched generation needs (every prompt ends at the same column); a
    folder saved with right padding is switched to left with a log line. Raises ``ConfigError``
    if the tokenizer has no eos or no pad token, since sampling needs the first to stop and
    batching needs the second.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.padding_side != "left":
        logger.info("tokenizer of %s pads on the %s; switching to left", folder, tokenizer.padding_side)
        tokenizer.padding_side = "left"
    missing = [
        kind
        for kind, token_id in (("eos", tokenizer.eos_token_id), ("pad", tokenizer.pad_token_id))
        if token_id is None
    ]
    if missing:
        raise ConfigError(
            f"tokenizer in {str(folder)!r} has no {' and no '.join(missing)} token; set them in its "
            "tokenizer_config.json (eos_token, pad_token: e.g. an unused special token) and retry"
        )
    return tokenizer


def load_causal_lm(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    *, load_in_4bit: bool = False,
):
    """Load ``folder`` with ``AutoModelForCausalLM`` in ``dtype`` on ``device``, in eval mode.

    Eval mode because dropout would make sampler and trainer logprobs disagree; training code
    calls ``.train()`` itself where it wants it. ``load_in_4bit`` quantises the frozen base weights
    to NF4 with bitsandbytes (compute in ``dtype``); it needs a CUDA device and the bitsandbytes
    package, and is refused with the fix named otherwise.
    """
    from transformers import AutoModelForCausalLM

    if not load_in_4bit:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        return model.to(device).eval()
    if not str(device).startswith("cuda"):
        raise ConfigError(f"4-bit loading needs a CUDA device, not {str(device)!r}: drop load_in_4bit on CPU.")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError("4-bit loading needs the bitsandbytes package: pip install bitsandbytes "
                          "(or drop backend.load_in_4bit).") from None
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, quantization_config=quantization,
                                                 device_map={"": str(device)})
    return model.eval()
