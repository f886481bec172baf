"""The padding a planned ``forward_backward`` computes (pure: token sequences in, counts out; no model).

The decoder lays a micro-batch's distinct tokens out flat (:mod:`rlrunbook.engines.decoder`): its products
(projections, norms, MLP, LoRA factors) compute one row per distinct token, none padded, and the output layer
runs only on the ``(position, target)`` pairs a loss reads. Padding enters only the attention core, whose rows
are batched as ``[R, T, H, D]`` calls (:mod:`rlrunbook.engines.row_batches`). :func:`planned_padding` replays
the trainer's planning on token sequences: the micro-batches (:func:`rlrunbook.backend.micro_batches.micro_batches`),
each pass's attention rows (:func:`rlrunbook.prefix_tree.plan_forward`) and their batches at the device's bound,
and counts what those batches compute. ``scripts/padding_report.py`` prints it for a preset's shape
(docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlrunbook.backend.micro_batches import micro_batches
from rlrunbook.engines.row_batches import (
    HEADS_PER_BATCH,
    PADDING_TOLERANCE,
    ROW_QUERIES,
    Padding,
    batch_padding,
    group_rows,
)
from rlrunbook.prefix_tree import TokenTrie, plan_forward


@dataclass(frozen=True)
class PlannedPadding:
    """What the passes of a planned split compute: ``tokens`` distinct tokens through the products (none padded),
    in ``micro_batches`` passes and ``attention_batches`` attention calls per layer in all; the attention core's
    query positions and score elements per head, real and computed."""

    tokens: int
    micro_batches: int
    attention_batches: int
    queries: Padding
    scores: Padding


def planned_padding(sequences: Sequence[Sequence[int]], budget: int | None, chunks: int = 1,
                    device_type: str = "cuda", tolerance: float = PADDING_TOLERANCE) -> PlannedPadding:
    """The padding of ``sequences`` split as ``forward_backward`` splits them (``budget`` distinct tokens per
    micro-batch, at least ``chunks`` micro-batches) and batched for attention on a ``device_type`` device
    (``tolerance``: as :func:`rlrunbook.engines.row_batches.group_rows` takes it)."""
    from rlrunbook.engines.attention import SCORE_ELEMENTS

    bound = SCORE_ELEMENTS.get(device_type, SCORE_ELEMENTS["cuda"]) // HEADS_PER_BATCH
    tokens = attention_batches = 0
    queries, scores = Padding(0, 0), Padding(0, 0)
    split = micro_batches(sequences, budget, chunks)
    for part in split:
        plan = plan_forward(TokenTrie(), sequences[part.start:part.stop], max_queries=ROW_QUERIES)
        groups = group_rows(plan.rows, bound, tolerance)
        part_queries, part_scores = batch_padding(groups)
        tokens += len(plan.nodes)
        attention_batches += len(groups)
        queries, scores = queries.plus(part_queries), scores.plus(part_scores)
    return PlannedPadding(tokens, len(split), attention_batches, queries, scores)


def grouped_sequences(prompt_lengths: Sequence[int], completion_lengths: Sequence[Sequence[int]]) -> list[list[int]]:
    """Token sequences of a GRPO batch of these lengths, as the trainer gets them: group ``g``'s samples share a
    prompt of ``prompt_lengths[g]`` tokens and differ from their first completion token on (lengths
    ``completion_lengths[g]``); a datum's input is its prompt and completion less the last token."""
    sequences, next_token = [], 0
    for prompt_length, completions in zip(prompt_lengths, completion_lengths, strict=True):
        prompt = list(range(next_token, next_token + prompt_length))
        next_token += prompt_length
        for length in completions:
            sequences.append(prompt + list(range(next_token, next_token + length - 1)))
            next_token += length
    return sequences
