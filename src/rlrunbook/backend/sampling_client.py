"""The local SamplingClient: the SDK's ``sample`` and ``compute_logprobs`` on a local engine."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import logging
import uuid
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tinker import types

from rlrunbook.backend import sessions
from rlrunbook.backend.futures import ResolvedClient, WorkerLane
from rlrunbook.backend.model_host import ModelHost, SamplerWeights, active_weights, tensor_layout
from rlrunbook.backend.sample_log import SampleLog
from rlrunbook.backend.unsupported import refuse_sdk_attribute
from rlrunbook.engines.base import GenerationRequest, SampleJob
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.hf import MAX_ADAPTERS, AdapterJobs
from rlrunbook.engines.noise import mix_seed
from rlrunbook.engines.scoring import teacher_forced_logprobs
from rlrunbook.engines.shared_prefix import SharedPrefixScorer
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.tokens import check_token_ids

_DEFAULT_MAX_TOKENS = 256  # the most tokens a sample gets when SamplingParams.max_tokens is None
logger = logging.getLogger(__name__)
_sequence_ids = itertools.count()
_HANDLE_FIELDS = ("sampler_id", "base_model", "model_path", "storage_root")  # what a sampler handle holds
# What turns a handle's fields into a client: registered by rlrunbook.backend.service_client (the layer that can
# make a ServiceClient), so this module never imports the one above it.
_handle_resolver: Callable[..., LocalSamplingClient] | None = None


def register_handle_resolver(resolver: Callable[..., LocalSamplingClient]) -> None:
    """Set what ``from_sampler_handle`` and ``create(holder, sampling_session_id=...)`` call with a handle's
    fields (``sampler_id``, ``base_model``, ``model_path``, ``storage_root``)."""
    global _handle_resolver
    _handle_resolver = resolver


def _client_from_handle(**fields: str | None) -> LocalSamplingClient:
    if _handle_resolver is None:  # rlrunbook.backend imports service_client, which registers it
        raise ConfigError("no local ServiceClient module is loaded: import rlrunbook.backend (or make a "
                          "LocalServiceClient) before resolving a sampler handle.")
    return _handle_resolver(**fields)


StopConditions = tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]  # (token-id sequences, strings)


class _Queued(NamedTuple):
    """A sample request waiting on its worker: the job, whether prompt logprobs were asked for, and its client."""

    job: SampleJob
    prompt_logprobs: bool
    client: LocalSamplingClient


def _sample_together(groups: list[list[_Queued]]) -> list[list[types.SampleResponse]]:
    """The requests of several samplers of one base model (one list per sampler's weights, as the worker groups
    them), decoded as one batch with each row's own adapter (:meth:`rlrunbook.engines.hf.HFSamplingEngine.
    sample_adapters`, at most ``MAX_ADAPTERS`` per call): each gets what its sampler gets alone."""
    engine = groups[0][0].client._host.engine
    completions: list[list[list]] = []
    for start in range(0, len(groups), MAX_ADAPTERS):
        part = groups[start:start + MAX_ADAPTERS]
        completions += engine.sample_adapters([
            AdapterJobs(group[0].client._weights.adapter, group[0].client._weights.key, [q.job for q in group])
            for group in part])
    return [group[0].client._respond(group, results) for group, results in zip(groups, completions, strict=True)]


def resolve_stop_conditions(stop: object, eos_token_ids: list[int]) -> StopConditions:
    """SDK ``SamplingParams.stop`` → ``(token-id stop sequences, stop strings)``.

    - ``None``: stop at EOS (every eos id of the model).
    - ``[]``: no stop at all, EOS included; generation runs to ``max_tokens``.
    - a list of ints: each id is a single-token stop, and only those (EOS is not added).
    - a string or a list of strings: each string stops a row once it appears in the decoded text of the
      row's generated tokens; EOS keeps stopping too, as on the hosted service (the cookbook's
      ``role_colon`` renderer reads a response that ends in EOS without its stop string as clean).

    The SDK's type is ``str | list[str] | list[int]``: a list mixing ids and strings is refused.
    """
    if stop is None:
        return tuple((i,) for i in eos_token_ids), ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop={stop!r} must be None, [], a list of token ids, or a string / list of strings.")
    strings = [s for s in stop if isinstance(s, str)]
    if strings and len(strings) != len(stop):
        raise ConfigError(
            f"stop={list(stop)!r} mixes stop strings and token ids; SamplingParams.stop takes one kind per request "
            "(str | list[str] | list[int]). Pass only the ids (e.g. the tokenizer's id of '<|im_end|>') or only "
            "the strings (tokenizer.decode([id]) of each id)."
        )
    if strings:
        if any(s == "" for s in strings):
            raise ConfigError("an empty stop string would match at once; remove it.")
        return tuple((i,) for i in eos_token_ids), tuple(dict.fromkeys(strings))
    for s in stop:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ConfigError(f"stop={list(stop)!r}: {s!r} is neither a token id (int) nor a stop string.")
    return tuple((int(s),) for s in stop), ()


def resolve_stop(stop: object, eos_token_ids: list[int]) -> tuple[tuple[int, ...], ...]:
    """Token-id stop sequences only (``None`` → EOS, ``[]`` → none, ints → those ids); strings are refused.

    For callers without a sampling client (``rlrunbook check-logprobs``); sampling clients use
    :func:`resolve_stop_conditions`, which also takes stop strings.
    """
    tokens, strings = resolve_stop_conditions(stop, eos_token_ids)
    if strings:
        raise ConfigError(f"stop={stop!r}: stop strings need a sampling client; pass stop token ids here.")
    return tokens


def refuse_stability_info(record_stability_info: bool) -> None:
    """``record_stability_info=True`` serves ``stable_reinforce``, which the local backend does not reproduce."""
    if record_stability_info:
        raise ConfigError(
            "record_stability_info=True is for loss_fn='stable_reinforce', which the local backend does not "
            "reproduce exactly (its stability information comes from the hosted sampler). The nearest supported "
            "losses are 'cispo' (bounded, detached importance weight) and 'importance_sampling': pass "
            "loss_fn=importance_sampling (or cispo) to the recipe."
        )


def _refuse_unsupported_sample_options(**options: object) -> None:
    neutral = {"topk_prompt_logprobs": 0, "topk_sample_logprobs": 0, "target_prompt_logprobs": None,
               "prompt_alt_tokens_k": 0, "prompt_logprobs_last_n": None}
    for name, value in options.items():
        if value != neutral[name] and value is not None:
            raise ConfigError(f"{name}={value!r} is not supported by the local backend; leave it at "
                              f"{neutral[name]!r} (use include_prompt_logprobs / compute_logprobs for prompt logprobs).")


class LocalSamplingClient(ResolvedClient):
    """Samples from one set of weights (base model or a saved adapter) of a local model.

    ``sample`` takes a keyword-only ``min_p`` beyond the SDK (the SDK's SamplingParams has none).

    A request without a seed gets ``mix_seed(seed_base, k)`` for its index ``k`` among this client's requests
    (``sample`` and ``compute_logprobs`` calls, in submission order), where ``seed_base`` is fixed by the
    ServiceClient's seed and this client's place among its ServiceClient's samplers: the numbering the SDK gives
    its requests (``seq_id``) and samplers (``sampling_session_seq_id``), so a script gets the same samples in
    process and through ``rlrunbook serve``, whatever the order its concurrent requests arrive in.
    Like the SDK's client futures it also resolves to itself (``.result()``, ``await``).
    Each client is a sampler of its ServiceClient's session (``session_id``), under a sampler id that
    ``RestClient.get_sampler`` and ``get_sampler_handle`` name (a given ``sampler_id`` is a second client
    of that sampler).
    """

    def __init__(self, host: ModelHost, weights: SamplerWeights, worker: WorkerLane,
                 live_version: Callable[[], int | None], model_path: str | None = None,
                 model_worker: WorkerLane | None = None, *, session_id: str = "",
                 storage_root: Path | None = None, sampler_id: str | None = None, seed_base: int | None = None,
                 sample_log: SampleLog | None = None):
        self._host = host
        self._sample_log = sample_log
        self._seed_base = host.engine.next_seed() if seed_base is None else seed_base
        self._requests = itertools.count()
        self._weights = weights
        self._worker = worker
        # Where a call that computes with the in-process model runs when ``worker`` must not touch it (a vLLM
        # sampler on the sampling worker: its prompt logprobs need the live model, on the training worker).
        self._model_worker = model_worker or worker
        self._live_version = live_version
        self.model_path = model_path
        self._adapter = None  # the vLLM sampler's view of these weights (TINKER_LOCAL_SAMPLER=vllm)
        self._layout: tuple | None = None  # the LoRA layout its requests are batched with others' by (_merge_key)
        self._storage_root = storage_root  # where model_path lives, for a handle used in another process
        self._sampler_id = sampler_id or sessions.register_sampler(session_id, self, host.name, model_path)

    def __getattr__(self, name: str):
        from tinker.lib.public_interfaces.sampling_client import SamplingClient

        raise refuse_sdk_attribute("SamplingClient", SamplingClient, name)

    def batch(self):
        """Local extension: ``with sampler.batch(): <submit sample calls>`` guarantees that the calls
        submitted in the block (with the same settings) run as one engine call. Do not wait inside it."""
        return self._worker.hold()

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
        *,
        min_p: float = 0.0,
        request_index: int | None = None,
    ):
        """Sample ``num_samples`` completions of ``prompt``; returns an APIFuture of a SampleResponse.

        ``request_index`` (local extension, for ``rlrunbook serve``): the request's index for its seed (the
        SDK's ``seq_id``), instead of this client's own count.

        Requests that share weights, ``max_tokens``, filters and stops and sit next to each other in
        the queue run as one batched engine call (see futures.OrderedWorker).
        """
        index = next(self._requests) if request_index is None else request_index  # consumed as the SDK does
        _refuse_unsupported_sample_options(
            topk_prompt_logprobs=topk_prompt_logprobs, topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_logprobs=target_prompt_logprobs, prompt_alt_tokens_k=prompt_alt_tokens_k,
            prompt_logprobs_last_n=prompt_logprobs_last_n)
        tokens = prompt.to_ints()
        check_token_ids(tokens, self._host.engine.vocab_size, "prompt")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise InputError(f"num_samples={num_samples!r} must be a positive int.")
        stop_tokens, stop_strings = resolve_stop_conditions(sampling_params.stop, self._host.eos_token_ids)
        request = GenerationRequest(
            max_tokens=_DEFAULT_MAX_TOKENS if sampling_params.max_tokens is None else sampling_params.max_tokens,
            filters=SamplingFilters(temperature=float(sampling_params.temperature), top_k=int(sampling_params.top_k),
                                    top_p=float(sampling_params.top_p), min_p=float(min_p)),
            stop=stop_tokens,
            seed=sampling_params.seed,
            stop_strings=stop_strings,
        )
        self._host.engine.validate(tokens, request)
        if self._host.vllm is not None:  # what the vLLM server cannot sample exactly is refused at submission
            self._host.vllm.validate(tokens, request)
        if request.seed is None:  # fixed at submission by the request's index, so results never follow timing
            request = dataclasses.replace(request, seed=mix_seed(self._seed_base, index))
        job = SampleJob(tokens, num_samples, request)
        key = (id(self._host), id(self._weights), request.max_tokens, request.filters, request.stop,
               request.stop_strings, include_prompt_logprobs and self._host.vllm is not None)
        worker = self._model_worker if include_prompt_logprobs and self._host.vllm is not None else self._worker
        merge = self._merge_key(request)
        return worker.submit_batchable(key, _Queued(job, include_prompt_logprobs, self), self._sample_batch,
                                       rows=num_samples, merge=merge,
                                       merge_fn=None if merge is None else _sample_together)

    def _merge_key(self, request: GenerationRequest) -> Hashable | None:
        """What another sampler's requests must share for one batch with this one's, each row with its own adapter
        (the base weights in memory, the LoRA layout, the request's settings); ``None`` where this sampler's are
        not batched with others (vLLM, full-parameter weights, an engine without adapter batches)."""
        host = self._host
        if (host.vllm is not None or self._weights.full or host.shared_base is None
                or not hasattr(host.engine, "sample_adapters")):
            return None
        if self._layout is None:  # the snapshot's own (it is what each engine loads), else the host's
            adapter = self._weights.adapter
            self._layout = host.adapter_layout if adapter is None else tensor_layout(adapter)
        return ("adapters", host.shared_base, self._layout, request.max_tokens, request.filters, request.stop,
                request.stop_strings)

    async def sample_async(self, prompt: types.ModelInput, num_samples: int,
                           sampling_params: types.SamplingParams, include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0, **options: object) -> types.SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 topk_prompt_logprobs, **options)

    def _computing_with_weights(self):
        """The block in which the host computes with this client's weights: the engine's pinned copy of the
        snapshot where the engine has one (nothing the trainer does touches it; see
        engines/pinned_adapter.py), else the snapshot copied into the live adapter for the call (which must
        then run on the training worker), or a full-parameter trainer's live weights (the same)."""
        pin = getattr(self._host.engine, "pinned_weights", None)
        if pin is not None and self._host.vllm is None and not self._weights.full:
            return pin(self._weights.adapter, self._weights.key)
        return active_weights(self._host, self._weights, self._live_version())

    def _sample_batch(self, items: list[_Queued]) -> list[types.SampleResponse]:
        """One engine call for every queued request that shares these weights and settings."""
        jobs = [item.job for item in items]
        if self._host.vllm is None:
            with self._computing_with_weights():
                results = self._host.engine.sample_jobs(jobs, weights_key=self._weights.key)
        else:  # a vLLM server samples this client's snapshot written as an adapter (the live model untouched), or
            # a full-parameter trainer's live weights, written while they are gathered
            with self._computing_with_weights() if self._weights.full else nullcontext():
                results = self._host.vllm.sample_jobs(jobs, adapter=self._vllm_adapter())
        return self._respond(items, results)

    def _respond(self, items: list[_Queued], results: list[list]) -> list[types.SampleResponse]:
        """The responses to ``items`` (this sampler's requests) from their completions, with the prompt logprobs
        asked for, computed here under these weights by the in-process model (with vLLM too: these calls run on the
        model's own worker)."""
        prompt_lps = [None] * len(items)
        if any(item.prompt_logprobs for item in items):
            with self._computing_with_weights():
                prompt_lps = [self._prompt_logprobs(item.job.prompt) if item.prompt_logprobs else None
                              for item in items]
        responses = [self._response(completions, prompt_lp)
                     for completions, prompt_lp in zip(results, prompt_lps, strict=True)]
        if self._sample_log is not None:
            self._sample_log.record([item.job for item in items], responses, [item.prompt_logprobs for item in items])
        return responses

    def _vllm_adapter(self):
        """This client's weights as a vLLM adapter (named by their digest, computed once), a full-parameter
        trainer's live weights, or None for the base."""
        if self._adapter is None and (self._weights.adapter is not None or self._weights.full):
            from rlrunbook.backend.vllm_sampling import full_weights, snapshot_adapter

            make = full_weights if self._weights.full else snapshot_adapter
            self._adapter = make(self._host, self._weights)
        return self._adapter

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
        """Teacher-forced logprobs of the prompt; NaN for the first token, which has no context.

        Through the trainer's own forward where the engine runs one (the same numerics as training),
        else transformers' forward.
        """
        if len(tokens) == 1:
            return [float("nan")]
        decoder = getattr(self._host.engine, "decoder", None)
        if decoder is None:
            (lp,) = teacher_forced_logprobs(self._host.model, [tokens], self._host.pad_token_id)
            return [float("nan"), *lp.tolist()]
        scorer = SharedPrefixScorer(decoder)
        with torch.no_grad():
            run = scorer.run([tokens[:-1]])
            device = run.hidden.device
            lp = scorer.score(run.hidden, torch.tensor(run.flat[0], device=device),
                              torch.tensor(tokens[1:], device=device)).logprobs
        return [float("nan"), *lp.float().cpu().tolist()]

    def compute_logprobs(self, prompt: types.ModelInput):
        """APIFuture of the prompt's per-token logprobs under these weights (``None`` first).

        It counts as one of this client's requests, as with the SDK (which sends it as a one-token sample whose
        token it drops); here no token is drawn."""
        tokens = prompt.to_ints()
        if len(tokens) == 0:
            raise InputError("compute_logprobs of an empty prompt: give at least one token.")
        next(self._requests)

        def run() -> list[float | None]:
            with self._computing_with_weights():
                values = self._prompt_logprobs(tokens)
            return [None, *values[1:]]

        return (self._worker if self._host.vllm is None else self._model_worker).submit(run)

    async def compute_logprobs_async(self, prompt: types.ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def weights_state(self) -> dict[str, torch.Tensor] | None:
        """LOCAL EXTENSION: the adapter tensors this client samples (a snapshot: never changed; do not change
        them), or ``None`` for the base model. What a checkpoint of an asynchronous run saves of its samplers."""
        return self._weights.adapter

    def get_tokenizer(self):
        return self._host.tokenizer

    @property
    def engine_name(self) -> str:
        """Local extension: which engine samples (``hf``, ``generate``, ``vllm``)."""
        return self._host.engine.name if self._host.vllm is None else self._host.vllm.name

    def get_base_model(self) -> str:
        return self._host.name

    async def get_base_model_async(self) -> str:
        """The SDK's (deprecated) coroutine twin of ``get_base_model``."""
        return self._host.name

    def get_telemetry(self) -> None:
        """None: the local backend collects no telemetry (the SDK returns None when it has none)."""
        return None

    def on_queue_state_change(self, queue_state, queue_state_reason: str | None) -> None:
        """The SDK's hook for a paused sampling queue: logs a warning naming the sampler and the reason unless
        the queue is active. No local queue pauses, so only a caller of its own calls it."""
        from tinker.lib.api_future_impl import QueueState

        if queue_state == QueueState.ACTIVE:
            return
        logger.warning("Sampling is paused for sampler %s. Reason: %s", self._sampler_id,
                       queue_state_reason or "unknown")

    def reseed(self, sampler_index: int, root_seed: int) -> None:
        """LOCAL EXTENSION (``rlrunbook serve``): seed this client's unseeded requests as the ``sampler_index``-th
        sampler of a ServiceClient seeded ``root_seed`` (the SDK's ``sampling_session_seq_id``). Call it before
        the first request."""
        self._seed_base = mix_seed(root_seed, sampler_index)

    def _twin(self) -> LocalSamplingClient:
        """A second client of this sampler: the same weights, model and worker, the same sampler id; its unseeded
        requests are seeded apart from the first client's (as the SDK numbers a clone's requests in a block of
        its own)."""
        return LocalSamplingClient(self._host, self._weights, self._worker, self._live_version,
                                   self.model_path, self._model_worker, storage_root=self._storage_root,
                                   sampler_id=self._sampler_id, sample_log=self._sample_log,
                                   seed_base=mix_seed(self._seed_base, uuid.uuid4().int % 10**9 + 1))

    def get_sampler_handle(self) -> str:
        """A string naming this sampler, for ``SamplingClient.from_sampler_handle`` (no credentials in it).

        In this process it gives a client of this very sampler while this client lives; elsewhere, or after
        this client is gone, a client of the same weights where they are saved (a ``tinker://`` path under
        the same storage, or the base model). An in-memory snapshot (``save_weights_and_get_sampling_client``)
        cannot leave this process: save it with ``save_weights_for_sampler`` to hand it to another."""
        payload = {"sampler_id": self._sampler_id, "base_model": self._host.name,
                   "model_path": self.model_path,
                   "storage_root": None if self._storage_root is None else str(self._storage_root)}
        return base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).decode()

    @staticmethod
    def from_sampler_handle(handle: str, *, api_key: str | None = None) -> LocalSamplingClient:
        """A new client of the sampler ``handle`` names (see ``get_sampler_handle``); ``api_key`` unused."""
        try:
            fields = json.loads(base64.urlsafe_b64decode(handle))
            fields = {name: fields[name] for name in _HANDLE_FIELDS}
        except (binascii.Error, ValueError, TypeError, KeyError):
            raise ConfigError(f"{handle!r} is not a sampler handle of the local backend: pass what "
                              "sampling_client.get_sampler_handle() returned.") from None
        return _client_from_handle(**fields)

    @staticmethod
    def create(holder, *, model_path: str | None = None, base_model: str | None = None,
               sampling_session_id: str | None = None, retry_config: object = None,
               record_stability_info: bool = False):
        """Finished future of a SamplingClient, as the SDK's ``SamplingClient.create``: ``holder`` is the
        local ServiceClient (where the SDK takes its HTTP session holder); ``sampling_session_id`` names an
        existing sampler of this process (a new client of it), else the client samples ``model_path`` or
        ``base_model``."""
        from rlrunbook.backend.futures import completed

        if not (callable(getattr(holder, "create_sampling_client", None)) and hasattr(holder, "_store")):
            raise ConfigError(f"SamplingClient.create takes the local ServiceClient as its holder, got "
                              f"{type(holder).__name__}; or call service.create_sampling_client(...).")
        if sampling_session_id is not None:
            record = sessions.sampler_record(sampling_session_id)
            return completed(_client_from_handle(sampler_id=record.sampler_id, base_model=record.base_model,
                                                 model_path=record.model_path, storage_root=str(holder._store.root)))
        return completed(holder.create_sampling_client(model_path=model_path, base_model=base_model,
                                                       retry_config=retry_config,
                                                       record_stability_info=record_stability_info))
