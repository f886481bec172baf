"""What the two in-process engines (``hf`` and ``generate``) share: request checks, the device, seeds.

Both sample from a transformers model in this process; they differ only in how they decode.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from rlrunbook.engines.base import GenerationRequest, check_request
from rlrunbook.engines.noise import mix_seed
from rlrunbook.engines.stops import DecodeBatch


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
