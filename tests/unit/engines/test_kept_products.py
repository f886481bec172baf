"""Kept products (engines/kept_products.py): a sampling call keeps the layers' projection outputs of every token it
computes, and the trainer's pass over those tokens reads them instead of computing them, with the same values and
gradients, bit for bit.

Models are built from small configs with random weights and random LoRA factors (B non-zero, so every adapter
changes what the next layer reads).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from rlrunbook.backend.lora import clone_adapter, wrap_with_lora
from rlrunbook.backend.memory import LiveBytes
from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.engines.kept_products import KeptProducts
from rlrunbook.engines.shared_prefix import SharedPrefixScorer
from rlrunbook.kernels import cpu

VOCAB = 320
STOPS = tuple((token,) for token in range(3, 60))  # about one draw in six stops: rows stop inside decode blocks


def _model(hidden: int, dtype: torch.dtype, train_unembed: bool = True, rank: int = 8,
           bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256, hidden_size=hidden,
                         intermediate_size=hidden + hidden // 2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False, attention_bias=bias)
    model = wrap_with_lora(LlamaForCausalLM(config).to(dtype).eval(), rank=rank, alpha=3 * rank, seed=0,
                           train_unembed=train_unembed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.2)
    return model


def _sampled(model: torch.nn.Module, budget: int = 1 << 30, stop=STOPS, prompt_lengths: list[int] | None = None,
             samples: int = 3, max_tokens: int = 12) -> tuple[HFSamplingEngine, list[list[int]]]:
    """An engine that kept its call's products, and the sequences a trainer reads (prompt + completion, last
    token dropped); ``prompt_lengths`` gets each sequence's prompt length."""
    engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=VOCAB, max_context=256, kept_products_bytes=budget)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(60, VOCAB, (length,), generator=generator).tolist() for length in (3, 11, 11, 30)]
    request = GenerationRequest(max_tokens=max_tokens, filters=SamplingFilters(1.0), stop=stop, seed=7)
    with engine.pinned_weights(clone_adapter(model), key="snapshot"):
        results = engine.sample_jobs([SampleJob(p, samples, request) for p in prompts], weights_key="snapshot")
    pairs = [(prompt + list(c.tokens)[:-1], len(prompt)) for prompt, group in zip(prompts, results) for c in group]
    pairs = [(tokens, length) for tokens, length in pairs if len(tokens) > length]  # at least one sampled target
    if prompt_lengths is not None:
        prompt_lengths[:] = [length for _, length in pairs]
    return engine, [tokens for tokens, _ in pairs]


def _training_pass(model: torch.nn.Module, sequences, kept: KeptProducts | None):
    """The trainer's pass (its own decoder) over ``sequences``: final hidden states, every adapter gradient of a
    fixed random projection of them, and how many tokens read kept products."""
    scorer = SharedPrefixScorer(Decoder(model))
    run = scorer.run(sequences, kept=kept)
    weights = torch.randn(run.hidden.shape, generator=torch.Generator().manual_seed(3)).to(run.hidden.dtype)
    (run.hidden * weights).float().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return run.hidden.detach(), grads, scorer.kept_tokens


@pytest.mark.parametrize("hidden,dtype,bias", [(64, torch.float32, False), (160, torch.float32, False),
                                               (160, torch.bfloat16, False), (64, torch.float32, True)],
                         ids=["llama-64-fp32", "llama-160-fp32", "llama-160-bf16", "llama-64-fp32-biases"])
def test_the_training_pass_over_sampled_tokens_reads_them_with_the_same_bits(hidden, dtype, bias):
    model = _model(hidden, dtype, bias=bias)
    engine, sequences = _sampled(model)
    assert engine.kept is not None and engine.kept.nbytes > 0
    kept_hidden, kept_grads, read = _training_pass(model, sequences, engine.kept)
    hidden_states, grads, computed = _training_pass(model, sequences, None)
    assert read == hidden_states.shape[0] and computed == 0  # every token read its products
    assert torch.equal(kept_hidden, hidden_states)
    assert kept_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(kept_grads[name], grad), name


def test_a_releasing_pass_frees_each_group_as_it_reads_it_with_the_same_bits(monkeypatch):
    """The last pass over the kept outputs (``release_kept``) frees each group's tensors, in every block, as its layer
    gathers them: before its layers' second group is read the first group's are gone, and by the end of its forward
    (before its backward) every group it read is freed. Its values and gradients are a computing pass's; after it the
    record gives nothing, and a pass over the same tokens computes its products with the same bits."""
    import weakref

    from rlrunbook.engines.kept_products import KeptRows

    model = _model(64, torch.float32)
    engine, sequences = _sampled(model)
    kept = engine.kept
    blocks = len(kept._blocks)
    refs = [weakref.ref(tensor) for block in kept._blocks for tensor in block.tensors.values()]
    alive_at_reads = []
    read = KeptRows.__getitem__
    monkeypatch.setattr(KeptRows, "__getitem__",
                        lambda self, key: alive_at_reads.append(sum(r() is not None for r in refs)) or read(self, key))
    scorer = SharedPrefixScorer(Decoder(model))
    run = scorer.run(sequences, kept=kept, release_kept=True)
    alive_after_forward = sum(r() is not None for r in refs)
    weights = torch.randn(run.hidden.shape, generator=torch.Generator().manual_seed(3))
    (run.hidden * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    groups = len(refs) // blocks
    assert groups == 2 * 4 and scorer.kept_tokens == run.hidden.shape[0]  # 2 layers x 4 groups, every token read
    assert alive_at_reads == [len(refs) - i * blocks for i in range(groups)]
    assert alive_after_forward == 0 and kept.released
    hidden_states, expected, _ = _training_pass(model, sequences, None)
    assert torch.equal(run.hidden.detach(), hidden_states)
    assert grads.keys() == expected.keys() and all(torch.equal(grads[n], g) for n, g in expected.items())
    again = _training_pass(model, sequences, kept)
    assert again[2] == 0 and torch.equal(again[0], hidden_states)  # released: the pass computes
    assert all(torch.equal(again[1][n], g) for n, g in expected.items())


def test_a_sampling_call_after_a_releasing_pass_keeps_its_products_in_a_new_record():
    model = _model(64, torch.float32)
    engine, sequences = _sampled(model)
    released = engine.kept
    SharedPrefixScorer(Decoder(model)).run(sequences, kept=released, release_kept=True)
    request = GenerationRequest(max_tokens=4, filters=SamplingFilters(1.0), seed=9)
    prompt = torch.randint(60, VOCAB, (9,), generator=torch.Generator().manual_seed(2)).tolist()  # not in the pool
    with engine.pinned_weights(released.weights, key="snapshot"):  # the same snapshot as the released record's
        results = engine.sample_jobs([SampleJob(prompt, 2, request)], weights_key="snapshot")
    assert engine.kept is not released and not engine.kept.released
    new = [prompt + list(c.tokens)[:-1] for c in results[0]]
    assert _training_pass(model, new, engine.kept)[2] > 0


def test_a_token_that_was_not_sampled_makes_the_pass_compute():
    model = _model(64, torch.float32)
    engine, sequences = _sampled(model)
    changed = [*sequences[:-1], sequences[-1][:-1] + [(sequences[-1][-1] + 1) % VOCAB]]
    kept_hidden, kept_grads, read = _training_pass(model, changed, engine.kept)
    hidden_states, grads, _ = _training_pass(model, changed, None)
    assert read == 0
    assert torch.equal(kept_hidden, hidden_states)
    assert all(torch.equal(kept_grads[name], grad) for name, grad in grads.items())


def test_a_call_past_its_budget_keeps_what_fit_and_the_pass_computes():
    model = _model(64, torch.float32)
    # 3,584 bytes per token (2 layers x 896 columns in float32) in a block of 256 rows, and 1,280 bytes of logits
    # per drawn token: the budget holds the block, the logits after the 4 prompts and after the first decode step's
    # 12 rows; the second step's products fit the block, its logits do not, and nothing more is kept
    budget = 256 * 3_584 + (4 + 12) * 1_280
    engine, sequences = _sampled(model, budget=budget)
    kept = engine.kept
    assert kept.row_bytes == 3_584 and kept.full and kept.nbytes == budget and kept.last_rows == 55 + 2 * 16
    assert _training_pass(model, sequences, kept)[2] == 0
    prompt_only = [sequences[0][:3]]  # the first prompt was prefilled, within the budget
    assert _training_pass(model, prompt_only, kept)[2] == 3


def test_the_pass_adds_no_update_where_it_reads_the_kept_outputs(monkeypatch):
    """The kept values are the projections' outputs, adapters' updates included: a pass that reads them computes
    each adapter's first product (its backward keeps it) and no addition (2 layers x 7 projections otherwise)."""
    model = _model(64, torch.float32)
    engine, sequences = _sampled(model)
    calls = []
    real = cpu.lora_added
    monkeypatch.setattr(cpu, "lora_added", lambda *args: calls.append(args[0].shape) or real(*args))
    assert _training_pass(model, sequences, engine.kept)[2] > 0
    assert calls == []
    _training_pass(model, sequences, None)
    assert len(calls) == 2 * 7


def test_a_rank_over_small_k_computes_its_projections_with_the_same_bits():
    """A rank the one-kernel addition does not take (over SMALL_K): the sampler keeps its outputs, and the trainer's
    pass computes them (with the backward of its own chain), giving the bits of a pass that reads nothing."""
    model = _model(64, torch.float32, rank=cpu.SMALL_K + 1)
    engine, sequences = _sampled(model)
    assert engine.kept is not None and engine.kept.nbytes > 0
    kept_hidden, kept_grads, _ = _training_pass(model, sequences, engine.kept)
    hidden_states, grads, _ = _training_pass(model, sequences, None)
    assert torch.equal(kept_hidden, hidden_states)
    assert kept_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(kept_grads[name], grad), name


def test_only_a_snapshot_equal_to_the_live_adapter_matches():
    model = _model(64, torch.float32)
    engine, _ = _sampled(model)
    live = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    assert engine.kept.matches(live)
    with torch.no_grad():
        next(p for name, p in model.named_parameters() if "lora_A" in name).view(-1)[0] += 1e-7
    assert not engine.kept.matches(live)
    assert not engine.kept.matches({name: tensor for name, tensor in list(live.items())[1:]})


def test_rows_are_gathered_in_the_pass_order_by_token_prefix():
    """Two passes kept by hand: a prefill of [5, 6, 7] and [5, 8], then a decode step feeding 9 after [5, 6, 7]."""
    kept = KeptProducts({}, "k", budget=1 << 20)
    key = (1, 2)
    values = torch.arange(8.0).view(4, 2)  # prefill rows: [5], [5, 6], [5, 6, 7], [5, 8]
    kept.begin()
    kept.buffer(key, 4, 2, torch.float32).copy_(values)
    assert kept.end() == 0
    kept.place([5, 6, 7], {0: 0, 1: 1, 2: 2})
    kept.place([5, 8], {1: 3})
    kept.begin()
    kept.buffer(key, 2, 2, torch.float32).copy_(torch.tensor([[10.0, 11.0], [12.0, 13.0]]))  # cache rows 0, 1
    assert kept.end() == 4
    kept.place([5, 6, 7, 9], {3: 4 + 1})  # the step's cache row 1 fed token 9
    assert kept.last_rows == 6 and kept.nbytes == 256 * 2 * 4  # one block
    # A pass over [5, 8] and [5, 6, 7, 9], its rows in its own order: [5, 6, 7, 9], [5, 8], [5, 6, 7], [5], [5, 6]
    gathered = kept.read([[5, 8], [5, 6, 7, 9]], [[3, 1], [3, 4, 2, 0]], 5)[0]
    assert gathered[key].tolist() == [[12.0, 13.0], [6.0, 7.0], [4.0, 5.0], [0.0, 1.0], [2.0, 3.0]]
    assert kept.read([[5, 6, 7, 10]], [[0, 1, 2, 3]], 4)[0] is None  # [.., 10] was never computed
    assert kept.read([[5, 7]], [[0, 1]], 2)[0] is None


def test_a_read_gathers_each_group_when_it_is_read_not_every_group_at_once():
    """A pass reads its layers' groups one after another: :meth:`KeptProducts.read` allocates nothing, and each
    group's copy is made when read, so a pass that lets each go holds one group's rows at a time (all 40 groups
    gathered at once held 40 x 300 rows x 64 columns; here the peak is one group's 77 KB)."""
    kept = KeptProducts({}, "k", budget=1 << 30)
    keys = [(layer, group) for layer in range(10) for group in range(4)]
    kept.begin()
    for key in keys:
        kept.buffer(key, 300, 64, torch.float32).copy_(torch.full((300, 64), float(hash(key) % 97)))
    kept.end()
    kept.place(list(range(300)), {t: t for t in range(300)})
    with LiveBytes() as live:
        products = kept.read([list(range(300))], [list(range(299, -1, -1))], 300)[0]
        assert live.peak == 0
        for key in keys:
            rows = products[key]
            assert rows.shape == (300, 64) and rows[0, 0].item() == float(hash(key) % 97)
            del rows
    assert live.peak <= 300 * 64 * 4 + 4096, live.peak
    assert set(products) == set(keys) and len(products) == len(keys) and products.get((99, 0)) is None


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=5), width=st.integers(1, 40), count=st.integers(0, 30),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), threads=st.integers(1, 3), seed=st.integers(0, 999))
def test_gather_rows_copies_each_picked_row_of_its_own_source(lengths, width, count, dtype, threads, seed):
    """Rows of several tensors (one of them a column slice, so its rows are longer than its width) in any order,
    repeats included: row for row what indexing each source gives."""
    generator = torch.Generator().manual_seed(seed)
    sources = [torch.randn(n, width + 3, generator=generator).to(dtype)[:, 1:width + 1] if i == 0 else
               torch.randn(n, width, generator=generator).to(dtype) for i, n in enumerate(lengths)]
    filled = [i for i, n in enumerate(lengths) if n]
    if not filled:
        count = 0
    picks = [(filled[j % len(filled)], 0) for j in range(count)]
    picks = [(i, int(torch.randint(0, lengths[i], (1,), generator=generator))) for i, _ in picks]
    source_of = torch.tensor([i for i, _ in picks], dtype=torch.long)
    row_of = torch.tensor([r for _, r in picks], dtype=torch.long)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu.gather_rows(sources, source_of, row_of)
    finally:
        torch.set_num_threads(previous)
    assert out.shape == (count, width) and out.dtype == dtype and out.is_contiguous()
    for m, (i, r) in enumerate(picks):
        assert torch.equal(out[m], sources[i][r])


def test_gather_rows_refuses_a_row_outside_its_source():
    sources = [torch.zeros(3, 4), None, torch.ones(2, 4)]
    rows = cpu.gather_rows(sources, torch.tensor([2, 0]), torch.tensor([1, 2]))
    assert rows.tolist() == [[1.0] * 4, [0.0] * 4]
    for source_of, row_of in (([2], [2]), ([0], [-1]), ([1], [0]), ([3], [0])):
        with pytest.raises(ValueError, match="outside its source"):
            cpu.gather_rows(sources, torch.tensor(source_of), torch.tensor(row_of))
    with pytest.raises(ValueError, match="one dtype and width"):
        cpu.gather_rows([torch.zeros(2, 4), torch.zeros(2, 5)], torch.tensor([0]), torch.tensor([0]))


def test_a_pass_with_other_groups_or_rows_is_not_kept():
    kept = KeptProducts({}, None, budget=1 << 20)
    kept.begin()
    kept.buffer((1,), 2, 3, torch.float32)
    kept.buffer((2,), 2, 5, torch.float32)
    assert kept.end() == 0
    kept.begin()
    kept.buffer((1,), 2, 3, torch.float32)
    assert kept.end() is None  # group (2,) missing
    kept.begin()
    kept.buffer((1,), 2, 3, torch.float32)
    assert kept.buffer((2,), 3, 5, torch.float32) is None  # other rows than the pass's
    assert kept.end() is None
    kept.begin()
    kept.buffer((1,), 2, 3, torch.float32)
    assert kept.buffer((3,), 2, 5, torch.float32) is None  # a group the first pass did not keep
    assert kept.end() is None
    assert kept.last_rows == 2


def test_the_pass_reads_the_kept_values_instead_of_computing_them():
    model = _model(64, torch.float32)
    engine, sequences = _sampled(model)
    hidden_states = _training_pass(model, sequences, None)[0]
    for block in engine.kept._blocks:
        for tensor in block.tensors.values():
            tensor.mul_(1.5)  # no longer what the products give
    assert not torch.equal(_training_pass(model, sequences, engine.kept)[0], hidden_states)


def _trained_logprobs(model: torch.nn.Module, sequences, prompts: list[int], kept: KeptProducts | None,
                      read_logits: bool = True):
    """The trainer's logprobs of every sampled token and the adapter's gradient of their sum with random weights
    (an output layer not trained: its direct pass; a trained one: its adapter's pass, checkpointed)."""
    scorer = SharedPrefixScorer(Decoder(model))
    run = scorer.run(sequences, kept=kept)
    rows = torch.tensor([row for path, length in zip(run.flat, prompts) for row in path[length - 1:-1]])
    targets = torch.tensor([token for tokens, length in zip(sequences, prompts) for token in tokens[length:]])
    logprobs = scorer.score(run.hidden, rows, targets, logits=run.logits if read_logits else None).logprobs
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(5))
    (logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logprobs.detach(), grads, run.logits


@pytest.mark.parametrize("train_unembed", [False, True], ids=["frozen-head", "trained-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_logprobs_of_sampled_tokens_read_the_kept_logits_with_the_same_bits(dtype, train_unembed):
    model = _model(160, dtype, train_unembed=train_unembed)
    prompts: list[int] = []
    # 16 rows, about one draw in 30 stops: rows stop, and the batch goes on without them (not shrunk), so a step's
    # logits rows (its running rows) are not its cache rows
    engine, sequences = _sampled(model, stop=tuple((token,) for token in range(3, 14)), prompt_lengths=prompts,
                                 samples=4, max_tokens=24)
    assert min(map(len, sequences)) < max(map(len, sequences)) - 5
    kept_logprobs, kept_grads, logits = _trained_logprobs(model, sequences, prompts, engine.kept)
    logprobs, grads, _ = _trained_logprobs(model, sequences, prompts, None)
    assert logits is not None and engine.kept.logit_bytes > 0
    assert torch.equal(kept_logprobs, logprobs)
    assert kept_grads.keys() == grads.keys() and all(torch.equal(kept_grads[n], g) for n, g in grads.items())
    assert any("lm_head.lora_B" in name for name in grads) == train_unembed


@pytest.mark.parametrize("train_unembed", [False, True], ids=["frozen-head", "trained-head"])
def test_the_logprobs_read_the_kept_logits_instead_of_computing_them(train_unembed):
    model = _model(64, torch.float32, train_unembed=train_unembed)
    prompts: list[int] = []
    engine, sequences = _sampled(model, prompt_lengths=prompts)
    logprobs = _trained_logprobs(model, sequences, prompts, engine.kept, read_logits=False)[0]
    for logits in engine.kept._logits:
        logits.add_(0.5)  # log-softmax does not move; the target's logit alone does
        logits[:, 0] += 7.0
    assert not torch.equal(_trained_logprobs(model, sequences, prompts, engine.kept)[0], logprobs)


def test_passes_fill_blocks_and_a_new_record_writes_the_last_ones_blocks_again():
    kept = KeptProducts({}, "a", budget=1 << 30)
    firsts = []
    for rows in (200, 100, 100, 300):  # 200 fits block 0 (256 rows); 100 opens block 1, 100 fits it; 300 is its own
        kept.begin()
        kept.buffer((1,), rows, 3, torch.float32).fill_(rows)
        firsts.append(kept.end())
    assert firsts == [0, 256, 356, 512]
    gathered = kept.read([[7]], [[0]], 1)[0] is None  # nothing placed yet
    kept.place(list(range(4)), {0: 0, 1: 256, 2: 356, 3: 512})
    values = kept.read([list(range(4))], [[3, 2, 1, 0]], 4)[0][(1,)]
    assert gathered and values[:, 0].tolist() == [300.0, 100.0, 100.0, 200.0]
    blocks = {id(t) for block in kept._blocks for t in block.tensors.values()}
    renewed = KeptProducts({}, "b", budget=1 << 30, spares=kept)
    renewed.begin()
    renewed.buffer((1,), 50, 3, torch.float32)
    renewed.end()
    assert {id(t) for block in renewed._blocks for t in block.tensors.values()} <= blocks
    assert kept.read([list(range(4))], [[3, 2, 1, 0]], 4)[0] is None  # the old record gave its blocks away


def test_known_logits_are_refused_where_the_decoder_could_not_give_them():
    """Known logits stand in for the output layer's pass only under the fixed numerics, with at most one adapter on
    the output layer: elsewhere the decoder says so, and a pass handed them anyway fails, naming the check."""
    model = _model(64, torch.float32)
    hidden, known = torch.randn(2, 64), torch.randn(2, VOCAB)
    assert Decoder(model).reads_known_logits(hidden) and not Decoder(model).reads_known_logits(hidden.double())
    fast = Decoder(model, "native")
    assert not fast.reads_known_logits(hidden)
    with pytest.raises(RuntimeError, match="reads_known_logits"):
        fast.logits(hidden, known)
    model.add_adapter("second", model.peft_config["default"])
    model.base_model.set_adapter(["default", "second"])  # two adapters added to every layer
    assert not Decoder(model).reads_known_logits(hidden)
