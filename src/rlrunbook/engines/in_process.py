"""What the two in-process engines (``hf`` and ``generate``) share: request checks, the device, seeds.

Both sample from a transformers model in this process; they differ only in how they decode.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch

from rlrunbook.engines.base import (
    Completion,
    GenerationRequest,
    SampleJob,
    check_num_samples,
    check_request,
    shared_request,
)
from rlrunbook.engines.noise import mix_seed
from rlrunbook.engines.stops import DecodeBatch
from rlrunbook.errors import InputError


class InProcessEngine:
    """The request checks and seed counter of an engine over ``self.model`` (set by the subclass).

    Unseeded requests get seeds from the engine's own counter (``seed``), drawn at submission, so a
    process that makes the same calls sees the same samples.
    """

    model: torch.nn.Module

    def __init__(self, *, pad_token_id: int, vocab_size: int, max_context: int | None, max_batch_rows: int,
                 seed: int, decode_batch: DecodeBatch | None):
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.max_batch_rows = max_batch_rows
        self.decode_batch = decode_batch  # needed for stop strings only
        self._seed = seed
        self._unseeded_calls = 0
        self._seed_lock = threading.Lock()  # callers on several threads may draw seeds

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def validate(self, prompt: Sequence[int], request: GenerationRequest, what: str = "prompt") -> None:
        """Raise ``InputError`` for an empty prompt, an id outside the vocabulary, or no room in the context."""
        check_request(prompt, request, vocab_size=self.vocab_size, has_decoder=self.decode_batch is not None,
                      max_context=self.max_context, what=what)

    def sample(self, prompts: Sequence[Sequence[int]], num_samples: int,
               request: GenerationRequest) -> list[list[Completion]]:
        """Sample ``num_samples`` completions of every prompt; ``result[i][j]`` is sample j of prompt i. Prompt
        ``i`` is seeded by ``(request seed, i)``; an unseeded request takes one seed of the engine's counter."""
        if not prompts:
            raise InputError("no prompts given: pass at least one token-id prompt.")
        if request.seed is None:  # one seed per call, so prompts of one call still differ
            request = dataclasses.replace(request, seed=self.next_seed())
        jobs = [SampleJob(list(p), num_samples, dataclasses.replace(request, seed=mix_seed(request.seed, i)))
                for i, p in enumerate(prompts)]
        return self.sample_jobs(jobs)

    def sample_jobs(self, jobs: Sequence[SampleJob], weights_key: object = None) -> list[list[Completion]]:
        """Sample several callers' jobs in as few batched calls as possible (each engine decodes its own way)."""
        raise NotImplementedError

    def seeded_rows(self, jobs: Sequence[SampleJob]) -> tuple[list[tuple[list[int], int]], GenerationRequest]:
        """Every job checked (one shared request, a positive ``num_samples``, a valid prompt), then one row
        ``(prompt, seed)`` per sample: row ``j`` of a job is seeded by ``(job seed, j)``, so each job's samples are
        what it would get alone. Returns the rows, job after job, and the shared request."""
        request = shared_request(jobs)
        rows: list[tuple[list[int], int]] = []
        for i, job in enumerate(jobs):
            check_num_samples(job.num_samples)
            self.validate(job.prompt, job.request, f"prompt {i}")
            seed = job.request.seed if job.request.seed is not None else self.next_seed()
            rows += [(list(job.prompt), mix_seed(seed, j)) for j in range(job.num_samples)]
        return rows, request

    def metrics(self) -> dict[str, float]:
        """Counters of the engine's work that a training loop logs per step (none here; see the ``hf`` engine)."""
        return {}

    def next_seed(self) -> int:
        """The next seed of the engine's own counter, for an unseeded request (drawn at submission, so results
        follow the order of calls, not their timing)."""
        with self._seed_lock:
            self._unseeded_calls += 1
            calls = self._unseeded_calls
        return mix_seed(self._seed, calls)
