"""Sampling sessions and their ``sample`` calls, each over a ``LocalSamplingClient``.

A sampler is seeded by the SDK's numbering (its ``sampling_session_seq_id``, each request's ``seq_id``), as
the in-process backend seeds it, so a script samples the same tokens over the wire and in process whatever
order its requests arrive in. After a restart a sampler of saved weights (a base model or a ``model_path``) is
made again on its first use; one of weights held in memory only (a snapshot) is refused, naming how to save
them. A retried request (same ``seq_id``) is answered with its first request id.
"""

from __future__ import annotations

import secrets

from tinker import types

from rlrunbook.backend import LocalServiceClient
from rlrunbook.errors import InputError
from rlrunbook.service.futures import FutureRegistry, failed
from rlrunbook.service.holdings import Holdings
from rlrunbook.service.records import Sampler, UnknownIdError, dump
from rlrunbook.service.store import ServeStore
from rlrunbook.service.wire import encode_sample_response

MAX_SAMPLES_PER_REQUEST = 10_000  # sequences one sample request may ask for (each gets an id at once)


class Samplers:
    """The samplers of :class:`Holdings`: created, recorded in the store, looked up and sampled."""

    def __init__(self, holdings: Holdings, service: LocalServiceClient, store: ServeStore, futures: FutureRegistry):
        self.holdings = holdings
        self.service = service
        self.store = store
        self.futures = futures

    def seeded(self, client, sampling_session_seq_id: int):
        """``client`` seeding its unseeded requests as the in-process backend seeds the sampler of that number
        (:class:`~rlrunbook.backend.LocalSamplingClient`): the same script gets the same samples both ways."""
        client.reseed(sampling_session_seq_id, self.service.settings.seed)
        return client

    def add(self, sampler: Sampler) -> None:
        """File ``sampler`` and record it; its id taken already is an ``InputError``."""
        with self.holdings.lock:
            if sampler.sampler_id in self.holdings.samplers:
                raise InputError(f"sampling session {sampler.sampler_id} exists: its sampling_session_seq_id "
                                 "is taken.")
            self.holdings.samplers[sampler.sampler_id] = sampler
        self.store.add_sampler(sampler.sampler_id, sampler.session_id, sampler.tenant, sampler.base_model,
                               sampler.model_path, sampler.snapshot)

    def _sampler(self, sampler_id: str | None, tenant: str) -> Sampler:
        """The caller's sampler with its client, made again first if a restart dropped it."""
        sampler = self.holdings.sampler(sampler_id, tenant)
        if sampler.client is None:
            if sampler.snapshot:
                raise UnknownIdError(f"sampling session {sampler_id} sampled weights held in the memory of a server "
                                     "that has since restarted; save weights with save_weights_for_sampler(name) "
                                     "and create a sampling client of that path.")
            with self.holdings.lock:
                if sampler.client is None:
                    client = (self.service.create_sampling_client(model_path=sampler.model_path)
                              if sampler.model_path is not None
                              else self.service.create_sampling_client(base_model=sampler.base_model))
                    sampler.client = self.seeded(client, int(sampler.sampler_id.rsplit(":", 1)[-1]))
        return sampler

    def create_sampling_session(self, request: types.CreateSamplingSessionRequest, tenant: str) -> dict:
        self.holdings.session(request.session_id, tenant)
        sampler_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        if sampler_id not in self.holdings.samplers:  # else a retried request: the sampler it made
            if request.model_path is not None:
                client = self.service.create_sampling_client(model_path=request.model_path)
            else:
                client = self.service.create_sampling_client(base_model=request.base_model)
            self.seeded(client, request.sampling_session_seq_id)
            self.add(Sampler(sampler_id, request.session_id, tenant, client, request.model_path, request.base_model))
        else:
            self._sampler(sampler_id, tenant)
        return dump(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id))

    def sampler_info(self, sampler_id: str, tenant: str) -> dict:
        sampler = self._sampler(sampler_id, tenant)
        return dump(types.GetSamplerResponse(sampler_id=sampler_id, base_model=sampler.client.get_base_model(),
                                             model_path=sampler.model_path))

    def sample(self, request: types.SampleRequest, tenant: str) -> dict:
        if isinstance(request.num_samples, int) and request.num_samples > MAX_SAMPLES_PER_REQUEST:
            # Refused before any work: the answer must carry one id per sample (the SDK checks the count).
            raise InputError(f"num_samples={request.num_samples} is above rlrunbook serve's limit of "
                             f"{MAX_SAMPLES_PER_REQUEST} per request; split it into several sample calls.")
        sampler = self._sampler(request.sampling_session_id, tenant)
        count = request.num_samples if isinstance(request.num_samples, int) and request.num_samples > 0 else 0
        ids = [f"seq-{secrets.token_urlsafe(9)}" for _ in range(count)]
        if request.seq_id is not None:
            known = self.store.call_future(sampler.sampler_id, "sample", request.seq_id)
            if known is not None:
                return {"request_id": known, "sample_sequence_ids": ids}
        try:
            if request.record_stability_info:
                raise InputError("record_stability_info is not supported by rlrunbook serve; leave it False.")
            future = sampler.client.sample(
                request.prompt, request.num_samples, request.sampling_params,
                include_prompt_logprobs=bool(request.prompt_logprobs),
                topk_prompt_logprobs=request.topk_prompt_logprobs, topk_sample_logprobs=request.topk_sample_logprobs,
                target_prompt_logprobs=request.target_prompt_logprobs,
                prompt_alt_tokens_k=request.prompt_alt_tokens_k,
                prompt_logprobs_last_n=request.prompt_logprobs_last_n, request_index=request.seq_id).future()
        except Exception as error:  # noqa: BLE001 - a refused request fails its future, naming the cause
            future = failed(error)
        rid = self.futures.add(future, encode_sample_response, tenant=tenant, owner=sampler.sampler_id,
                               seq_id=request.seq_id, kind="sample")
        return {"request_id": rid, "sample_sequence_ids": ids}
