"""The h100-rlvr preset's planned micro-batches compute under 2% padding (rlrunbook.backend.padding).

The preset's real shape, lengths only (no model): 64 prompts of 1,024 tokens x 4 samples, split as its 80 GiB
memory plan and ``grad_accum_steps`` split it, attention batched for CUDA. Completions at full length and
uniform in 1..1,536 tokens (seeded). Batching rows by the element bound alone padded 10.7% and 32.6% of the score
elements (and 6.1% of the query positions) of these two; the padding-capped grouping
(rlrunbook.engines.row_batches) is what brings them under 2%, and this test fails without it.
"""

from __future__ import annotations

import random

import pytest

from rlrunbook.backend.padding import grouped_sequences, planned_padding
from rlrunbook.rl.setup.config_sources import build_config
from rlrunbook.rl.setup.memory_plan import parse_size, plan_memory


@pytest.fixture(scope="module")
def preset():
    config = build_config(file="h100-rlvr", overrides=[], cli={}, strict=True).config
    return config, plan_memory(config, parse_size("80GiB"))


@pytest.mark.parametrize("lengths", ["full", "uniform"])
def test_h100_rlvr_planned_micro_batches_pad_under_two_percent(preset, lengths):
    config, plan = preset
    groups, samples, new = config.num_groups, config.num_rollouts // config.num_groups, config.max_tokens
    rng = random.Random(0)
    completions = [[new if lengths == "full" else rng.randint(1, new) for _ in range(samples)] for _ in range(groups)]
    sequences = grouped_sequences([config.data.max_prompt_tokens] * groups, completions)
    assert (groups, samples, new, config.data.max_prompt_tokens) == (64, 4, 1536, 1024)
    got = planned_padding(sequences, plan.micro_batch_tokens, config.backend.grad_accum_steps, "cuda")
    # each of the grad_accum_steps chunks (16 rows) in one or more micro-batches of the plan's budget
    assert got.micro_batches >= config.backend.grad_accum_steps == 16
    assert got.queries.fraction < 0.02, got
    assert got.scores.fraction < 0.02, got


def test_a_batch_of_lengths_shares_each_groups_prompt_and_drops_the_last_token():
    sequences = grouped_sequences([3, 2], [[2, 1], [4]])
    assert sequences == [[0, 1, 2, 3], [0, 1, 2], [6, 7, 8, 9, 10]]
    assert planned_padding(sequences, None).tokens == 4 + 5  # the shared prompt once
