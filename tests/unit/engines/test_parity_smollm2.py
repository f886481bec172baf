"""Logprob parity on the real pretrained SmolLM2-135M-Instruct in fp32 (CPU).

The issue's gate: max |sampled - teacher-forced| <= 1e-4 at T = 1.0, and at T = 0.7 with
top-p 0.9, over a batch of 8 chat prompts of different lengths.
"""

from __future__ import annotations

import pytest

from rlrunbook.diagnostics import FP32_TOLERANCE, logprob_parity
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters


QUESTIONS = ["What is 7 * 8?", "Hi", "Name three colours of the rainbow.", "What is 2 + 2?",
             "Write one short sentence about the sea.", "Why is the sky blue?", "What is 12 - 5?",
             "Tell me a very short story about a cat who learns to count."]


@pytest.mark.parametrize("filters", [SamplingFilters(temperature=1.0), SamplingFilters(temperature=0.7, top_p=0.9)],
                         ids=["t1.0", "t0.7-top_p0.9"])
def test_parity_smollm2_fp32(smollm2_host, filters):
    tok = smollm2_host.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    assert len({len(p) for p in prompts}) >= 6
    stops = tuple((i,) for i in smollm2_host.eos_token_ids)
    report = logprob_parity(smollm2_host.engine, prompts, GenerationRequest(max_tokens=24, filters=filters,
                                                                            stop=stops, seed=0))
    assert report.num_tokens >= 8 * 4, "too few sampled tokens to judge parity"
    assert report.max_abs_diff <= FP32_TOLERANCE, report
