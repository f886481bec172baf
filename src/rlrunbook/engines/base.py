"""What every sampling engine takes and returns, independent of how it generates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.errors import ConfigError

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationRequest:
    """One sampling call's settings, shared by every prompt of the call.

    ``stop`` holds resolved stop sequences of token ids (a single-token stop is a 1-tuple);
    an empty tuple disables stopping, so generation runs to ``max_tokens``.
    """

    max_tokens: int
    filters: SamplingFilters = field(default_factory=SamplingFilters)
    stop: tuple[tuple[int, ...], ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ConfigError(f"max_tokens={self.max_tokens!r} must be a positive int.")
        if any(len(s) == 0 for s in self.stop):
            raise ConfigError("an empty stop sequence would match at once; remove it.")


@dataclass(frozen=True)
class Completion:
    """One sampled continuation.

    ``tokens`` end with the stop sequence that ended them (if any) and hold nothing after it.
    ``logprobs`` are under the distribution actually sampled (after temperature and filters);
    ``policy_logprobs`` under the raw T = 1 policy. Both align one to one with ``tokens``.
    """

    tokens: list[int]
    logprobs: list[float]
    policy_logprobs: list[float]
    stop_reason: StopReason


class SamplingEngine(Protocol):
    """Samples completions for token-id prompts; ``result[i][j]`` is sample ``j`` of prompt ``i``."""

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, request: GenerationRequest
    ) -> list[list[Completion]]: ...
