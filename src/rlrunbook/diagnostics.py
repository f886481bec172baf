"""Runbook checks on a loaded model: sampler-vs-trainer logprob parity.

The most important correctness check of the GPU runbook: sample, then score exactly the
sampled tokens again under the same sampling distribution (logits / T and the same filters), and
compare. If this fails, ratios and losses cannot be trusted. Two scorers:

- :func:`sampler_trainer_parity` asks the trainer itself, through the Tinker-style clients: the
  sampler samples, and ``TrainingClient.forward`` (the code ``forward_backward`` runs) returns its
  logprobs under the sampler's transform. This is what ``rlrunbook check-logprobs`` runs, with the
  engine, device, dtype and numerics ``train`` would use.
- :func:`logprob_parity` scores with an independent teacher-forced pass of transformers' own forward
  (:func:`rlrunbook.engines.scoring.teacher_forced_logprobs`): the engine against a reference.

Gates (one set of numbers for ``check-logprobs`` and the gpu tier; docs/numerics.md gives the measurements
they are set from):

- float32: max |Δ| <= 1e-4: well above the gap between a cached decode and a full pass, so kernels that
  batch differently pass, and well below what a real misalignment does (an off-by-one shift or a leaked
  repetition penalty moves logprobs by 0.1 or more).
- half precision: mean |Δ| <= 0.01 and max |Δ| <= 0.1 at T = 1, both divided by T (the sampled scores
  are logits / T, so a logit error δ becomes δ / T). The mean gate fails transformers' own numerics
  (``native``) in bf16, the failure it must catch, and passes a healthy sampler-trainer pair.

On CUDA ``invariant`` numerics are held to these gates, not to bitwise agreement (cuBLAS and PyTorch's reductions
choose their summation order by shape and row count); ``exact`` numerics are asserted bitwise by the gpu tier
(``tests/gpu/test_gpu_1_logprob_parity.py`` argues why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlrunbook.engines.base import GenerationRequest, SamplingEngine
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.scoring import teacher_forced_logprobs

FP32_TOLERANCE = 1e-4
HALF_TOLERANCE = 0.1
HALF_MEAN_TOLERANCE = 0.01

# In half precision a token near the top-p / top-k / min-p boundary can fall inside the set when
# sampling and outside it when recomputing (its logit moved by a rounding step). Its recomputed
# logprob is then -inf: a different event from a small gap, counted on its own. fp32 allows none.
FP32_MAX_BOUNDARY_FLIPS = 0.0
HALF_MAX_BOUNDARY_FLIPS = 0.01


@dataclass(frozen=True)
class Gates:
    """The parity gates of one dtype at one temperature (see the module docstring)."""

    max_abs: float
    mean_abs: float
    max_flip_fraction: float


def parity_gates(dtype: torch.dtype, temperature: float = 1.0) -> Gates:
    """The gates for parameters of ``dtype`` sampled at ``temperature`` (0 = greedy, scored as T = 1)."""
    if dtype == torch.float32:
        return Gates(FP32_TOLERANCE, FP32_TOLERANCE, FP32_MAX_BOUNDARY_FLIPS)
    scale = 1.0 / temperature if 0 < temperature < 1 else 1.0
    return Gates(HALF_TOLERANCE * scale, HALF_MEAN_TOLERANCE * scale, HALF_MAX_BOUNDARY_FLIPS)


def default_tolerance(dtype: torch.dtype) -> float:
    """The max-|Δ| gate for a parameter dtype at T = 1."""
    return parity_gates(dtype).max_abs


@dataclass(frozen=True)
class ParityReport:
    """Sampler-vs-scorer logprob gaps over every sampled token.

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
    mean_tolerance: float | None = None

    @property
    def ok(self) -> bool:
        mean_ok = self.mean_tolerance is None or self.mean_abs_diff <= self.mean_tolerance
        return (self.num_tokens > 0 and self.max_abs_diff <= self.tolerance and mean_ok
                and self.boundary_flips <= self.max_flip_fraction * self.num_tokens)


def compare_logprobs(sampled: Sequence[torch.Tensor], recomputed: Sequence[torch.Tensor],
                     completions: list[list[int]], tolerance: float, max_flip_fraction: float = 0.0,
                     mean_tolerance: float | None = None) -> ParityReport:
    """The report for per-completion logprob lists of the sampler and of a scorer (aligned one to one)."""
    gaps = [(r.float() - s.float()).abs() for s, r in zip(sampled, recomputed, strict=True)]
    all_gaps = torch.cat(gaps) if gaps else torch.zeros(0)
    flipped = ~torch.isfinite(all_gaps)
    kept = all_gaps[~flipped]
    return ParityReport(
        max_abs_diff=float(kept.max()) if len(kept) else float("nan"),
        mean_abs_diff=float(kept.mean()) if len(kept) else float("nan"),
        num_tokens=len(all_gaps), tolerance=tolerance, completions=completions,
        boundary_flips=int(flipped.sum()), max_flip_fraction=max_flip_fraction, mean_tolerance=mean_tolerance)


def logprob_parity(
    engine: SamplingEngine,
    prompts: Sequence[Sequence[int]],
    request: GenerationRequest,
    num_samples: int = 1,
    tolerance: float = FP32_TOLERANCE,
    max_flip_fraction: float = FP32_MAX_BOUNDARY_FLIPS,
    mean_tolerance: float | None = None,
) -> ParityReport:
    """Sample ``num_samples`` completions per prompt and compare their logprobs with a teacher-forced pass
    of transformers' own forward (an implementation independent of the engines)."""
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
    # token j of the completion is predicted at position n - 1 + j
    recomputed = [tf[n - 1:] for tf, n in zip(recomputed, prompt_lengths, strict=True)]
    return compare_logprobs(sampled, recomputed, completions, tolerance, max_flip_fraction, mean_tolerance)


def sampler_trainer_parity(training_client, sampling_client, prompt: list[int], num_samples: int,
                           max_tokens: int, filters: SamplingFilters, seed: int, gates: Gates) -> ParityReport:
    """Sample through ``sampling_client`` and score the same tokens with ``training_client.forward``.

    The forward asks for the logprobs under the sampler's transform (the ``sampling_*`` keys of
    ``loss_fn_config``, a local extension), so both sides describe the distribution the tokens were
    drawn from. Stops at EOS, as training does.
    """
    from tinker import types

    from rlrunbook.tokens import build_datum_arrays

    params = types.SamplingParams(max_tokens=max_tokens, temperature=filters.temperature, top_k=filters.top_k,
                                  top_p=filters.top_p, seed=seed)
    extra = {"min_p": filters.min_p} if filters.min_p > 0 else {}
    result = sampling_client.sample(types.ModelInput.from_ints(prompt), num_samples, params, **extra).result()
    sequences = [s for s in result.sequences if len(s.tokens) > 0]
    data = []
    for sequence in sequences:
        arrays = build_datum_arrays(prompt, list(sequence.tokens), list(sequence.logprobs),
                                    [1.0] * len(sequence.tokens))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens), loss_fn_inputs={
            "target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs, "advantages": arrays.advantages}))
    config = {"sampling_temperature": filters.temperature or 1.0, "sampling_top_k": filters.top_k,
              "sampling_top_p": filters.top_p, "sampling_min_p": filters.min_p}
    out = training_client.forward(data, "importance_sampling", config).result() if data else None
    sampled, recomputed = [], []
    for i, sequence in enumerate(sequences):
        n = len(sequence.tokens)
        sampled.append(torch.tensor(list(sequence.logprobs), dtype=torch.float32))
        recomputed.append(out.loss_fn_outputs[i]["sampling_logprobs"].to_torch().float()[-n:])
    return compare_logprobs(sampled, recomputed, [list(s.tokens) for s in sequences], gates.max_abs,
                            gates.max_flip_fraction, gates.mean_abs)
