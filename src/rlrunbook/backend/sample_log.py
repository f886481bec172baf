"""Every sequence the local backend sampled, with the seed that drew it: one JSON line per request
(``TINKER_LOCAL_SAMPLE_LOG``).

A line is ``{"seed": s, "prompt": [token ids], "num_samples": n, "max_tokens": m, "prompt_logprobs": bool,
"sequences": [{"tokens": [...], "logprobs": [...], "stop_reason": "stop" | "length"}, ...]}``, written when
the request's batch is done (so in the order of completion, not of submission). An unseeded request's seed is
fixed by its sampler and its place among that sampler's requests
(:class:`~rlrunbook.backend.LocalSamplingClient`), so two runs of one script, in process or through
``rlrunbook serve``, write the same lines; sorted, the files compare equal, but for one thing: the SDK sends
``compute_logprobs`` as a one-token sample with prompt logprobs (its token dropped), which the server samples
and records, while in process it draws no token (:func:`compute_logprobs_probe` tells such lines). Logprobs
are the float32 values the SDK returns, written exactly. Nothing in the backend reads it back.
"""

from __future__ import annotations

from pathlib import Path

from tinker import types

from rlrunbook.backend.timeline import JsonLines
from rlrunbook.engines.base import SampleJob

VARIABLE = "TINKER_LOCAL_SAMPLE_LOG"


class SampleLog:
    """Appends each sample request's tokens to ``path``; see the module docstring."""

    def __init__(self, path: Path):
        self._file = JsonLines(path, VARIABLE)
        self.path = self._file.path

    def record(self, jobs: list[SampleJob], responses: list[types.SampleResponse],
               prompt_logprobs: list[bool]) -> None:
        self._file.append(*[
            {"seed": job.request.seed, "prompt": list(job.prompt), "num_samples": job.num_samples,
             "max_tokens": job.request.max_tokens, "prompt_logprobs": want,
             "sequences": [{"tokens": list(sequence.tokens), "logprobs": list(sequence.logprobs or []),
                            "stop_reason": sequence.stop_reason} for sequence in response.sequences]}
            for job, response, want in zip(jobs, responses, prompt_logprobs, strict=True)])


def compute_logprobs_probe(line: dict) -> bool:
    """Whether a line is what the SDK's ``compute_logprobs`` sends: one sample of one token, with prompt logprobs."""
    return line["prompt_logprobs"] and line["num_samples"] == 1 and line["max_tokens"] == 1


def read_sample_log(path: Path) -> list[dict]:
    """The lines of a sample log, sorted (so two logs of the same requests compare equal)."""
    import json

    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [json.loads(line) for line in sorted(lines)]
