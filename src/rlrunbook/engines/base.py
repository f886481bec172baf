"""What every sampling engine takes and returns, independent of how it generates."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.tokens import check_token_ids

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationRequest:
    """One sampling call's settings, shared by every prompt of the call.

    ``stop`` holds resolved stop sequences of token ids (a single-token stop is a 1-tuple);
    ``stop_strings`` holds text stops, matched on the decoded text of each row's generated
    tokens (an engine needs a decoder for them). Both empty disables stopping, so generation
    runs to ``max_tokens``; otherwise a row ends at whichever stop completes first.
    """

    max_tokens: int
    filters: SamplingFilters = field(default_factory=SamplingFilters)
    stop: tuple[tuple[int, ...], ...] = ()
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ConfigError(f"max_tokens={self.max_tokens!r} must be a positive int.")
        if any(len(s) == 0 for s in self.stop):
            raise ConfigError("an empty stop sequence would match at once; remove it.")
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            raise ConfigError(f"stop strings {self.stop_strings!r} must be non-empty str; an empty one matches at once.")

    @property
    def stops_anything(self) -> bool:
        return bool(self.stop or self.stop_strings)


@dataclass(frozen=True)
class Completion:
    """One sampled continuation.

    ``tokens`` end with the stop sequence that ended them (if any) and hold nothing after it; a
    stop string ends them at the token whose text completes the string (the string itself may
    start inside an earlier token, and that token's text may run past the string's end).
    ``logprobs`` are under the distribution actually sampled (after temperature and filters);
    ``policy_logprobs`` under the raw T = 1 policy. Both align one to one with ``tokens``.
    ``policy_logprobs`` is ``None`` where the engine cannot know them: the vLLM engine returns one
    logprob per token, those of the sampled distribution, which are the T = 1 policy's only for a
    greedy sample or at T = 1 without filters (there it fills them in).
    """

    tokens: list[int]
    logprobs: list[float]
    policy_logprobs: list[float] | None
    stop_reason: StopReason


@dataclass(frozen=True)
class SampleJob:
    """One caller's share of a batched call: a prompt, how many samples, and their request."""

    prompt: list[int]
    num_samples: int
    request: GenerationRequest


def check_num_samples(num_samples: object) -> None:
    """``InputError`` unless ``num_samples`` is a positive int (a bool is not one)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise InputError(f"num_samples={num_samples!r} must be a positive int.")


def shared_request(jobs: Sequence[SampleJob]) -> GenerationRequest:
    """The request every job of one batched call shares (their seeds may differ); ``InputError`` when their
    ``max_tokens``, filters or stops differ."""
    shape = {(j.request.max_tokens, j.request.filters, j.request.stop, j.request.stop_strings) for j in jobs}
    if len(shape) != 1:
        raise InputError("jobs in one batched call must share max_tokens, filters, stop sequences and strings.")
    return jobs[0].request


def split_by_job(jobs: Sequence[SampleJob], completions: Sequence[Completion]) -> list[list[Completion]]:
    """``completions`` (every job's samples, job after job) cut into one list per job."""
    results, cursor = [], 0
    for job in jobs:
        results.append(list(completions[cursor:cursor + job.num_samples]))
        cursor += job.num_samples
    return results


def check_request(prompt: Sequence[int], request: GenerationRequest, *, vocab_size: int, has_decoder: bool,
                  max_context: int | None, what: str, context: str = "the model's context", fix: str = "") -> None:
    """What every engine refuses before sampling: ids outside the vocabulary, stop strings without a decoder,
    and a prompt plus ``max_tokens`` beyond ``max_context`` (named ``context``; ``fix`` ends that message)."""
    check_token_ids(prompt, vocab_size, what)
    if request.stop_strings and not has_decoder:
        raise ConfigError(
            f"stop strings {request.stop_strings!r} need a decoder, and this engine was built without one; "
            "pass decode_batch= (the tokenizer's batch_decode) or stop on token ids instead."
        )
    if max_context is not None and len(prompt) + request.max_tokens > max_context:
        raise InputError(
            f"{what} has {len(prompt)} tokens; with max_tokens={request.max_tokens} that exceeds {context} "
            f"of {max_context}. Shorten the prompt or lower max_tokens{fix}."
        )


class SamplingEngine(Protocol):
    """What the local backend needs of an engine; ``result[i][j]`` is sample ``j`` of prompt ``i``.

    ``model`` is the (possibly LoRA-wrapped) model the engine samples from, read at call time;
    ``weights_key`` names the weights it computes with, so an engine may keep work done for earlier
    calls under the same weights (cached prefixes) and must drop it under other weights.
    """

    name: str
    model: object
    pad_token_id: int
    vocab_size: int
    max_context: int | None

    def validate(self, prompt: Sequence[int], request: GenerationRequest, what: str = "prompt") -> None: ...

    def next_seed(self) -> int: ...

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, request: GenerationRequest
    ) -> list[list[Completion]]: ...

    def sample_jobs(self, jobs: Sequence[SampleJob], weights_key: Hashable | None = None) -> list[list[Completion]]: ...
