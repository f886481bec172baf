"""Runbook §2, the most important check: sampler logprobs equal teacher-forced logprobs on the GPU.

A batch of 8 chat prompts of different lengths (uneven left padding) is sampled with the HF
engine (KV cache, incremental decoding), and the sampled tokens are scored again by one
right-padded teacher-forced pass under the same sampling distribution. Two settings: plain
T = 1, and T = 0.7 with top-p 0.9 (filters applied independently on the teacher-forced side).
If this fails, do not train: ratios and losses cannot be trusted. Each test runs with the in-process
HF engine and, where a vLLM server can be had (``-m vllm`` or ``-m gpu``; see ``rlrunbook.testing.vllm``),
with the vLLM engine, checked against the same teacher-forced pass.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import DEVICE, chat_prompts

from rlrunbook.backend.sampling_client import resolve_stop
from rlrunbook.diagnostics import FP32_TOLERANCE, HALF_MAX_BOUNDARY_FLIPS, HALF_TOLERANCE, logprob_parity
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters

pytestmark = pytest.mark.gpu

# bf16 keeps 8 mantissa bits, so a logit of magnitude ~10 is rounded by up to ~0.03, and the
# cached incremental pass and the full teacher-forced pass round differently: single tokens
# may differ by a few hundredths of a nat (HALF_TOLERANCE = 0.05 on the max). Systematic
# errors (a wrong shift, a leaked processor, wrong weights) move *every* token, so the mean is
# gated much tighter, at 0.01 nats: the level the seeds' anchors gate the mean |Δ| at.
# Both gates are for T = 1 and scale with 1/T: the sampled scores are logits / T, so a logit
# rounding error δ becomes δ / T. (Measured with bf16 on CPU, tiny model: T = 1 max 0.047,
# mean 0.005; T = 0.7 max 0.063, mean 0.0085, which an unscaled 0.05 would fail.)
BF16_MEAN_TOLERANCE = 1e-2

FILTERS = {
    "T1": SamplingFilters(temperature=1.0),
    "T0.7-top_p0.9": SamplingFilters(temperature=0.7, top_p=0.9),
}


@pytest.fixture
def ieee_fp32():
    """Full-precision fp32 matmuls for the block.

    On Ampere and later, TF32 (10 mantissa bits) may be enabled for fp32 matmuls (by a library,
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE``, or a user); it would turn an fp32 parity run into a
    near-half-precision one and make FP32_TOLERANCE fail for no real reason. Restored after.
    """
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def sampler(request) -> str:
    """The engine under test: in-process HF, or a vLLM server (runs with -m vllm / -m gpu where one can be had)."""
    return request.param


def _engine(host, sampler: str, vllm_engines, dtype):
    return host.engine if sampler == "hf" else vllm_engines(host, dtype)


def _parity(host, filters: SamplingFilters, tolerance: float, record_property, max_flip_fraction=0.0, engine=None):
    prompts = chat_prompts(host.tokenizer, 8)
    assert len({len(p) for p in prompts}) == 8, "prompts must differ in length to exercise padding"
    # EOS stops as in production: rows finish at different steps and keep generating padding.
    stop = resolve_stop(None, host.eos_token_ids)
    request = GenerationRequest(max_tokens=32, filters=filters, stop=stop, seed=0)
    report = logprob_parity(engine or host.engine, prompts, request, num_samples=1, tolerance=tolerance,
                            max_flip_fraction=max_flip_fraction)
    print(f"max |Δ| {report.max_abs_diff:.3g}, mean |Δ| {report.mean_abs_diff:.3g} "
          f"over {report.num_tokens} tokens")
    record_property("max_abs_diff", report.max_abs_diff)
    record_property("mean_abs_diff", report.mean_abs_diff)
    record_property("num_tokens", report.num_tokens)
    record_property("boundary_flips", report.boundary_flips)
    assert len(report.completions) == 8, "every prompt must yield a non-empty completion"
    assert next(host.model.parameters()).device.type == DEVICE
    return report


@pytest.mark.parametrize("filters", list(FILTERS.values()), ids=list(FILTERS))
def test_fp32_parity(model_name, filters, cuda_hosts, ieee_fp32, record_property, sampler, vllm_engines):
    """fp32 with TF32 off: every sampled token's logprob within FP32_TOLERANCE (1e-4) of teacher forcing.

    On one device fp32 generate and a teacher-forced pass agree to ~5e-6 (PITFALLS); 1e-4 leaves
    room for differently batched kernels and still catches any misalignment (>= 0.1 nats).
    """
    host = cuda_hosts(model_name, torch.float32)
    report = _parity(host, filters, FP32_TOLERANCE, record_property,
                     engine=_engine(host, sampler, vllm_engines, torch.float32))
    assert report.ok, f"fp32 logprob mismatch: max |Δ| {report.max_abs_diff:.3g} > {FP32_TOLERANCE}"


@pytest.mark.parametrize("filters", list(FILTERS.values()), ids=list(FILTERS))
def test_bf16_parity(model_name, filters, cuda_hosts, record_property, sampler, vllm_engines):
    """bf16 (the GPU default dtype): max |Δ| within HALF_TOLERANCE / T and mean |Δ| within 0.01 / T nats."""
    max_gate, mean_gate = HALF_TOLERANCE / filters.temperature, BF16_MEAN_TOLERANCE / filters.temperature
    # Tokens at the top-p edge may flip in or out of the nucleus under bf16 rounding: counted apart.
    host = cuda_hosts(model_name, torch.bfloat16)
    report = _parity(host, filters, max_gate, record_property, max_flip_fraction=HALF_MAX_BOUNDARY_FLIPS,
                     engine=_engine(host, sampler, vllm_engines, torch.bfloat16))
    assert report.ok, f"bf16 logprob mismatch: max |Δ| {report.max_abs_diff:.3g} > {max_gate:.3g}"
    assert report.mean_abs_diff <= mean_gate, (
        f"bf16 mean |Δ| {report.mean_abs_diff:.3g} > {mean_gate:.3g}: a systematic gap, not rounding"
    )
