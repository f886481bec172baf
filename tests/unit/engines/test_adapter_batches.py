"""Several samplers' adapters in one decode batch (HFSamplingEngine.sample_adapters): each row computes with its own
sampler's LoRA snapshot, and gets bitwise what that sampler gets sampling alone.

The snapshots are random LoRA factors of one layout (B non-zero: every adapter changes every output), one sampler
of the base model (adapter off), prompts that repeat across samplers (the same tokens under different adapters
have different keys and values: rows of two samplers must never share a cached prefix), stops that end rows at
different steps (the batch shrinks across slot boundaries), and batches cut by ``max_batch_rows`` so that one
batch may hold a single sampler's rows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlrunbook.backend.lora import clone_adapter, wrap_with_lora
from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import MAX_ADAPTERS, AdapterJobs, HFSamplingEngine
from rlrunbook.engines.pinned_adapter import RowAdapters


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return wrap_with_lora(LlamaForCausalLM(config).to(dtype).eval(), rank=8, alpha=24, seed=0)


def _snapshots(model: torch.nn.Module, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` different adapters of ``model``'s layout."""
    generator = torch.Generator().manual_seed(5)
    snapshots = []
    for _ in range(count):
        snapshot = clone_adapter(model)
        for name, tensor in snapshot.items():
            spread = 0.3 if "lora_B" in name else 0.1
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * spread)
        snapshots.append(snapshot)
    return snapshots


def _jobs(offset: int) -> list[SampleJob]:
    generator = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 320, (20,), generator=generator).tolist()  # every sampler's first prompt
    own = torch.randint(3, 320, (9 + offset,), generator=generator).tolist()
    stops = tuple((token,) for token in range(3, 320, 9))  # one token in nine ends a row: rows end at many steps
    request = GenerationRequest(max_tokens=12, filters=SamplingFilters(0.9), stop=stops, seed=3)
    return [SampleJob(shared, 3, request), SampleJob(shared + own, 2, request), SampleJob(own, 1, request)]


def _outcome(results) -> list:
    return [[(c.tokens, c.logprobs, c.policy_logprobs, c.stop_reason) for c in job] for job in results]


def _engine(model: torch.nn.Module, rows: int) -> HFSamplingEngine:
    return HFSamplingEngine(model, pad_token_id=0, vocab_size=320, max_context=256, max_batch_rows=rows)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "chain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_samplers_rows_get_what_it_gets_alone(dtype, fused, monkeypatch):
    monkeypatch.setattr(Decoder, "use_fused", fused)
    model = _model(dtype)
    adapters = [*_snapshots(model, 3), None]  # three trained snapshots and the base model
    groups = [AdapterJobs(adapter, f"snapshot-{i}", _jobs(i)) for i, adapter in enumerate(adapters)]
    alone_engine = _engine(model, 256)
    alone = []
    for group in groups:
        with alone_engine.pinned_weights(group.adapter, group.key):
            alone.append(_outcome(alone_engine.sample_jobs(group.jobs, weights_key=group.key)))
    assert len({str(outcome) for outcome in alone}) == len(groups)  # the adapters make a difference
    for rows in (256, 4):  # one batch; batches of 4 rows, some holding one sampler's rows only
        engine = _engine(model, rows)
        for _ in range(2):  # the second call reads the prefixes the first left in each adapter's pool
            assert [_outcome(r) for r in engine.sample_adapters(groups)] == alone
        assert len(engine._caches) > 1, "the batch never shrank: rows leaving across slots went untested"


def test_a_sampler_alone_after_a_mixed_call_is_unchanged():
    """The engine's own pinned state and pools after a call of several adapters: a plain call still samples its
    own snapshot."""
    model = _model(torch.float32)
    first, second = _snapshots(model, 2)
    jobs = _jobs(0)
    fresh = _engine(model, 256)
    with fresh.pinned_weights(first, "a"):
        expected = _outcome(fresh.sample_jobs(jobs, weights_key="a"))
    engine = _engine(model, 256)
    engine.sample_adapters([AdapterJobs(second, "b", jobs), AdapterJobs(first, "a", jobs)])
    with engine.pinned_weights(first, "a"):
        assert _outcome(engine.sample_jobs(jobs, weights_key="a")) == expected


def test_what_a_sampler_generated_is_kept_for_its_own_adapter_only():
    """A row's generated keys and values go to its own adapter's prefix pool: when both samplers next extend what
    the second one generated, the first must not read the second's keys and values for those tokens."""
    model = _model(torch.float32)
    first, second = _snapshots(model, 2)
    jobs = _jobs(0)[:1]
    engine = _engine(model, 256)
    _, theirs = engine.sample_adapters([AdapterJobs(first, "a", jobs), AdapterJobs(second, "b", jobs)])
    extended = [SampleJob(jobs[0].prompt + theirs[0][0].tokens, 2, jobs[0].request)]
    mixed = engine.sample_adapters([AdapterJobs(first, "a", extended), AdapterJobs(second, "b", extended)])
    for adapter, key, result in ((first, "a", mixed[0]), (second, "b", mixed[1])):
        fresh = _engine(model, 256)
        with fresh.pinned_weights(adapter, key):
            assert _outcome(result) == _outcome(fresh.sample_jobs(extended, weights_key=key))


def test_each_adapter_finds_its_cached_prefixes_whatever_its_place_in_the_call():
    """Pools follow the snapshots, not the slots: the same two samplers in the other order prefill only each
    prompt's last token again (its logits are not kept), and calls of key-less samplers never grow the pools."""
    model = _model(torch.float32)
    first, second = _snapshots(model, 2)
    jobs = _jobs(0)
    engine = _engine(model, 256)
    engine.sample_adapters([AdapterJobs(first, "a", jobs), AdapterJobs(second, "b", jobs)])
    before = engine.prefill_tokens
    swapped = engine.sample_adapters([AdapterJobs(second, "b", jobs), AdapterJobs(first, "a", jobs)])
    assert engine.prefill_tokens - before == 2 * len({tuple(job.prompt) for job in jobs})
    fresh = _engine(model, 256)
    with fresh.pinned_weights(second, "b"):
        assert _outcome(swapped[0]) == _outcome(fresh.sample_jobs(jobs, weights_key="b"))
    for _ in range(3):
        engine.sample_jobs(jobs)
    assert len(engine._pools) == 2


def test_the_samplers_must_share_their_request_and_fit_the_slots():
    model = _model(torch.float32)
    engine = _engine(model, 256)
    jobs = _jobs(0)
    other = [SampleJob(job.prompt, 1, GenerationRequest(max_tokens=5, filters=SamplingFilters(1.0), stop=(), seed=1))
             for job in jobs]
    with pytest.raises(ValueError, match="share max_tokens"):
        engine.sample_adapters([AdapterJobs(None, "base", jobs), AdapterJobs(None, "base2", other)])
    with pytest.raises(ValueError, match="adapters in one call"):
        engine.sample_adapters([AdapterJobs(None, str(i), jobs) for i in range(MAX_ADAPTERS + 1)])


def test_a_snapshot_of_another_layout_is_refused_naming_what_differs():
    """Loading a rank-4 snapshot into a rank-8 engine (or one with a tensor more, or one less) must fail, never
    compute with what happens to fit."""
    from rlrunbook.engines.pinned_adapter import PinnedAdapter
    from rlrunbook.errors import ConfigError

    model = _model(torch.float32)
    pinned = PinnedAdapter(model)
    (snapshot,) = _snapshots(model, 1)
    narrow = {name: (t[:4] if ".lora_A." in name else t[:, :4]).clone() for name, t in snapshot.items()}
    with pytest.raises(ConfigError, match="of another shape"):
        pinned.load(narrow, "narrow")
    with pytest.raises(ConfigError, match="not in the engine"):
        pinned.load({**snapshot, "extra.lora_A.default.weight": torch.zeros(1)}, "extra")
    with pytest.raises(ConfigError, match="missing"):
        pinned.load(dict(list(snapshot.items())[1:]), "short")
    pinned.load(snapshot, "whole")
    assert pinned.key == "whole"


def test_row_adapters_cut_rows_in_slot_order():
    slots = tuple(object() for _ in range(3))
    assert RowAdapters.of_rows(slots, [0, 0, 2, 2, 2]).bounds == (0, 2, 2, 5)
    assert RowAdapters.of_rows(slots, [1, 1]).bounds == (0, 0, 2, 2)
    with pytest.raises(ValueError, match="not in order"):
        RowAdapters.of_rows(slots, [0, 2, 1])
