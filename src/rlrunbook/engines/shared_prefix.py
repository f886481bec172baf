"""The trainer's forward: every distinct prefix once, the output layer only where a logprob is asked.

A batch of datums is a set of token sequences. Samples of one prompt share the prompt (and often
their first tokens), so the sequences are put in a :class:`~rlrunbook.prefix_tree.TokenTrie` found
from the tokens alone (datums carry no group id), and :class:`~rlrunbook.engines.decoder.Decoder`
computes each distinct prefix once, forward and backward (shared-prefix attention, as Prefix
Grouper does for GRPO). Because a causal model's output at a position depends only on the tokens
up to it, this is the same function as the unshared pass, and its gradient is the sum of the
unshared ones (tested against it).

The output layer then runs only for the ``(position, target)`` pairs asked for, each distinct pair
once, in chunks of rows: no ``[tokens, V]`` tensor is ever held for the whole batch. A chunk's
``[rows, V]`` logits are not kept for the backward pass. Where the output layer is not trained (LoRA
without ``train_unembed``) and only logprobs are asked, the forward keeps ``[rows, E]`` floats from
which the backward gets the hidden states' gradient without the logits
(:func:`rlrunbook.kernels.ops.frozen_head_logprobs`); otherwise the logits are recomputed in the
backward (activation checkpointing). Logprobs are ``log_softmax(logits)[target]``, the very
expression the sampler reports, so the two can agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.filters import SamplingFilters, apply_filters
from rlrunbook.engines.kept_products import KeptProducts, KnownLogits
from rlrunbook.engines.layouts import TreeLayout, take_rows
from rlrunbook.engines.row_batches import ROW_QUERIES
from rlrunbook.prefix_tree import TokenTrie, plan_forward
from rlrunbook.regularizers import token_entropy

_HEAD_CHUNK_ELEMENTS = 1 << 24  # logits per output-layer chunk: 16M fp32 = 64 MB (and as much for the grad)


@dataclass(frozen=True)
class SharedPass:
    """Final hidden states of every distinct prefix (``hidden[N, E]``) and where each token's state is:
    ``flat[i][t]`` is the row of ``hidden`` for token ``t`` of sequence ``i``."""

    hidden: torch.Tensor
    flat: list[list[int]]
    logits: KnownLogits | None = None  # the sampler's kept logits after some rows (engines/kept_products.py)


@dataclass(frozen=True)
class TokenScores:
    """Per asked pair: the T = 1 ``logprobs`` (differentiable when the pass was), and when asked for,
    the logprobs under a sampling transform (detached) and the entropy of the T = 1 distribution."""

    logprobs: torch.Tensor
    sampling_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class SharedPrefixScorer:
    """Teacher-forced logprobs of token sequences through a :class:`Decoder`, prefixes shared."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.kept_tokens = 0  # tokens of the last run whose kept outputs were read, not computed

    def run(self, sequences: Sequence[Sequence[int]], recompute_layers: bool = False,
            kept: KeptProducts | None = None, release_kept: bool = False) -> SharedPass:
        """One forward over ``sequences`` (differentiable unless called under ``torch.no_grad``);
        ``recompute_layers``: activation checkpointing per decoder layer (see :meth:`Decoder.hidden`). ``kept``: base
        products a sampling call computed under these very weights (the caller checked them), read where they hold
        every token of the pass (:mod:`rlrunbook.engines.kept_products`); ``release_kept``: freed as they are read
        (the last pass to read them)."""
        device = next(self.decoder.model.parameters()).device
        trie = TokenTrie()
        plan = plan_forward(trie, sequences, max_queries=ROW_QUERIES)
        flat_of = plan.flat_of()
        ids = torch.tensor([trie.tokens[n] for n in plan.nodes], device=device)
        positions = torch.tensor([trie.positions[n] for n in plan.nodes], device=device)
        layout = TreeLayout(plan.rows, flat_of, trie.positions, device)
        flat = [[flat_of[node] for node in path] for path in plan.paths]
        known, logits = (None, None) if kept is None else kept.read(sequences, flat, len(plan.nodes), release_kept)
        self.decoder.known_products = known
        try:
            hidden = self.decoder.hidden(ids, positions, layout, recompute_layers)
        finally:
            self.decoder.known_products = None
        self.kept_tokens = 0 if known is None else len(plan.nodes)
        return SharedPass(hidden, flat, logits)

    def score(self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
              filters: SamplingFilters | None = None, with_entropy: bool = False,
              logits: KnownLogits | None = None) -> TokenScores:
        """Logprobs of ``targets`` (``[M]``) after hidden rows ``rows`` (``[M]``), chunked over rows.

        ``filters``: also the logprobs under that sampling transform (``logits / T`` and filters; the
        distribution a sampler with these settings drew from), detached. ``with_entropy``: also the
        entropy of each row's T = 1 distribution (differentiable). ``logits``: the sampler's logits after hidden
        rows that it kept (:class:`SharedPass`), read instead of computed where they cover a chunk of the output
        layer's direct pass.
        """
        chunk = max(2, _HEAD_CHUNK_ELEMENTS // self.decoder.vocab_size)
        parts: list[tuple[torch.Tensor, ...]] = []
        direct = not with_entropy and (filters is None or _identity(filters)) and self.decoder.head_frozen
        for start in range(0, rows.numel(), chunk):
            h = take_rows(hidden, rows[start:start + chunk])
            t = targets[start:start + chunk]
            if torch.is_grad_enabled() and h.requires_grad and direct:
                known = None if logits is None else logits.select(rows[start:start + chunk])
                logprobs = self.decoder.frozen_head_logprobs(h, t, known)
                parts.append((logprobs, logprobs.detach(), logprobs.new_zeros(0)))
            elif torch.is_grad_enabled() and h.requires_grad:
                parts.append(checkpoint(self._head, h, t, filters, with_entropy, logits, rows[start:start + chunk],
                                        use_reentrant=False))
            else:
                parts.append(self._head(h, t, filters, with_entropy, logits, rows[start:start + chunk]))
        columns = list(zip(*parts, strict=True)) if parts else [[], [], []]
        logprobs = torch.cat(columns[0]) if parts else hidden.new_zeros(0, dtype=torch.float32)
        sampled = torch.cat(columns[1]) if parts and filters is not None else None
        entropy = torch.cat(columns[2]) if parts and with_entropy else None
        return TokenScores(logprobs, sampled, entropy)

    def _head(self, h: torch.Tensor, targets: torch.Tensor, filters: SamplingFilters | None, with_entropy: bool,
              kept: KnownLogits | None = None, rows: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk's scores from its logits: ``kept``'s after hidden rows ``rows`` where it holds them all and the
        decoder can read them (gathered here, so that a checkpointed chunk holds no ``[m, V]`` tensor between its
        forward and its backward, which gathers them again), else computed."""
        known = kept.select(rows) if kept is not None and self.decoder.reads_known_logits(h) else None
        logits = self.decoder.logits(h, known)  # [m, V] float32
        logprobs = self.decoder.log_softmax_at(logits, targets)  # the sampler's own expression
        empty = logprobs.new_zeros(0)
        sampled = empty
        if filters is not None and _identity(filters):
            sampled = logprobs.detach()
        elif filters is not None:
            with torch.no_grad():
                transformed = logits.detach() if filters.greedy else apply_filters(logits.detach(), filters)
                sampled = self.decoder.log_softmax_at(transformed, targets)
        entropy = token_entropy(logits) if with_entropy else empty
        return logprobs, sampled, entropy


def _identity(filters: SamplingFilters) -> bool:
    """Whether sampling with ``filters`` draws from the T = 1 distribution itself (no temperature, no filter)."""
    return not filters.greedy and filters.temperature == 1.0 and not filters.filters_tokens
