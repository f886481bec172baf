"""HTTP client of an OpenAI-compatible vLLM server: token ids in, token ids and logprobs out.

Only what the vLLM sampler needs, on the standard library (no HTTP dependency in the project):
``/v1/models``, ``/v1/completions`` with a token-id prompt, ``return_token_ids`` and ``logprobs=0``
(the sampled token's logprob only), and runtime LoRA loading (``/v1/load_lora_adapter``). Every
failure is a :class:`VllmServerError` naming the URL, what was asked and what came back.

:func:`completion_payload` is the one place the project's sampling knobs become vLLM's. vLLM's
sampler applies temperature, then min-p, then top-k / top-p (``vllm/v1/sample/sampler.py``); the
project's definition (:mod:`rlrunbook.engines.filters`) applies top-k, top-p, then min-p. min-p keeps
tokens whose probability is at least ``min_p`` times the top one's, a ratio that renormalisation does
not change, so it commutes with top-k; it does not commute with top-p (top-p after min-p measures
mass over fewer tokens), so that pair is refused rather than sampled from another distribution.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.errors import ConfigError, RlrunbookError

# vLLM gives child k of an n-sample request the seed ``seed + k``; keep the sum inside int64.
_SEED_RANGE = 1 << 62
_VLLM_GREEDY_BELOW = 1e-5  # vllm/v1/sample/sampler.py: _SAMPLING_EPS


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM 0.32 accepts for --max-lora-rank


def lora_rank_flag(rank: int) -> int:
    """The smallest ``--max-lora-rank`` value vLLM accepts that holds an adapter of ``rank``."""
    for allowed in _LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank ({_LORA_RANKS[-1]}).")


class VllmServerError(RlrunbookError, RuntimeError):
    """The vLLM server is unreachable, refused a request, or answered something the sampler cannot trust.

    ``detail`` is the failed call and its cause alone (``"POST /v1/completions: Connection refused"``), for
    messages that explain the failure themselves (a managed server that died).
    """

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = detail or message


@dataclass(frozen=True)
class ServedModel:
    """One entry of ``/v1/models``: the served name, the folder it was loaded from, its context length."""

    id: str
    root: str | None
    parent: str | None
    max_model_len: int | None


@dataclass(frozen=True)
class RawChoice:
    """One sampled sequence as the server returned it, before stops are applied."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


def check_vllm_filters(filters: SamplingFilters) -> None:
    """Refuse knobs whose vLLM semantics differ from the project's (see the module docstring)."""
    if 0 < filters.temperature < _VLLM_GREEDY_BELOW:
        raise ConfigError(
            f"temperature={filters.temperature}: vLLM samples greedily below {_VLLM_GREEDY_BELOW} and reports T = 1 "
            "logprobs, not those of logits / T. Pass temperature=0 for greedy decoding, or a larger temperature."
        )
    if not filters.greedy and filters.min_p > 0 and filters.top_p < 1:
        raise ConfigError(
            f"min_p={filters.min_p} together with top_p={filters.top_p}: vLLM applies min-p before top-p, the "
            "project's sampling distribution (and the HF engine) after it, and the two differ. Use one of them "
            "with the vLLM sampler, or sample with TINKER_LOCAL_SAMPLER=hf."
        )


def completion_payload(
    model: str,
    prompt: Sequence[int],
    n: int,
    filters: SamplingFilters,
    max_tokens: int,
    seed: int,
    stop_token_ids: Sequence[int],
) -> dict:
    """The ``/v1/completions`` body that samples exactly the project's distribution.

    Every field that could change the distribution is sent explicitly, so nothing falls back to a
    server default taken from the model's ``generation_config.json``; ``ignore_eos`` makes the
    listed ``stop_token_ids`` the only stops. A greedy request sends neutral filters, since the
    project reports a greedy sample's logprobs under the T = 1 policy.
    """
    check_vllm_filters(filters)
    greedy = filters.greedy
    return {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "n": n,
        "max_tokens": max_tokens,
        "seed": seed % _SEED_RANGE,
        "temperature": 0.0 if greedy else filters.temperature,
        "top_k": 0 if greedy or filters.top_k == -1 else filters.top_k,  # vLLM: 0 disables top-k
        "top_p": 1.0 if greedy else filters.top_p,
        "min_p": 0.0 if greedy else filters.min_p,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "stop_token_ids": list(stop_token_ids),
        "min_tokens": 0,
        "skip_special_tokens": False,
    }


class VllmClient:
    """Blocking JSON calls to one vLLM server; thread-safe (each call opens its own connection)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(
        self, method: str, path: str, payload: dict | None = None, timeout_s: float | None = None
    ) -> object:
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                body = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            raise VllmServerError(
                f"{method} {url} answered HTTP {error.code}: {_error_message(detail)}"
            ) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise VllmServerError(
                f"no answer from the vLLM server at {self.base_url} ({method} {path}: {reason}). Is it running? "
                "Start one (README: 'The vLLM sampler'), or unset TINKER_LOCAL_VLLM_URL to let rlrunbook start it.",
                detail=f"{method} {path}: {reason}",
            ) from None
        try:
            return json.loads(body) if body else None
        except json.JSONDecodeError:
            return body  # the LoRA routes answer plain text

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``/health`` answers 200 within ``timeout_s``."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout_s) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def models(self) -> list[ServedModel]:
        """The served models: the base model and every loaded LoRA adapter."""
        body = self._call("GET", "/v1/models", timeout_s=30.0)
        if not isinstance(body, dict) or "data" not in body:
            raise VllmServerError(
                f"{self.base_url}/v1/models answered {str(body)[:200]!r}: not an OpenAI model list."
            )
        return [
            ServedModel(m.get("id"), m.get("root"), m.get("parent"), m.get("max_model_len"))
            for m in body["data"]
        ]

    def complete(self, payload: dict) -> list[RawChoice]:
        """Run one ``/v1/completions`` request; choices come back in sample order (``index``)."""
        body = self._call("POST", "/v1/completions", payload)
        try:
            choices = sorted(body["choices"], key=lambda c: c["index"])  # type: ignore[index]
            out = [
                RawChoice(
                    tokens=[int(t) for t in c["token_ids"]],
                    logprobs=[float(x) for x in c["logprobs"]["token_logprobs"]],
                    finish_reason=str(c["finish_reason"]),
                )
                for c in choices
            ]
        except (KeyError, TypeError, ValueError) as error:
            raise VllmServerError(
                f"{self.base_url}/v1/completions answered without token ids or logprobs ({error!r}); the sampler "
                "needs a vLLM server (return_token_ids, logprobs), not another OpenAI-compatible one."
            ) from None
        if len(out) != payload["n"] or any(len(c.tokens) != len(c.logprobs) for c in out):
            raise VllmServerError(
                f"{self.base_url} returned {len(out)} choices for n={payload['n']}, or tokens and "
                "logprobs of different lengths."
            )
        return out

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the peft adapter folder ``path`` under the model name ``name``."""
        self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> None:
        self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def reload_weights(self, folder: str) -> None:
        """Replace the served base model's weights, in place, by the safetensors files in ``folder`` (same names
        and shapes), then drop the prefix cache (its keys and values were computed with the old weights).

        vLLM's ``reload_weights`` reached through ``/collective_rpc`` and ``/reset_prefix_cache``: routes a server
        serves only when started with ``VLLM_SERVER_DEV_MODE=1``, as a managed server of a full-parameter client is.
        """
        try:
            self._call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})
            self._call("POST", "/reset_prefix_cache")
        except VllmServerError as error:
            if "HTTP 404" in str(error):
                raise VllmServerError(
                    f"the vLLM server at {self.base_url} cannot replace its weights ({error}): its weight-update "
                    "routes need VLLM_SERVER_DEV_MODE=1 in its environment."
                ) from None
            raise


def _error_message(body: str) -> str:
    try:
        parsed = json.loads(body)
        error = parsed.get("error", parsed)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:2000]
    except (json.JSONDecodeError, AttributeError):
        return body[:2000]


class ExternalServer:
    """A vLLM server the user started (``TINKER_LOCAL_VLLM_URL``): never restarted or stopped here."""

    epoch = 0

    def __init__(self, client: VllmClient, served_model: str):
        self.client = client
        self.served_model = served_model

    def before_adapter_load(self, rank: int) -> None:
        """Nothing to do: a rank above the server's limit is refused by the server and explained."""

    def adapter_loaded(self) -> None:
        """External servers are not restarted on a schedule."""

    def alive(self) -> bool:
        return self.client.healthy()

    def explain(self, error: VllmServerError) -> VllmServerError:
        """``error``, or a clearer one when the server no longer answers."""
        if self.client.healthy():
            return error
        return VllmServerError(
            f"{error} The vLLM server at {self.client.base_url} no longer answers /health: it stopped or crashed "
            "mid-run. The run directory keeps every finished step; restart the server and resume from the last "
            "checkpoint (rlrunbook train --resume-from). A CPU server dies on seeded requests unless started "
            "with --no-enable-chunked-prefill (README: 'The vLLM sampler').")
