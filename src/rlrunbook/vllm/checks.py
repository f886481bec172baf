"""Connect-time checks of a vLLM server: the right model, processed logprobs, nothing leaking in.

A server is trusted only after one probe: a fixed token-id prompt (a repeated pattern, so that a
repetition penalty would show) is sampled at T = 0.5 and the returned logprobs are compared with
the in-process base model's teacher-forced logprobs of the same tokens under logits / 0.5. If they
differ, the same tokens are compared with the raw T = 1 logprobs, which tells a server started
without ``--logprobs-mode processed_logprobs`` apart from one that serves another model or samples
from another distribution (a leaking generation config, other weights, another dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.vllm.client import ServedModel, VllmClient, VllmServerError, completion_payload

Score = Callable[[list[list[int]], "SamplingFilters | None"], list[torch.Tensor]]  # teacher-forced logprobs
PROBE_FILTERS = SamplingFilters(temperature=0.5)
PROBE_TOKENS = 8


def probe_prompt(vocab_size: int) -> list[int]:
    """Twelve ids spread over the vocabulary, twice: a prompt any model of this vocabulary accepts."""
    pattern = [(1 + 37 * i) % vocab_size for i in range(12)]
    return pattern + pattern


def served_base_model(client: VllmClient, wanted: str | None) -> ServedModel:
    """The base model entry of ``/v1/models`` (``wanted`` by name, or the only one listed)."""
    models = client.models()
    bases = [m for m in models if m.parent is None]
    if wanted is not None:
        match = [m for m in models if m.id == wanted]
        if not match:
            raise VllmServerError(
                f"the vLLM server at {client.base_url} serves {[m.id for m in models]}, not "
                f"{wanted!r} (TINKER_LOCAL_VLLM_MODEL)."
            )
        return match[0]
    if len(bases) != 1:
        raise VllmServerError(
            f"the vLLM server at {client.base_url} serves {[m.id for m in bases]}: name the base "
            "model to sample with TINKER_LOCAL_VLLM_MODEL."
        )
    return bases[0]


def verify_server(
    client: VllmClient,
    served: ServedModel,
    folder: Path,
    vocab_size: int,
    score: Score,
    tolerance: float,
    probe_model: str | None = None,
) -> float:
    """Raise ``VllmServerError`` naming the cause and the fix unless the server samples this model's
    distribution with processed logprobs; returns the probe's largest logprob gap. ``probe_model`` is the
    name to sample the base model by (default ``served.id``)."""
    prompt = probe_prompt(vocab_size)
    payload = completion_payload(
        probe_model or served.id, prompt, 1, PROBE_FILTERS, PROBE_TOKENS, seed=0, stop_token_ids=[]
    )
    (choice,) = client.complete(payload)
    where = f"the vLLM server at {client.base_url} (model {served.id!r}, loaded from {served.root})"
    same_folder = served.root is not None and _same_path(served.root, folder)
    outside = [t for t in choice.tokens if not 0 <= t < vocab_size]
    if outside:
        raise VllmServerError(
            f"{where} returned token ids {outside[:3]} outside this model's vocabulary of "
            f"{vocab_size}: it serves another model than {folder}. Start it with --model {folder}."
        )
    sequence = prompt + choice.tokens
    returned = torch.tensor(choice.logprobs)
    processed = _gap(score([sequence], PROBE_FILTERS)[0][len(prompt) - 1 :], returned)
    if processed <= tolerance:
        return processed
    raw = _gap(score([sequence], None)[0][len(prompt) - 1 :], returned)
    if raw <= tolerance:
        raise VllmServerError(
            f"{where} returns raw T = 1 logprobs, not those of the distribution it samples "
            f"(gap {processed:.3g} at T = 0.5). Start it with --logprobs-mode processed_logprobs."
        )
    if not same_folder:
        raise VllmServerError(
            f"{where} samples another distribution than {folder} (logprob gap {processed:.3g} > "
            f"{tolerance:g}): it serves another model. Start it with --model {folder}, or point "
            "TINKER_LOCAL_VLLM_URL at a server of this model."
        )
    raise VllmServerError(
        f"{where} serves this model's folder but samples another distribution (logprob gap {processed:.3g} > "
        f"{tolerance:g}): sampling settings leak in from the model's generation config, or the server runs another "
        "dtype. Start it with --generation-config vllm and the trainer's --dtype."
    )


def _gap(expected: torch.Tensor, returned: torch.Tensor) -> float:
    return float((expected.float() - returned.float()).abs().max())


def _same_path(root: str, folder: Path) -> bool:
    try:
        return Path(root).resolve() == Path(folder).resolve()
    except OSError:
        return False
