"""Runbook §8 "stop conditions": batched GPU sampling ends rows at their stop and nothing after.

The stops are taken from a free run with the same seed (its most frequent token, its most
frequent bigram), so they are sure to occur; the checks of where a row ends are written here
independently of the engine's own ``find_stop``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from gpu_support import chat_prompts

from rlrunbook.backend.sampling_client import resolve_stop
from rlrunbook.engines.base import Completion, GenerationRequest
from rlrunbook.engines.filters import SamplingFilters

pytestmark = pytest.mark.gpu

MAX_TOKENS = 32
SAMPLES = 2  # 8 prompts x 2 samples = 16 rows in one generate call
SEED = 0
EOS_SEARCH_SAMPLES, EOS_SEARCH_TOKENS = 8, 64  # 8 prompts x 8 samples x 64 tokens where EOS is looked for


def _sample(host, stop: tuple[tuple[int, ...], ...]) -> list[Completion]:
    request = GenerationRequest(max_tokens=MAX_TOKENS, filters=SamplingFilters(1.0), stop=stop, seed=SEED)
    rows = host.engine.sample(chat_prompts(host.tokenizer, 8), SAMPLES, request)
    return [c for samples in rows for c in samples]


def _match_ends(tokens: list[int], stop: tuple[int, ...]) -> list[int]:
    """Every end index (exclusive) at which ``stop`` occurs in ``tokens``."""
    k = len(stop)
    return [end for end in range(k, len(tokens) + 1) if tuple(tokens[end - k:end]) == stop]


def _check_rows(completions: list[Completion], stop: tuple[int, ...], record_property) -> None:
    stopped = 0
    for row, c in enumerate(completions):
        assert len(c.tokens) == len(c.logprobs) == len(c.policy_logprobs), f"row {row}: arrays misaligned"
        ends = _match_ends(c.tokens, stop)
        if c.stop_reason == "stop":
            stopped += 1
            assert ends == [len(c.tokens)], f"row {row}: must end at its first {stop}, nothing after"
        else:
            assert c.stop_reason == "length", f"row {row}: stop_reason {c.stop_reason!r}"
            assert len(c.tokens) == MAX_TOKENS and ends == [], f"row {row}: ran past a stop or ended early"
    record_property("rows_stopped", stopped)
    assert stopped > 0, f"no row hit {stop}, although the same-seed free run contained it"


@pytest.fixture
def host_and_free_run(model_name, cuda_hosts):
    """The bf16 host and its free run (``stop=[]``) of 16 rows."""
    host = cuda_hosts(model_name, torch.bfloat16)
    return host, _sample(host, resolve_stop([], host.eos_token_ids))


def test_empty_stop_runs_to_max_tokens(host_and_free_run, record_property):
    """``stop=[]`` disables every stop, EOS included: all rows run to max_tokens with reason "length", and rows that
    drew EOS went on past it. The 16-row free run may draw no EOS on a random-weight model (tiny: none of 16 x 32 on
    CPU), so EOS is looked for in 64 rows x 64 tokens of the same prompts (tiny on CPU: 8 rows)."""
    host, free = host_and_free_run
    assert resolve_stop([], host.eos_token_ids) == ()
    assert all(c.stop_reason == "length" and len(c.tokens) == MAX_TOKENS for c in free)
    request = GenerationRequest(max_tokens=EOS_SEARCH_TOKENS, filters=SamplingFilters(1.0), stop=(), seed=SEED)
    wide = [c for samples in host.engine.sample(chat_prompts(host.tokenizer, 8), EOS_SEARCH_SAMPLES, request)
            for c in samples]
    assert all(c.stop_reason == "length" and len(c.tokens) == EOS_SEARCH_TOKENS for c in wide)
    eos_inside = sum(any(t in host.eos_token_ids for t in c.tokens[:-1]) for c in free + wide)
    record_property("rows_with_eos_inside", eos_inside)
    assert eos_inside > 0, (f"no row drew EOS {host.eos_token_ids} before its last token in {len(free + wide)} rows: "
                            "nothing shows that EOS was ignored; sample more rows")


def test_single_token_stop(host_and_free_run, record_property):
    """A stop token id (the SDK's ``stop=[id]``): rows end with it, stop_reason "stop", nothing after."""
    host, free = host_and_free_run
    token, _ = Counter(t for c in free for t in c.tokens).most_common(1)[0]
    stops = resolve_stop([token], host.eos_token_ids)
    assert stops == ((token,),)
    _check_rows(_sample(host, stops), (token,), record_property)


def test_multi_token_stop(host_and_free_run, record_property):
    """A two-token stop sequence in batch mode: rows end with the whole sequence, nothing after."""
    host, free = host_and_free_run
    bigrams = Counter(tuple(c.tokens[i:i + 2]) for c in free for i in range(len(c.tokens) - 1))
    bigram, _ = bigrams.most_common(1)[0]
    _check_rows(_sample(host, (bigram,)), bigram, record_property)
