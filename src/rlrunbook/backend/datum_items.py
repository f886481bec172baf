"""A datum as the trainer holds it: its tokens, targets and loss inputs as tensors, and which positions train.

Built once per datum and checked on the way (lengths, the loss's required inputs, the vocabulary, the context),
so the trainer and ``forward_backward_custom`` never see a malformed datum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tinker import types

from rlrunbook.errors import InputError
from rlrunbook.losses import LossSpec
from rlrunbook.tokens import check_context, check_token_ids


@dataclass(frozen=True)
class TrainingItem:
    """One datum as tensors: ``input_tokens`` (L), and every loss input as a ``[L]`` tensor."""

    input_tokens: list[int]
    targets: torch.Tensor
    inputs: dict[str, torch.Tensor]
    mask: torch.Tensor  # [L] bool: positions the loss sees
    regularized: torch.Tensor  # [L] bool: trained positions, where KL and entropy terms apply (within mask)


def datum_item(datum: types.Datum, index: int, spec: LossSpec, vocab_size: int,
               max_context: int | None = None) -> TrainingItem:
    """Datum ``index`` as a :class:`TrainingItem` for ``spec``'s loss; ``InputError`` naming the datum for unequal
    array lengths, a missing input, a token outside the vocabulary or a context over ``max_context``."""
    tokens = datum.model_input.to_ints()
    check_context(len(tokens), max_context, f"datum {index} model_input")
    check_token_ids(tokens, vocab_size, f"datum {index} model_input")
    arrays = {key: value.to_torch() for key, value in datum.loss_fn_inputs.items()}
    if "target_tokens" not in arrays:
        raise InputError(f"datum {index} has no loss_fn_inputs['target_tokens'].")
    targets = arrays.pop("target_tokens").long().reshape(-1)
    check_token_ids(targets.tolist(), vocab_size, f"datum {index} target_tokens")
    lengths = {"model_input": len(tokens), "target_tokens": len(targets)}
    lengths.update({key: value.numel() for key, value in arrays.items()})
    if len(set(lengths.values())) != 1:
        raise InputError(
            f"datum {index}: arrays of unequal length {lengths}; model_input and every loss_fn_input "
            "must have one entry per target position (see rlrunbook.tokens.build_datum_arrays)."
        )
    missing = [key for key in spec.required_inputs if key not in arrays]
    if missing:
        raise InputError(f"datum {index}: loss {spec.name!r} needs loss_fn_inputs {missing}.")
    inputs = {key: arrays[key].float().reshape(-1) for key in spec.required_inputs}
    for key, fill in spec.optional_inputs.items():
        inputs[key] = arrays[key].float().reshape(-1) if key in arrays else torch.full((len(tokens),), fill)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    if "logprobs" in spec.required_inputs:
        # Sampled positions only: prompt positions carry the placeholders logprob 0 and advantage 0,
        # and must not enter ratio metrics or dro's (lp - q)^2 penalty with a fake q.
        mask = (inputs["logprobs"] != 0) | (inputs["advantages"] != 0)
        if "weights" in arrays:  # an explicit mask of trained positions wins
            mask = arrays["weights"].reshape(-1) != 0
    # cross_entropy sees every position (weight 0 on the prompt); regularize only the weighted ones.
    regularized = mask & (inputs["weights"] != 0) if "weights" in inputs else mask
    return TrainingItem(tokens, targets, inputs, mask, regularized)



def target_item(datum: types.Datum, index: int, vocab_size: int, max_context: int | None = None) -> TrainingItem:
    """Datum ``index`` for ``forward_backward_custom``: its loss sees every target position, and the loss's own
    inputs stay the caller's (no arrays but the tokens and targets are read)."""
    tokens = datum.model_input.to_ints()
    check_context(len(tokens), max_context, f"datum {index} model_input")
    check_token_ids(tokens, vocab_size, f"datum {index} model_input")
    if "target_tokens" not in datum.loss_fn_inputs:
        raise InputError(f"datum {index} has no loss_fn_inputs['target_tokens'] (forward_backward_custom needs "
                         "them: the logprobs it hands the loss are those of the targets).")
    targets = datum.loss_fn_inputs["target_tokens"].to_torch().long().reshape(-1)
    check_token_ids(targets.tolist(), vocab_size, f"datum {index} target_tokens")
    if len(targets) != len(tokens):
        raise InputError(f"datum {index}: {len(tokens)} model_input tokens but {len(targets)} target_tokens; "
                         "there is one target per input position (see rlrunbook.tokens.build_datum_arrays).")
    everywhere = torch.ones(len(tokens), dtype=torch.bool)
    return TrainingItem(tokens, targets, {}, everywhere, everywhere)
