"""Token-level pure functions: datum assembly, the one-token shift, padding, stop handling.

Tokens are the source of truth: everything here works on token ids and never decodes.

The one-token shift. A sequence ``s = prompt + completion`` (length ``P + C``) is trained as
next-token prediction: ``input_tokens = s[:-1]`` and ``target_tokens = s[1:]`` (both length
``P + C - 1``). Target position ``i`` predicts ``s[i + 1]``, so the completion tokens are the last
``C`` targets: weights, sampling logprobs and advantages are zero on the first ``P - 1``
positions and carry the completion's values on the last ``C``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlrunbook.errors import InputError


@dataclass(frozen=True)
class DatumArrays:
    """The aligned arrays of one training datum; every list has the same length ``P + C - 1``."""

    input_tokens: list[int]
    target_tokens: list[int]
    weights: list[float]
    logprobs: list[float]
    advantages: list[float]


def _check_tokens(tokens: Sequence[int], what: str) -> None:
    if len(tokens) == 0:
        raise InputError(f"{what} is empty: a datum needs at least one {what.split()[0]} token.")
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise InputError(f"{what}[{i}] = {token!r} is not a token id (a non-negative int).")


def build_datum_arrays(
    prompt_tokens: Sequence[int],
    completion_tokens: Sequence[int],
    completion_logprobs: Sequence[float] | None = None,
    completion_advantages: Sequence[float] | None = None,
) -> DatumArrays:
    """Assemble the shifted, aligned arrays of a datum from a prompt and its completion.

    ``completion_logprobs`` default to 0 and ``completion_advantages`` to 1 (plain supervised
    weights). Raises ``InputError`` on an empty prompt or completion, a non-integer token, or
    per-completion arrays whose length differs from the completion's.
    """
    _check_tokens(prompt_tokens, "prompt tokens")
    _check_tokens(completion_tokens, "completion tokens")
    n_completion = len(completion_tokens)
    if completion_logprobs is None:
        completion_logprobs = [0.0] * n_completion
    if completion_advantages is None:
        completion_advantages = [1.0] * n_completion
    for name, values in (("completion_logprobs", completion_logprobs),
                         ("completion_advantages", completion_advantages)):
        if len(values) != n_completion:
            raise InputError(
                f"{name} has {len(values)} values but the completion has {n_completion} tokens; "
                "they must be aligned one to one."
            )
    sequence = [int(t) for t in prompt_tokens] + [int(t) for t in completion_tokens]
    n_prompt_targets = len(prompt_tokens) - 1
    return DatumArrays(
        input_tokens=sequence[:-1],
        target_tokens=sequence[1:],
        weights=[0.0] * n_prompt_targets + [1.0] * n_completion,
        logprobs=[0.0] * n_prompt_targets + [float(x) for x in completion_logprobs],
        advantages=[0.0] * n_prompt_targets + [float(x) for x in completion_advantages],
    )


@dataclass(frozen=True)
class SplitDatum:
    """A datum taken back apart: the inverse of :func:`build_datum_arrays`."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    completion_logprobs: list[float]
    completion_advantages: list[float]


def split_datum_arrays(arrays: DatumArrays) -> SplitDatum:
    """Recover prompt, completion and per-completion values from aligned datum arrays.

    The completion is the suffix of targets with non-zero weight; raises ``InputError`` if the
    arrays differ in length, the shift is broken (``input[1:] != target[:-1]``), or weighted
    positions are not one contiguous suffix.
    """
    lengths = {len(arrays.input_tokens), len(arrays.target_tokens), len(arrays.weights),
               len(arrays.logprobs), len(arrays.advantages)}
    if len(lengths) != 1:
        raise InputError(f"datum arrays differ in length: {sorted(lengths)}; they must be equal.")
    if arrays.input_tokens[1:] != arrays.target_tokens[:-1]:
        raise InputError("input_tokens[1:] != target_tokens[:-1]: the one-token shift is broken.")
    n_completion = sum(1 for w in arrays.weights if w != 0)
    first = len(arrays.weights) - n_completion
    if n_completion == 0 or any(w == 0 for w in arrays.weights[first:]):
        raise InputError("weighted positions are not one non-empty contiguous suffix of the targets.")
    sequence = list(arrays.input_tokens) + [arrays.target_tokens[-1]]
    return SplitDatum(
        prompt_tokens=sequence[: len(sequence) - n_completion],
        completion_tokens=sequence[len(sequence) - n_completion:],
        completion_logprobs=list(arrays.logprobs[first:]),
        completion_advantages=list(arrays.advantages[first:]),
    )


def find_stop(tokens: Sequence[int], stop_sequences: Sequence[Sequence[int]]) -> int | None:
    """End index (exclusive) of the earliest complete stop sequence in ``tokens``, else ``None``.

    "Earliest" means the stop that completes first while reading left to right, which is what
    an engine that checks after every token would see.
    """
    best: int | None = None
    for stop in stop_sequences:
        k = len(stop)
        if k == 0:
            raise InputError("an empty stop sequence matches everywhere; remove it.")
        for end in range(k, len(tokens) + 1):
            if best is not None and end >= best:
                break
            if list(tokens[end - k:end]) == list(stop):
                best = end
                break
    return best


def truncate_at_stop(
    tokens: Sequence[int], stop_sequences: Sequence[Sequence[int]]
) -> tuple[list[int], str]:
    """Cut ``tokens`` right after the first stop sequence: ``(kept_tokens, stop_reason)``.

    The stop sequence itself is kept (Tinker semantics) and nothing after it; ``stop_reason``
    is ``"stop"`` when a stop sequence was found, ``"length"`` otherwise.
    """
    end = find_stop(tokens, stop_sequences)
    if end is None:
        return list(tokens), "length"
    return list(tokens[:end]), "stop"


@dataclass(frozen=True)
class PaddedBatch:
    """A padded batch of token sequences: ``input_ids``, ``attention_mask``, ``position_ids`` all ``[B, L]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int, side: str = "left") -> PaddedBatch:
    """Pad token sequences to one length, with the mask and the position ids of real tokens.

    Position ids count real tokens only (0 at each sequence's first real token), so a sequence
    gets the same positions whatever its padding; pad positions get position 0 with mask 0.
    """
    if side not in ("left", "right"):
        raise InputError(f"pad side {side!r} is neither 'left' nor 'right'.")
    if not sequences:
        raise InputError("cannot pad an empty batch.")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    positions = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        n = len(seq)
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, cols] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, cols] = 1
        positions[row, cols] = torch.arange(n)
    return PaddedBatch(ids, mask, positions)


def check_context(length: int, max_context: int | None, what: str) -> None:
    """Raise ``InputError`` for a sequence of ``length`` tokens longer than the model's context ``max_context``
    (None: no limit known). Past it the model's positions mean nothing, and the work grows with the square of
    the length: a request that long is refused, not computed for hours."""
    if max_context is not None and length > max_context:
        raise InputError(f"{what} has {length} tokens, more than this model's context of {max_context} "
                         "(config max_position_embeddings); truncate or split it.")


def check_token_ids(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    """Raise ``InputError`` unless ``tokens`` is a non-empty list of ids in ``[0, vocab_size)``."""
    if len(tokens) == 0:
        raise InputError(f"{what} is empty: give at least one token id.")
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < vocab_size:
            raise InputError(
                f"{what}[{i}] = {token!r} is outside the vocabulary [0, {vocab_size}); "
                "tokens must come from this model's tokenizer."
            )
