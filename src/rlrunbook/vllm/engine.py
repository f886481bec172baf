"""Sampling through a vLLM server, behind the same interface as the in-process HF engine.

What it adds to the server's own sampling, and why:

- **Tokens only.** Prompts go as token ids and completions come back as token ids
  (``return_token_ids``); the text the server also returns is ignored.
- **Stops as in the HF engine.** vLLM stops on single token ids only, so single-token stop
  sequences go to the server (``stop_token_ids``, with ``ignore_eos`` so that nothing else stops
  a row) and every stop (multi-token sequences, stop strings) is applied again here by replaying
  the returned tokens through the HF engine's own :class:`rlrunbook.engines.stops.StopTracker`:
  tokens and logprobs end with the first complete stop, nothing after it. A multi-token or string stop does not end
  generation on the server; the row runs on to ``max_tokens`` (or a single-token stop) and is
  cut here, which costs decode steps but never changes what is returned. A row the server
  ended as ``stop`` without any requested stop in it is refused (a stop token leaking in).
- **Logprobs of the sampled distribution.** The server must run with
  ``--logprobs-mode processed_logprobs`` (checked at connect time by :func:`verify_server`);
  ``policy_logprobs`` (the raw T = 1 policy) equal them where the two coincide (greedy, or
  T = 1 without filters) and are ``None`` otherwise: vLLM returns one logprob per token.
- **Which weights.** The base model and LoRA snapshots are served by names that
  :class:`rlrunbook.vllm.adapters.AdapterSlots` chooses and loads (by content; the base
  model through a zero adapter, working around a vLLM 0.32 CPU defect).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlrunbook.engines.base import (
    Completion,
    GenerationRequest,
    SampleJob,
    check_num_samples,
    check_request,
    shared_request,
)
from rlrunbook.engines.noise import mix_seed
from rlrunbook.engines.stops import StopTracker
from rlrunbook.errors import InputError
from rlrunbook.vllm.adapters import Adapter, AdapterSlots
from rlrunbook.vllm.client import RawChoice, VllmServerError, check_vllm_filters, completion_payload

DecodeBatch = Callable[[list[list[int]]], list[str]]
_PARALLEL_REQUESTS = 32  # enough in flight for the server to batch a step's rows


class VllmSamplingEngine:
    """Samples completions from a vLLM server (base model or a LoRA snapshot).

    It has the attributes and methods of :class:`rlrunbook.engines.base.SamplingEngine`, and takes the
    weights to sample as an ``adapter`` argument where the in-process engines read the live model.

    ``server`` is a :class:`rlrunbook.vllm.server.ManagedServer` or an
    :class:`rlrunbook.vllm.client.ExternalServer` (see :class:`AdapterSlots` for what it provides).
    ``model`` and ``pad_token_id`` name the in-process model a parity check teacher-forces against
    (:func:`rlrunbook.diagnostics.logprob_parity`); sampling never uses it. ``unembed_shape`` is
    ``lm_head``'s (rows, hidden); ``max_loaded`` the adapter versions kept loaded.
    """

    name = "vllm"

    def __init__(
        self,
        server,
        *,
        vocab_size: int,
        max_context: int | None,
        adapter_dir: Path,
        unembed_shape: tuple[int, int],
        decode_batch: DecodeBatch | None = None,
        max_loaded: int = 4,
        seed: int = 0,
        model=None,
        pad_token_id: int = 0,
    ):
        self.server = server
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.decode_batch = decode_batch
        self.model = model
        self.pad_token_id = pad_token_id
        self.adapters = AdapterSlots(server, adapter_dir, unembed_shape, max_loaded)
        self._lock = threading.Lock()
        self._seed, self._calls = seed, 0
        self._pool = ThreadPoolExecutor(_PARALLEL_REQUESTS, thread_name_prefix="rlrunbook-vllm")

    # -- requests ---------------------------------------------------------------------------
    def validate(self, prompt: Sequence[int], request: GenerationRequest, what: str = "prompt") -> None:
        """``InputError`` / ``ConfigError`` for what the server would refuse or sample differently."""
        check_vllm_filters(request.filters)
        check_request(prompt, request, vocab_size=self.vocab_size, has_decoder=self.decode_batch is not None,
                      max_context=self.max_context, what=what, context="the vLLM server's max_model_len",
                      fix=", or raise TINKER_LOCAL_VLLM_MAX_MODEL_LEN")

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        num_samples: int,
        request: GenerationRequest,
        adapter: Adapter | None = None,
    ) -> list[list[Completion]]:
        """Sample ``num_samples`` completions of every prompt; ``result[i][j]`` is sample j of prompt i."""
        if not prompts:
            raise InputError("no prompts given: pass at least one token-id prompt.")
        seed = request.seed if request.seed is not None else self.next_seed()
        return self._run(
            [(list(p), num_samples, mix_seed(seed, i)) for i, p in enumerate(prompts)], request, adapter
        )

    def sample_jobs(self, jobs: Sequence[SampleJob], weights_key: Hashable | None = None,
                    adapter: Adapter | None = None) -> list[list[Completion]]:
        """Sample several callers' jobs sharing one request shape, from ``adapter`` (``None``: the base model).

        ``weights_key`` is accepted for the engine protocol and unused: the adapter's name already
        identifies its weights, and the server's prefix cache is keyed by it.
        """
        if not jobs:
            return []
        request = shared_request(jobs)
        rows = [(list(j.prompt), j.num_samples, j.request.seed if j.request.seed is not None else self.next_seed())
                for j in jobs]
        return self._run(rows, request, adapter)

    def next_seed(self) -> int:
        """The next seed of the engine's own counter, for an unseeded request."""
        with self._lock:
            self._calls += 1
            return mix_seed(self._seed, self._calls)

    def _run(self, rows: list[tuple[list[int], int, int]], request: GenerationRequest,
             adapter: Adapter | None) -> list[list[Completion]]:
        for i, (prompt, n, _) in enumerate(rows):
            check_num_samples(n)
            self.validate(prompt, request, f"prompt {i}")
        model = self.adapters.name_for(adapter)
        server_stops = sorted({s[0] for s in request.stop if len(s) == 1})
        payloads = [completion_payload(model, prompt, n, request.filters, request.max_tokens, seed, server_stops)
                    for prompt, n, seed in rows]
        try:
            answers = list(self._pool.map(self.server.client.complete, payloads))
        except VllmServerError as error:
            raise self.server.explain(error) from None
        return [self._finish(choices, request) for choices in answers]

    def _finish(self, choices: list[RawChoice], request: GenerationRequest) -> list[Completion]:
        """Apply every stop as the HF engine does: the returned tokens replayed through its StopTracker."""
        tracker = StopTracker(len(choices), request.stop, request.stop_strings, self.decode_batch)
        for step in range(max(len(c.tokens) for c in choices)):
            running = [r for r in tracker.running() if step < len(choices[r].tokens)]
            if not running:
                break
            tracker.append(running, [choices[r].tokens[step] for r in running])
        filters = request.filters
        raw_is_sampled = filters.greedy or (filters.temperature == 1.0 and not filters.filters_tokens)
        out = []
        for row, choice in enumerate(choices):
            end = tracker.ends[row]
            if end is None and (choice.finish_reason != "length" or len(choice.tokens) != request.max_tokens):
                raise VllmServerError(
                    f"the vLLM server ended a row after {len(choice.tokens)} of {request.max_tokens} tokens "
                    f"({choice.finish_reason!r}) without any requested stop in it: a stop the project did not ask "
                    "for is active on the server (a model-specific default stop token). Start it with "
                    "--generation-config vllm, or sample with TINKER_LOCAL_SAMPLER=hf.")
            keep = len(choice.tokens) if end is None else end
            out.append(Completion(tokens=choice.tokens[:keep], logprobs=choice.logprobs[:keep],
                                  policy_logprobs=choice.logprobs[:keep] if raw_is_sampled else None,
                                  stop_reason="length" if end is None else "stop"))
        return out

    # -- adapters ---------------------------------------------------------------------------
    def prepare(self, adapter: Adapter | None) -> str:
        """Load ``adapter`` now (when a training run starts), so that one the server refuses fails before any
        step; returns its served name."""
        return self.adapters.name_for(adapter)

    def probe_name(self) -> str:
        """The served name of the base model, for connect-time checks."""
        return self.adapters.name_for(None)

    def close(self) -> None:
        """Unload this engine's adapters (the server may be shared) and delete their folders."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.adapters.close()
