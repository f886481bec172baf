"""One float64 copy of the frozen weights per model under ``exact`` numerics, shared by the sampler and the trainer.

The sampler's :class:`~rlrunbook.engines.decoder.Decoder` and the trainer's scorer each used to keep their own
float64 copies (2 x 8 bytes per frozen parameter). Both now find the model's one cache
(:mod:`rlrunbook.engines.float64_weights`), and :func:`float64_copy_bytes` says what it holds.
"""

from __future__ import annotations

import gc

import pytest
import torch

from rlrunbook.backend.chunk_scores import SharedPrefixScoring
from rlrunbook.backend.lora import wrap_with_lora
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.float64_weights import (
    Float64Weights,
    float64_copy_bytes,
    float64_weights,
    planned_float64_copy_bytes,
)
from rlrunbook.engines.hf import HFSamplingEngine

# tiny (hidden 64, 4 heads of 16, 2 KV heads, MLP 128, 2 layers, vocabulary 719), frozen projections:
# per layer q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate 64x128 + up 64x128 + down 128x64 = 36,864 weights;
# 2 layers + the output layer 719x64 = 46,016: 119,744 weights, 8 bytes each in float64.
TINY_FROZEN_FLOAT64_BYTES = (2 * 36_864 + 46_016) * 8


@pytest.fixture
def lora_tiny(tiny_folder):
    from rlrunbook.models import load_causal_lm

    return wrap_with_lora(load_causal_lm(tiny_folder, dtype=torch.float32), rank=4, alpha=8, seed=0)


class _Item:
    def __init__(self, tokens: list[int]):
        self.input_tokens = tokens[:-1]
        self.targets = torch.tensor(tokens[1:])
        self.mask = torch.ones(len(tokens) - 1, dtype=torch.bool)


def test_the_plan_counts_every_frozen_projection_once(lora_tiny):
    assert planned_float64_copy_bytes(lora_tiny) == TINY_FROZEN_FLOAT64_BYTES
    assert float64_copy_bytes(lora_tiny) == 0, "nothing is copied before an exact pass runs"


def test_two_decoders_on_one_model_hold_one_copy(lora_tiny):
    first, second = Decoder(lora_tiny, "exact"), Decoder(lora_tiny.get_base_model(), "exact")
    weight = lora_tiny.get_base_model().model.layers[0].self_attn.q_proj.weight
    assert first._frozen_float64(weight) is second._frozen_float64(weight)
    assert float64_weights(lora_tiny) is float64_weights(lora_tiny.get_base_model())
    assert float64_copy_bytes(lora_tiny) == weight.numel() * 8


def test_the_sampler_and_the_trainer_share_the_copies(lora_tiny):
    engine = HFSamplingEngine(lora_tiny, pad_token_id=0, vocab_size=719, numerics="exact")
    scoring = SharedPrefixScoring(lora_tiny, "exact")
    (completions,) = engine.sample([[5, 17, 42, 9]], 2, GenerationRequest(max_tokens=6, filters=SamplingFilters(1.0),
                                                                         stop=(), seed=0))
    assert float64_copy_bytes(lora_tiny) == TINY_FROZEN_FLOAT64_BYTES  # every frozen projection, once
    scores = scoring.score([_Item([5, 17, 42, 9, *c.tokens]) for c in completions], SamplingFilters(1.0),
                           with_entropy=False, with_reference=False)
    assert torch.isfinite(scores.seen_logprobs).all()
    assert float64_copy_bytes(lora_tiny) == TINY_FROZEN_FLOAT64_BYTES, "the trainer made no second copy"


def test_other_numerics_copy_nothing(lora_tiny):
    engine = HFSamplingEngine(lora_tiny, pad_token_id=0, vocab_size=719, numerics="invariant")
    engine.sample([[5, 17, 42, 9]], 2, GenerationRequest(max_tokens=4, filters=SamplingFilters(1.0), stop=(), seed=0))
    assert float64_copy_bytes(lora_tiny) == 0


def test_a_replaced_weight_gets_a_new_copy_and_the_old_one_is_freed():
    cache = Float64Weights()
    old = torch.randn(4, 3)
    copy = cache.of(old)
    assert copy.dtype == torch.float64 and torch.equal(copy, old.double()) and cache.of(old) is copy
    assert cache.nbytes == 4 * 3 * 8
    del old, copy
    gc.collect()
    new = torch.randn(5, 3)
    assert torch.equal(cache.of(new), new.double())
    assert len(cache) == 1 and cache.nbytes == 5 * 3 * 8
