"""Runbook checks on a loaded model: sampler-vs-trainer logprob parity.

The most important correctness check of the seeds' GPU runbook: sample, then recompute the
logprobs of exactly the sampled tokens with a teacher-forced forward pass under the same
sampling distribution (logits / T and the same filters, applied by the project's own
implementation), and compare. If this fails, ratios and losses cannot be trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.engines.scoring import teacher_forced_logprobs

# fp32 on one device: transformers' generate and a teacher-forced pass agree to about 5e-6
# (PITFALLS); 1e-4 leaves 20x headroom for kernels that batch differently, and still catches
# any real misalignment (an off-by-one shift or a leaked repetition penalty moves logprobs
# by 0.1 or more). Half precision rounds logits to 8 mantissa bits: see the GPU tier.
FP32_TOLERANCE = 1e-4
HALF_TOLERANCE = 5e-2


def default_tolerance(dtype: torch.dtype) -> float:
    """The parity gate for a parameter dtype."""
    return FP32_TOLERANCE if dtype == torch.float32 else HALF_TOLERANCE


# In half precision a token near the top-p / top-k / min-p boundary can fall inside the set when
# sampling and outside it when recomputing (its logit moved by a rounding step). Its recomputed
# logprob is then -inf: a different event from a small gap, counted on its own. fp32 allows none.
FP32_MAX_BOUNDARY_FLIPS = 0.0
HALF_MAX_BOUNDARY_FLIPS = 0.01


@dataclass(frozen=True)
class ParityReport:
    """Sampler-vs-teacher-forced logprob gaps over every sampled token.

    ``max_abs_diff`` and ``mean_abs_diff`` cover the tokens both sides keep; ``boundary_flips``
    counts sampled tokens that the recomputation filtered out (recomputed logprob ``-inf``).
    """

    max_abs_diff: float
    mean_abs_diff: float
    num_tokens: int
    tolerance: float
    completions: list[list[int]]
    boundary_flips: int = 0
    max_flip_fraction: float = FP32_MAX_BOUNDARY_FLIPS

    @property
    def ok(self) -> bool:
        return (self.num_tokens > 0 and self.max_abs_diff <= self.tolerance
                and self.boundary_flips <= self.max_flip_fraction * self.num_tokens)


def logprob_parity(
    engine: HFSamplingEngine,
    prompts: Sequence[Sequence[int]],
    request: GenerationRequest,
    num_samples: int = 1,
    tolerance: float = FP32_TOLERANCE,
    max_flip_fraction: float = FP32_MAX_BOUNDARY_FLIPS,
) -> ParityReport:
    """Sample ``num_samples`` completions per prompt and compare their logprobs with a teacher-forced pass."""
    results = engine.sample(prompts, num_samples, request)
    sequences, sampled, prompt_lengths, completions = [], [], [], []
    for prompt, samples in zip(prompts, results, strict=True):
        for completion in samples:
            if not completion.tokens:
                continue
            sequences.append(list(prompt) + completion.tokens)
            sampled.append(torch.tensor(completion.logprobs))
            prompt_lengths.append(len(prompt))
            completions.append(completion.tokens)
    filters = None if request.filters.greedy else request.filters
    recomputed = teacher_forced_logprobs(engine.model, sequences, engine.pad_token_id, filters=filters)
    gaps = [
        (tf[n - 1:] - s).abs()  # token j of the completion is predicted at position n - 1 + j
        for tf, s, n in zip(recomputed, sampled, prompt_lengths, strict=True)
    ]
    all_gaps = torch.cat(gaps) if gaps else torch.zeros(0)
    flipped = ~torch.isfinite(all_gaps)
    kept = all_gaps[~flipped]
    return ParityReport(
        max_abs_diff=float(kept.max()) if len(kept) else float("nan"),
        mean_abs_diff=float(kept.mean()) if len(kept) else float("nan"),
        num_tokens=len(all_gaps),
        tolerance=tolerance,
        completions=completions,
        boundary_flips=int(flipped.sum()),
        max_flip_fraction=max_flip_fraction,
    )
