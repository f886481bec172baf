"""Runbook §2 with the vLLM sampler: what the server samples, the trainer scores identically.

Six chat prompts of different lengths, two samples each, 32 tokens, EOS stops, fp32 on both sides.
At T = 1 the server's logprobs are compared with the trainer's own forward pass
(``TrainingClient.forward``, the logprobs it trains on); at T = 0.7 (and 0.7 with top-p 0.9) with
the teacher-forced logprobs under the same filters (:mod:`rlrunbook.engines.scoring`). Without an
adapter (the base model served as ``base``) and with one (two AdamW steps, lm_head included, so
every LoRA'd module differs from the base). Gate: FP32_TOLERANCE (1e-4), on the max.
"""

from __future__ import annotations

import pytest
import torch
from tinker import types
from vllm_support import chat_prompts, train_steps

from rlrunbook.diagnostics import FP32_TOLERANCE
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.scoring import teacher_forced_logprobs
from rlrunbook.tokens import build_datum_arrays

pytestmark = pytest.mark.vllm
MODEL = "tiny-vllm"
SETTINGS = {"T1": (1.0, 1.0), "T0.7": (0.7, 1.0), "T0.7-top_p0.9": (0.7, 0.9)}


def _sample(sampler, prompts, temperature, top_p):
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(p),
            2,
            types.SamplingParams(max_tokens=32, temperature=temperature, top_p=top_p, seed=100 + i),
        )
        for i, p in enumerate(prompts)
    ]
    return [
        (p, s) for p, f in zip(prompts, futures, strict=True) for s in f.result().sequences if len(s.tokens)
    ]


def _trainer_logprobs(training, rows) -> list[torch.Tensor]:
    """The trainer's logprobs of each completion token (its forward pass; T = 1, no filters)."""
    datums = []
    for prompt, seq in rows:
        arrays = build_datum_arrays(prompt, list(seq.tokens))
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(arrays.input_tokens),
                loss_fn_inputs={"target_tokens": arrays.target_tokens, "weights": arrays.weights},
            )
        )
    outputs = training.forward(datums, "cross_entropy").result().loss_fn_outputs
    return [
        out["logprobs"].to_torch()[len(prompt) - 1 :] for out, (prompt, _) in zip(outputs, rows, strict=True)
    ]


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
def test_vllm_parity_fp32(vllm_service, adapter, setting, record_property):
    temperature, top_p = SETTINGS[setting]
    training = vllm_service.create_lora_training_client(MODEL, rank=8, seed=0)
    if adapter:
        train_steps(training, 2)
        sampler = training.save_weights_and_get_sampling_client()
    else:
        sampler = vllm_service.create_sampling_client(base_model=MODEL)
    prompts = chat_prompts(training.get_tokenizer())
    rows = _sample(sampler, prompts, temperature, top_p)
    assert len(rows) >= 10, "most prompts must yield a non-empty completion"
    if temperature == 1.0 and top_p == 1.0:
        expected = _trainer_logprobs(training, rows)  # the base equals a fresh adapter (B = 0) exactly
    else:
        host = training._host
        expected = teacher_forced_logprobs(
            host.model,
            [p + list(s.tokens) for p, s in rows],
            host.pad_token_id,
            SamplingFilters(temperature=temperature, top_p=top_p),
        )
        expected = [e[len(p) - 1 :] for e, (p, _) in zip(expected, rows, strict=True)]
    gaps = torch.cat([(e - torch.tensor(s.logprobs)).abs() for e, (_, s) in zip(expected, rows, strict=True)])
    assert torch.isfinite(gaps).all(), "a sampled token falls outside the recomputed filters"
    record_property("max_abs_diff", float(gaps.max()))
    record_property("mean_abs_diff", float(gaps.mean()))
    print(
        f"{setting} {'adapter' if adapter else 'base'}: max |Δ| {gaps.max():.3g}, mean {gaps.mean():.3g} "
        f"over {len(gaps)} tokens"
    )
    assert float(gaps.max()) <= FP32_TOLERANCE
