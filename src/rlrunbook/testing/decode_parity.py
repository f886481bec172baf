"""The sampler's decode steps against the trainer's pass, token by token: the check the engine's parity rests on."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlrunbook.engines.layouts import RowCache, TreeLayout
from rlrunbook.prefix_tree import TokenTrie, plan_forward


def assert_decode_steps_equal_the_training_pass(decoder, tokens: Sequence[int], *, record_grad: bool = False,
                                                capacity: int = 64) -> RowCache:
    """Assert that each one-token decode step of ``tokens`` (two identical rows over a :class:`RowCache` of
    ``capacity`` positions, no gradient, inside :meth:`Decoder.weights_fixed`) gives the final hidden state that the
    shared-prefix pass over the whole sequence gives at that token, bit for bit. ``record_grad``: that pass records
    gradients, as the trainer's does (which is the chain of operations autograd differentiates).

    Returns the cache, filled up to the last token, for a further step."""
    lm = decoder.lm
    layers = len(lm.model.layers)
    device = lm.model.embed_tokens.weight.device
    trie = TokenTrie()
    plan = plan_forward(trie, [list(tokens)])
    flat = plan.flat_of()
    with torch.set_grad_enabled(record_grad):
        full = decoder.hidden(torch.tensor([trie.tokens[n] for n in plan.nodes], device=device),
                              torch.tensor([trie.positions[n] for n in plan.nodes], device=device),
                              TreeLayout(plan.rows, flat, trie.positions, device))
    assert full.requires_grad == record_grad
    cache = RowCache(layers, 2, capacity, decoder.num_kv_heads, decoder.head_dim, decoder.dtype, device)
    with torch.no_grad(), decoder.weights_fixed():
        for t, token in enumerate(tokens):
            cache.lengths[:] = t
            step = decoder.hidden(torch.tensor([token, token], device=device), cache.lengths.clone(), cache)
            assert torch.equal(step[0], full[flat[plan.paths[0][t]]]), f"position {t}: the decode step differs"
    return cache
