"""The local SamplingClient: the SDK's ``sample`` and ``compute_logprobs`` on a local engine."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
from tinker import types

from rlrunbook.backend.futures import OrderedWorker
from rlrunbook.backend.host import ModelHost, SamplerWeights, active_weights
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import SampleJob
from rlrunbook.engines.scoring import teacher_forced_logprobs
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.tokens import check_token_ids

_DEFAULT_MAX_TOKENS = 256  # the seeds' local backend used 256 when max_tokens is None
_sequence_ids = itertools.count()


def resolve_stop(stop: object, eos_token_ids: list[int]) -> tuple[tuple[int, ...], ...]:
    """SDK ``stop`` → token-id stop sequences.

    ``None`` keeps EOS; ``[]`` disables every stop, EOS included; a list of ints makes each id a
    single-token stop. Stop strings are refused: tokens are the source of truth here, so pass the
    stop token ids (``tokenizer.encode(text, add_special_tokens=False)`` of a special token).
    """
    if stop is None:
        return tuple((i,) for i in eos_token_ids)
    if isinstance(stop, str) or (isinstance(stop, (list, tuple)) and any(isinstance(s, str) for s in stop)):
        raise ConfigError(
            f"stop={stop!r}: stop strings are not supported by the local backend; pass stop token ids "
            "(a list of ints), e.g. the tokenizer's id of '<|im_end|>'."
        )
    if not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop={stop!r} must be None, [] or a list of token ids.")
    return tuple((int(s),) for s in stop)


class LocalSamplingClient:
    """Samples from one set of weights (base model or a saved adapter) of a local model.

    ``sample`` takes a keyword-only ``min_p`` beyond the SDK (the SDK's SamplingParams has none).
    """

    def __init__(self, host: ModelHost, weights: SamplerWeights, worker: OrderedWorker,
                 live_version: Callable[[], int | None], model_path: str | None = None):
        self._host = host
        self._weights = weights
        self._worker = worker
        self._live_version = live_version
        self.model_path = model_path

    # Created clients are returned directly; like the SDK's client futures they also resolve to themselves.
    def result(self, timeout: float | None = None) -> "LocalSamplingClient":
        return self

    async def result_async(self, timeout: float | None = None) -> "LocalSamplingClient":
        return self

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        *,
        min_p: float = 0.0,
    ):
        """Sample ``num_samples`` completions of ``prompt``; returns an APIFuture of a SampleResponse."""
        if topk_prompt_logprobs:
            raise ConfigError("topk_prompt_logprobs is not supported by the local backend; leave it 0.")
        tokens = prompt.to_ints()
        check_token_ids(tokens, self._host.engine.vocab_size, "prompt")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise InputError(f"num_samples={num_samples!r} must be a positive int.")
        request = GenerationRequest(
            max_tokens=_DEFAULT_MAX_TOKENS if sampling_params.max_tokens is None else sampling_params.max_tokens,
            filters=SamplingFilters(temperature=float(sampling_params.temperature), top_k=int(sampling_params.top_k),
                                    top_p=float(sampling_params.top_p), min_p=float(min_p)),
            stop=resolve_stop(sampling_params.stop, self._host.eos_token_ids),
            seed=sampling_params.seed,
        )
        self._host.engine.validate(tokens, request)
        if request.seed is None:  # drawn at submission, so results follow submission order, not timing
            request = dataclasses.replace(request, seed=self._host.engine._next_seed())
        job = SampleJob(tokens, num_samples, request)
        key = (id(self._host), id(self._weights), request.max_tokens, request.filters, request.stop)
        return self._worker.submit_batchable(key, (job, include_prompt_logprobs), self._sample_batch,
                                             rows=num_samples)

    async def sample_async(self, prompt: types.ModelInput, num_samples: int,
                           sampling_params: types.SamplingParams, include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0, *, min_p: float = 0.0) -> types.SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 topk_prompt_logprobs, min_p=min_p)

    def _sample_batch(self, items: list[tuple[SampleJob, bool]]) -> list[types.SampleResponse]:
        """One engine call for every queued request that shares these weights and settings."""
        with active_weights(self._host, self._weights, self._live_version()):
            results = self._host.engine.sample_jobs([job for job, _ in items])
            prompt_lps = [self._prompt_logprobs(job.prompt) if want else None for job, want in items]
        return [self._response(completions, prompt_lp) for completions, prompt_lp in zip(results, prompt_lps)]

    @staticmethod
    def _response(completions, prompt_lp) -> types.SampleResponse:
        sequences = [
            types.SampledSequence(
                stop_reason=c.stop_reason,
                sequence_id=f"local-{next(_sequence_ids)}",
                tokens_np=np.asarray(c.tokens, dtype=np.int32),
                logprobs_np=np.asarray(c.logprobs, dtype=np.float32),
            )
            for c in completions
        ]
        return types.SampleResponse(
            sequences=sequences,
            prompt_logprobs_np=None if prompt_lp is None else np.asarray(prompt_lp, dtype=np.float32),
        )

    def _prompt_logprobs(self, tokens: list[int]) -> list[float]:
        """Teacher-forced logprobs of the prompt; NaN for the first token, which has no context."""
        (lp,) = teacher_forced_logprobs(self._host.model, [tokens], self._host.pad_token_id)
        return [float("nan"), *lp.tolist()]

    def compute_logprobs(self, prompt: types.ModelInput):
        """APIFuture of the prompt's per-token logprobs under these weights (``None`` first)."""
        tokens = prompt.to_ints()
        if len(tokens) == 0:
            raise InputError("compute_logprobs of an empty prompt: give at least one token.")

        def run() -> list[float | None]:
            with active_weights(self._host, self._weights, self._live_version()):
                values = self._prompt_logprobs(tokens)
            return [None, *values[1:]]

        return self._worker.submit(run)

    async def compute_logprobs_async(self, prompt: types.ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def get_tokenizer(self):
        return self._host.tokenizer

    def get_base_model(self) -> str:
        return self._host.name
