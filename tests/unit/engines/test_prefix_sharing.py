"""Decode attention that reads a prompt prefix shared by several rows once per group of rows: the plan
(:mod:`rlrunbook.engines.prefix_sharing`) and the kernel give every row the bits of the unshared step, and the
engine's samples are unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.engines.prefix_sharing import Sharing, common_prefixes, decode_parts, kept_rows
from rlrunbook.kernels import fused

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def test_rows_are_taken_in_the_order_of_their_prompts_each_sharing_with_the_one_before():
    article, other = list(range(100, 140)), list(range(500, 540))
    sequences = [article + [1, 2], other, article + [1, 3, 4], article + [9], article[:10] + [7] * 30, other]
    sharing = common_prefixes(sequences, rows=8, min_shared=16)
    # sorted: 4 (article[:10]+7s) < 0 (article+1,2) < 2 (article+1,3,4) < 3 (article+9) < 1 = 5 (other)
    assert sharing.order == (4, 0, 2, 3, 1, 5, 6, 7)
    assert sharing.reload == (0, 0, 41, 40, 0, 40, 0, 0)  # row 0 shares only 10 (< 16) with row 4
    assert common_prefixes(sequences, rows=6, min_shared=41).reload == (0, 0, 41, 0, 0, 0)


def test_identical_prompts_share_all_of_them():
    sharing = common_prefixes([[5, 6, 7] * 10] * 4, rows=4)
    assert sharing.order == (0, 1, 2, 3) and sharing.reload == (0, 30, 30, 30)


def test_kept_rows_share_the_least_of_what_lay_between_them():
    sharing = Sharing(order=(3, 0, 1, 2, 4), reload=(40, 30, 50, 0, 60))
    # order 3 -> 0 (40) -> 1 (30) -> 2 (50) -> 4 (60); keep 3, 2 and 4: 2 shares min(40, 30, 50) with 3
    kept = kept_rows(sharing, [2, 3, 4], rows=4)
    assert kept.order == (1, 0, 2, 3) and kept.reload == (30, 0, 60, 0)
    assert kept_rows(sharing, [0, 4], rows=2) == Sharing(order=(0, 1), reload=(0, 30))


@pytest.mark.parametrize(("threads", "kv_heads", "starts"), [(1, 3, [0, 8]), (2, 3, [0, 3, 8]),
                                                             (2, 1, [0, 2, 4, 6, 8])])
def test_parts_are_cut_about_evenly_where_least_is_shared(threads, kv_heads, starts):
    sharing = Sharing(order=tuple(range(8)), reload=(0, 50, 50, 0, 50, 50, 10, 50))
    plan = decode_parts(sharing, kv_heads, threads)
    assert plan.starts.tolist() == starts and plan.order.tolist() == list(range(8))


def _prompts(seed: int, rows: int, longest: int) -> list[list[int]]:
    """Prompts over a 3-token alphabet from a few stems: long common prefixes, some identical."""
    generator = torch.Generator().manual_seed(seed)
    stems = [torch.randint(0, 3, (longest,), generator=generator).tolist() for _ in range(3)]
    prompts = []
    for _ in range(rows):
        stem = stems[int(torch.randint(0, 3, (1,), generator=generator))]
        cut = int(torch.randint(0, longest + 1, (1,), generator=generator))
        tail = torch.randint(0, 3, (int(torch.randint(0, 4, (1,), generator=generator)),), generator=generator)
        prompts.append((stem[:cut] + tail.tolist()) or [0])
    return prompts


def _caches(seed, prompts, capacity, kv_heads, dim, dtype):
    """Caches as the engine fills them: an entry of a prompt is a function of the prompt's tokens up to it (one
    random vector per distinct prefix), entries past the prompt are the row's own."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(prompts)
    keys = torch.randn(rows, capacity, kv_heads, dim, generator=generator).to(dtype)
    values = torch.randn(rows, capacity, kv_heads, dim, generator=generator).to(dtype)
    made: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    for row, prompt in enumerate(prompts):
        for t in range(len(prompt)):
            prefix = tuple(prompt[: t + 1])
            if prefix not in made:
                made[prefix] = (torch.randn(kv_heads, dim, generator=generator).to(dtype),
                                torch.randn(kv_heads, dim, generator=generator).to(dtype))
            keys[row, t], values[row, t] = made[prefix]
    return keys, values


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), longest=st.integers(1, 60), extra=st.integers(1, 8), heads_per_kv=st.integers(1, 3),
       kv_heads=st.integers(1, 3), dim=st.sampled_from([8, 16, 24, 64]), threads=st.integers(1, 4), dtype=DTYPES,
       min_shared=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16))
def test_a_shared_prefix_read_once_gives_every_row_the_bits_of_reading_its_own(rows, longest, extra, heads_per_kv,
                                                                               kv_heads, dim, threads, dtype,
                                                                               min_shared, seed):
    prompts = _prompts(seed, rows, longest)
    lengths = torch.tensor([len(prompt) for prompt in prompts]) + torch.randint(0, extra, (rows,))
    window = int(lengths.max()) + 1
    capacity, heads = window + 2, heads_per_kv * kv_heads
    keys, values = _caches(seed, prompts, capacity, kv_heads, dim, dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    positions, valid = torch.arange(capacity), torch.ones(capacity, dtype=torch.uint8)
    plan = decode_parts(common_prefixes(prompts, rows, min_shared), kv_heads, threads)
    outputs = []
    for parts in (None, (plan.order, plan.starts, plan.reload)):
        outputs.append(fused.cached_attention(qkv, keys.clone(), values.clone(), lengths, positions, valid, window,
                                              heads, kv_heads, dim, dim ** -0.5, parts))
    assert torch.equal(outputs[0], outputs[1])


def test_the_shared_prefix_is_read_from_the_row_before():
    """The mechanism is used: a row that claims a prefix it does not hold gets the row before it's keys and values
    there (float32 values of whole vectors, read in place, are read where the part's first row's are)."""
    rows, capacity, kv_heads, heads, dim = 2, 32, 2, 4, 16  # one part: 2 items for the one thread
    keys, values = _caches(3, [[0] * 20, [1] * 20], capacity, kv_heads, dim, torch.float32)  # nothing shared
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([20, 20])
    positions, valid = torch.arange(capacity), torch.ones(capacity, dtype=torch.uint8)
    claimed = decode_parts(Sharing(order=(0, 1), reload=(0, 20)), kv_heads, threads=1)
    assert claimed.parts == 1
    args = (lengths, positions, valid, capacity, heads, kv_heads, dim, 0.25)
    own = fused.cached_attention(qkv, keys.clone(), values.clone(), *args)
    shared = fused.cached_attention(qkv, keys.clone(), values.clone(), *args,
                                    (claimed.order, claimed.starts, claimed.reload))
    assert torch.equal(own[0], shared[0]) and not torch.equal(own[1], shared[1])
    copied_keys, copied_values = keys.clone(), values.clone()
    copied_keys[1, :20] = keys[0, :20]
    assert not torch.equal(fused.cached_attention(qkv, copied_keys, values.clone(), *args)[1], shared[1])
    copied_values[1, :20] = values[0, :20]
    assert torch.equal(fused.cached_attention(qkv, copied_keys, copied_values, *args)[1], shared[1])


def test_a_plan_for_other_rows_is_refused():
    plan = decode_parts(Sharing(order=(0, 1, 2), reload=(0, 5, 5)), 2, 1)
    cache = torch.zeros(2, 8, 1, 8)
    with pytest.raises(ValueError, match="parts for 3 rows"):
        fused.cached_attention(torch.zeros(2, 32), cache, cache.clone(), torch.zeros(2, dtype=torch.long),
                               torch.arange(8), torch.ones(8, dtype=torch.uint8), 8, 2, 1, 8, 1.0,
                               (plan.order, plan.starts, plan.reload))


def test_samples_are_the_same_bits_with_the_prefix_read_once(monkeypatch):
    """Debate-like prompts (one article, then different turns; some sampled twice) through the engine, with the
    shared prefix read once per group and once per row: the same tokens and logprobs. Rows stop at different
    steps, so the batch shrinks and the groups are carried into the smaller cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlrunbook.backend.lora import wrap_with_lora
    from rlrunbook.engines.base import GenerationRequest, SampleJob
    from rlrunbook.engines.filters import SamplingFilters
    from rlrunbook.engines.hf import HFSamplingEngine
    from rlrunbook.engines.layouts import RowCache

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512)
    model = wrap_with_lora(LlamaForCausalLM(config).eval(), rank=4, alpha=8, seed=0)
    generator = torch.Generator().manual_seed(2)
    article = torch.randint(3, 96, (70,), generator=generator).tolist()
    prompts = [article + torch.randint(3, 96, (n,), generator=generator).tolist() for n in (1, 5, 9, 20)]
    prompts.append(torch.randint(3, 96, (40,), generator=generator).tolist())  # shares nothing
    stops = tuple((t,) for t in (14, 84, 58, 70, 4, 11, 27, 33))  # drawn by this model at various steps
    seen: list = []
    plain = RowCache.share_prefixes

    def recording(cache, sharing):
        seen.append(sharing)
        plain(cache, sharing)

    monkeypatch.setattr(RowCache, "share_prefixes", recording)
    results = []
    for share in (True, False):
        engine = HFSamplingEngine(model, pad_token_id=0, vocab_size=96, max_context=512, share_prefixes=share)
        completions = engine.sample_jobs([SampleJob(p, 3, GenerationRequest(24, SamplingFilters(1.0), stops, seed))
                                          for seed, p in enumerate(prompts)])
        results.append([[(c.tokens, c.logprobs, c.stop_reason) for c in group] for group in completions])
    assert results[0] == results[1]
    assert {len(c[0]) for group in results[0] for c in group} != {24}  # rows stopped at different steps
    grouped = [sharing for sharing in seen if sharing.any]
    assert grouped and max(grouped[0].reload) >= 70
    assert len(grouped) >= 2  # the groups were carried into a smaller cache as rows finished
