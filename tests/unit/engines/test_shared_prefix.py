"""Shared prefixes: found from tokens, computed once, and the same function (and gradient) as unshared.

The trainer runs a group's shared prompt once (rlrunbook.engines.shared_prefix). Because a causal
model's output at position t depends only on tokens 0..t, the shared pass computes the same values
as one pass per sequence, and its gradient is the sum of the per-sequence gradients. Checked in
float64, where the two summation orders can differ by at most a few hundred ulps of the largest
partial sum: relative 1e-10 leaves a 10^3 margin over 2.2e-16 x ~10^3 terms.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.backend.lora import adapter_parameters, wrap_with_lora
from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.shared_prefix import SharedPrefixScorer
from rlrunbook.prefix_tree import TokenTrie, plan_forward, plan_rows

sequences_strategy = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=9), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(sequences=sequences_strategy, block=st.integers(0, 4))
def test_every_prefix_is_computed_once_and_rows_read_their_path(sequences, block):
    trie = TokenTrie()
    plan = plan_forward(trie, sequences, max_queries=block)
    distinct = {tuple(s[:t + 1]) for s in sequences for t in range(len(s))}
    assert len(plan.nodes) == len(set(plan.nodes)) == len(distinct) == len(trie)
    for tokens, path in zip(sequences, plan.paths, strict=True):
        assert [trie.tokens[n] for n in path] == tokens
        assert [trie.positions[n] for n in path] == list(range(len(tokens)))
    for row in plan.rows:
        assert row.keys == trie.path(row.queries[-1]), "a row reads its path up to its last query"
        assert row.queries == row.keys[-len(row.queries):]
        assert block == 0 or len(row.queries) <= block


@settings(max_examples=200, deadline=None)
@given(sequences=sequences_strategy, block=st.integers(1, 4))
def test_rows_are_cut_at_multiples_of_the_block(sequences, block):
    """Every row ends at a position block's end or at its path's end, so the full rows of any two paths at one
    block have the same shape (and batch without padding: rlrunbook.engines.row_batches)."""
    trie = TokenTrie()
    plan = plan_forward(trie, sequences, max_queries=block)
    ends = {path[-1] for path in plan.paths}
    for row in plan.rows:
        last = trie.positions[row.queries[-1]]
        assert (last + 1) % block == 0 or row.queries[-1] in ends
        assert trie.positions[row.queries[0]] // block == last // block, "a row stays within one block"


@settings(max_examples=100, deadline=None)
@given(first=sequences_strategy, second=sequences_strategy)
def test_a_second_call_computes_only_what_is_new(first, second):
    trie = TokenTrie()
    plan_forward(trie, first)
    before = len(trie)
    plan = plan_forward(trie, second, last_token_computed=True)
    new = len(trie) - before
    # the new nodes, plus each sequence's last token when its prefix was seen before (its output is needed)
    assert new <= len(plan.nodes) <= new + len(second)
    assert {path[-1] for path in plan.paths} <= set(plan.nodes)


def test_plan_rows_refuses_a_broken_path():
    # the first path computes nodes 2 and 3 but not node 1; the second would compute 1, skip 2, compute 5
    with pytest.raises(ValueError, match="contiguous"):
        plan_rows([[1, 2, 3], [1, 2, 5]], [1, 0])


@pytest.fixture(scope="module")
def lora_tiny64(tiny_folder):
    from rlrunbook.models import load_causal_lm

    model = load_causal_lm(tiny_folder, dtype=torch.float64)
    model = wrap_with_lora(model, rank=4, alpha=8, seed=0)
    with torch.no_grad():  # a non-zero B so the adapter's gradients are not trivially zero
        for name, p in adapter_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype) * 0.1)
    return model


def _loss_and_grads(model, scorer, sequences, weights, shared: bool):
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    groups = [sequences] if shared else [[s] for s in sequences]
    offset = 0
    for group in groups:
        run = scorer.run([s[:-1] for s in group])
        for i, seq in enumerate(group):
            rows = torch.tensor(run.flat[i])
            lp = scorer.score(run.hidden, rows, torch.tensor(seq[1:])).logprobs
            total = total + (lp.double() * weights[offset + i]).sum()
        offset += len(group)
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in adapter_parameters(model).items()}


def test_shared_prefix_gradient_equals_the_unshared_gradient(lora_tiny64):
    prompt = [1, 285, 201, 279, 261, 223, 40, 41, 300, 12]
    sequences = [prompt + [99, 7, 500, 18, 3], prompt + [99, 7, 61], prompt + [4, 4, 4, 4, 4, 4], prompt + [99, 8]]
    weights = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    scorer = SharedPrefixScorer(Decoder(lora_tiny64))
    shared_loss, shared = _loss_and_grads(lora_tiny64, scorer, sequences, weights, shared=True)
    alone_loss, alone = _loss_and_grads(lora_tiny64, scorer, sequences, weights, shared=False)
    assert shared_loss.item() == pytest.approx(alone_loss.item(), rel=1e-10)
    assert shared.keys() == alone.keys() and len(shared) > 0
    for name in shared:
        scale = alone[name].abs().max().item()
        assert scale > 0, name
        assert (shared[name] - alone[name]).abs().max().item() <= 1e-10 * scale, name
    # the shared pass computed every distinct prefix once: the prompt once, not four times
    inputs = [s[:-1] for s in sequences]
    run = scorer.run(inputs)
    distinct = {tuple(s[:t + 1]) for s in inputs for t in range(len(s))}
    assert run.hidden.shape[0] == len(distinct) < sum(map(len, inputs)) - 2 * len(prompt)


def _head_products_in_backward(scorer, sequences, monkeypatch):
    """(logprobs, adapter gradients, shapes of the products giving logits during the backward) of a logprob sum."""
    from rlrunbook.kernels import cpu

    model = scorer.decoder.model
    vocab = scorer.decoder.vocab_size
    model.zero_grad(set_to_none=True)
    run = scorer.run([s[:-1] for s in sequences])
    rows = torch.tensor([r for path in run.flat for r in path])
    targets = torch.tensor([t for s in sequences for t in s[1:]])
    logprobs = scorer.score(run.hidden, rows, targets).logprobs
    logits = []  # b [V, K] for gemm_nt, [K, V] for gemm_seq: a product whose columns are the vocabulary

    def watch(name, column_side):
        original = getattr(cpu, name)

        def run(a, b, *args, **kwargs):
            if b.shape[column_side] == vocab:
                logits.append((name, tuple(b.shape)))
            return original(a, b, *args, **kwargs)

        monkeypatch.setattr(cpu, name, run)

    watch("gemm_nt", 0)
    watch("gemm_seq", 1)
    (logprobs * torch.linspace(-1.0, 1.0, logprobs.numel())).sum().backward()
    monkeypatch.undo()
    grads = {n: p.grad.clone() for n, p in adapter_parameters(model).items()}
    return logprobs.detach(), grads, logits


def test_a_frozen_output_layer_gives_the_hidden_gradient_without_running_again(tiny_folder, monkeypatch):
    """LoRA without the output layer: the backward does not recompute a chunk's logits (it reads what the forward
    kept, ops.frozen_head_logprobs); the logprobs are the recomputing path's bits, the gradients its values up to
    the order of float32 additions."""
    from rlrunbook.models import load_causal_lm

    model = wrap_with_lora(load_causal_lm(tiny_folder, dtype=torch.float32), rank=4, alpha=8, seed=0,
                           train_unembed=False)
    with torch.no_grad():
        for name, p in adapter_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    prompt = [1, 285, 201, 279, 261, 223, 40]
    sequences = [prompt + [99, 7, 500, 18, 3], prompt + [99, 7, 61], prompt + [4, 4, 4]]
    scorer = SharedPrefixScorer(Decoder(model))
    assert scorer.decoder.head_frozen
    direct, direct_grads, direct_wide = _head_products_in_backward(scorer, sequences, monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(Decoder, "head_frozen", property(lambda self: False))
        again, again_grads, again_wide = _head_products_in_backward(scorer, sequences, patch)
    assert direct_wide == [] and len(again_wide) >= 1
    assert torch.equal(direct, again)
    assert direct_grads.keys() == again_grads.keys() and len(direct_grads) > 0
    for name, grad in direct_grads.items():
        scale = again_grads[name].abs().max().item()
        assert scale > 0, name
        assert (grad - again_grads[name]).abs().max().item() <= 1e-4 * scale, name
