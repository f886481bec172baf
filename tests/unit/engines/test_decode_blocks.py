"""The decode loop draws in one kernel per step and reads its tokens back once per block of steps.

Budget (issue 38), counted as ``scripts/profile_decode_ops.py`` counts (:mod:`rlrunbook.testing.decode_ops`):
at most 40 top-level ops per decode step outside the model step and the call's setup, and at most one host sync
per 8 tokens drawn. Reading back in blocks must not change any result: a row that stops inside a block runs on to
the block's end and what it drew after its stop is dropped, so every block size gives a step-by-step loop's
tokens, logprobs and stop reasons.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import SYNC_EVERY, HFSamplingEngine
from rlrunbook.testing.decode_ops import count_decode_ops

MAX_OPS_OUTSIDE_THE_MODEL_STEP = 40
TOKENS = 24


def _engine(tiny_host, **options) -> HFSamplingEngine:
    config = tiny_host.model.config
    return HFSamplingEngine(tiny_host.model, pad_token_id=tiny_host.pad_token_id, vocab_size=config.vocab_size,
                            max_context=config.max_position_embeddings, decode_batch=tiny_host.engine.decode_batch,
                            **options)


def _jobs(seed: int, rows: int = 4, **request) -> list[SampleJob]:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 700, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 30, (rows,), generator=generator)]
    defaults = {"max_tokens": TOKENS, "filters": SamplingFilters(1.0), "stop": (), "seed": seed}
    return [SampleJob(p, 2, GenerationRequest(**{**defaults, **request})) for p in prompts]


def _results(engine: HFSamplingEngine, jobs: list[SampleJob]) -> list:
    return [[(c.tokens, c.logprobs, c.policy_logprobs, c.stop_reason) for c in job]
            for job in engine.sample_jobs(jobs, weights_key="same weights")]


@pytest.mark.parametrize("request_options", [
    {"stop": tuple((t,) for t in range(3, 200)), "max_tokens": 21},  # most rows stop early, inside blocks
    {"stop": ((7, 9),) + tuple((t,) for t in range(3, 40)), "filters": SamplingFilters(0.7)},
    {"stop_strings": ("e", "a b"), "filters": SamplingFilters(0.9, top_k=50)},
    {"filters": SamplingFilters(0.0), "max_tokens": 9},
    {"filters": SamplingFilters(1.0, top_p=0.9, min_p=0.01)},
], ids=["token-stops", "two-token-stop", "stop-strings", "greedy", "top-p-min-p"])
def test_every_block_size_gives_what_a_step_by_step_loop_gives(tiny_host, request_options):
    jobs = _jobs(3, **request_options)
    expected = _results(_engine(tiny_host, sync_every=1), jobs)
    reasons = [c[3] for job in expected for c in job]
    if "stop" in str(request_options):
        assert reasons.count("stop") >= 2, "the case must stop rows inside a block"
    for every in (3, SYNC_EVERY):
        assert _results(_engine(tiny_host, sync_every=every), jobs) == expected, f"blocks of {every} steps"
    assert _results(_engine(tiny_host, fused_draw=False), jobs) == expected, "the eager draw, in blocks"


def test_a_decode_step_stays_within_its_op_and_sync_budget(tiny_host):
    engine = _engine(tiny_host)
    jobs = _jobs(1, rows=2)  # 4 rows, no stops: TOKENS draws, TOKENS - 1 model steps
    engine.sample_jobs(jobs)  # warm-up: caches built
    counts = count_decode_ops(engine, jobs)
    assert counts.steps == TOKENS - 1
    assert counts.rest_per_step <= MAX_OPS_OUTSIDE_THE_MODEL_STEP, counts.rest.most_common(10)
    assert counts.rest["rlrunbook::seeded_draw"] == TOKENS, "one kernel per draw"
    assert counts.host_syncs <= math.ceil(TOKENS / 8), (counts.host_syncs, counts.host_reads)
    assert counts.model_step_syncs == 0, "the model step reads nothing back (the rotary table grows by the cache)"

    eager = _engine(tiny_host, fused_draw=False)  # the bound tells the fused draw from the eager one
    eager.sample_jobs(jobs)
    assert count_decode_ops(eager, jobs).rest_per_step > MAX_OPS_OUTSIDE_THE_MODEL_STEP
