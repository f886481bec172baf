"""Decode caches (and the CUDA graphs that read them) are rebuilt a few times per run, not at every new length.

The in-process engine's decode cache capacity only grows, in powers of two from 256 up to the model's context
(``capacity_bucket``); a call that fits reuses the caches, and on CUDA the graphs captured over them. A debate's
rounds grow each prompt by the previous turns and a data set's prompt lengths vary from call to call: with
capacities rounded to 128 and dropped at every change, such a sequence rebuilt the caches (and recaptured every
graph) on almost every call. Graphs cannot be captured on CPU; the capacity logic and its counters can be tested.
"""

from __future__ import annotations

import itertools
import json

import torch

from rlrunbook import cli
from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import CAPACITY_FLOOR, HFSamplingEngine, capacity_bucket

MAX_TOKENS = 6
TURN_TOKENS = 60  # the opponent's turn injected into each debater's next prompt


def test_capacities_are_powers_of_two_and_one_and_a_half_times_them_up_to_the_context():
    assert [capacity_bucket(n, 4096) for n in (1, 200, 256, 257, 384, 385, 511, 512, 513, 1000, 1500, 1537, 2560)] \
        == [256, 256, 256, 384, 384, 512, 512, 512, 768, 1024, 1536, 2048, 3072]
    assert capacity_bucket(1700, 1800) == 1800, "never past the model's context"
    assert capacity_bucket(3000, None) == 3072 and capacity_bucket(3073, None) == 4096
    for needed in range(1, 5000, 7):  # at most a third of a cache unused beyond the floor
        assert needed <= capacity_bucket(needed, None) <= max(CAPACITY_FLOOR, needed * 3 // 2 + 1)
    assert CAPACITY_FLOOR == 256


def _engine(tiny_host) -> HFSamplingEngine:
    config = tiny_host.model.config
    return HFSamplingEngine(tiny_host.model, pad_token_id=tiny_host.pad_token_id, vocab_size=config.vocab_size,
                            max_context=config.max_position_embeddings, prefix_cache_tokens=0)


def _debate(engine: HFSamplingEngine, steps: int, seed: int) -> list[int]:
    """``steps`` steps of a two-debater, three-round debate over three questions of varied lengths: each round's
    prompt is the previous one, the debater's own answer and ``TURN_TOKENS`` of the opponent's. Returns the
    positions each call needed (its longest prompt plus ``MAX_TOKENS``)."""
    generator = torch.Generator().manual_seed(seed)
    request = GenerationRequest(max_tokens=MAX_TOKENS, filters=SamplingFilters(1.0), stop=(), seed=seed)
    needed = []
    for _ in range(steps):
        lengths = torch.randint(30, 420, (3,), generator=generator).tolist()
        prompts = [torch.randint(3, 700, (n,), generator=generator).tolist() for n in lengths for _ in range(2)]
        for _round in range(3):
            needed.append(max(map(len, prompts)) + MAX_TOKENS)
            answers = [r[0].tokens for r in engine.sample_jobs([SampleJob(p, 1, request) for p in prompts])]
            turn = [torch.randint(3, 700, (TURN_TOKENS,), generator=generator).tolist() for _ in prompts]
            prompts = [p + own + turn[i ^ 1] for i, (p, own) in enumerate(zip(prompts, answers, strict=True))]
    return needed


def test_a_debate_rebuilds_the_caches_at_most_once_per_bucket(tiny_host):
    engine = _engine(tiny_host)
    needed = _debate(engine, steps=4, seed=0)
    rounded = [-(-n // 128) * 128 for n in needed]
    changes = sum(a != b for a, b in itertools.pairwise(rounded))
    assert changes >= 6, f"the sequence must move between lengths as debates do: {needed}"  # what used to rebuild
    buckets = sorted({capacity_bucket(n, 2048) for n in needed})
    assert engine._capacity == buckets[-1] == max(capacity_bucket(n, 2048) for n in needed)
    # One growth per power of two passed (at most 256 -> 512 -> 1024 here), however often lengths go up and down.
    assert engine.cache_rebuilds <= len(buckets) - 1 <= 2, (engine.cache_rebuilds, needed)
    assert engine.metrics() == {"engine/graph_captures": 0.0, "engine/cache_rebuilds": float(engine.cache_rebuilds)}


def test_reused_larger_caches_sample_what_fresh_ones_do(tiny_host):
    """A call served from caches sized for an earlier, longer call gives the same tokens and logprobs."""
    reused = _engine(tiny_host)
    request = GenerationRequest(max_tokens=MAX_TOKENS, filters=SamplingFilters(1.0), stop=(), seed=4)
    reused.sample_jobs([SampleJob(list(range(5, 605)), 2, request)])  # grows the caches to 768 positions
    short = [SampleJob(list(range(7, 57)), 2, request), SampleJob(list(range(9, 29)), 1, request)]
    got = reused.sample_jobs(short)
    want = _engine(tiny_host).sample_jobs(short)  # caches of 256 positions
    assert reused._capacity == 768
    for xs, ys in zip(got, want, strict=True):
        for x, y in zip(xs, ys, strict=True):
            assert x.tokens == y.tokens and x.logprobs == y.logprobs


def test_each_train_log_row_reports_the_engine_counters(tmp_path):
    logs = tmp_path / "logs"
    assert cli.main(["train", "--model", "tiny", "--mode", "single_turn", "--env", "qa", "--dataset", "test",
                     "-n", "4", "--num-groups", "2", "-s", "2", "--max-tokens", "8", "--name", "counters",
                     "--log-root", str(logs)]) == 0
    (run_dir,) = logs.iterdir()
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]
    trained = [row for row in rows if not row.get("skipped")]
    assert len(rows) == 2 and trained
    for row in trained:
        assert row["engine/graph_captures"] == 0.0  # no CUDA here
        assert row["engine/cache_rebuilds"] >= 0.0


def test_caches_of_fewer_rows_are_the_first_rows_of_the_largest(tiny_host):
    """Batches of fewer rows (a call of fewer prompts, or a batch shrinking as rows finish) use the first rows of
    the largest cache: the engine holds one ``rows x capacity`` cache, not one per row count (twice the memory)."""
    engine = _engine(tiny_host)
    request = GenerationRequest(max_tokens=8, filters=SamplingFilters(1.0), stop=(), seed=3)
    engine.sample_jobs([SampleJob(list(range(5 + i, 40 + 3 * i)), 1, request) for i in range(16)])
    engine.sample_jobs([SampleJob(list(range(9 + i, 30 + i)), 1, request) for i in range(4)])
    engine.sample_jobs([SampleJob(list(range(9, 30)), 2, request)])
    assert sorted(engine._caches) == [2, 4, 16]
    largest = engine._caches[16]
    for cache in engine._caches.values():
        for mine, theirs in zip(cache.keys + cache.values, largest.keys + largest.values, strict=True):
            assert mine.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for cache in engine._caches.values() for t in cache.keys + cache.values}
    assert sum(held.values()) == sum(t.numel() * t.element_size() for t in largest.keys + largest.values)
