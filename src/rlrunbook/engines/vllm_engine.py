"""Sampling through a vLLM server, behind the same interface as the in-process HF engine.

What it adds to the server's own sampling, and why:

- **Tokens only.** Prompts go as token ids and completions come back as token ids
  (``return_token_ids``); the text the server also returns is ignored.
- **Stops as in the HF engine.** vLLM stops on single token ids only, so single-token stop
  sequences go to the server (``stop_token_ids``, with ``ignore_eos`` so that nothing else stops
  a row) and every stop (multi-token sequences, stop strings) is applied again here with
  :func:`rlrunbook.tokens.find_stop` and the HF engine's windowed decode: tokens and logprobs end
  with the first complete stop, nothing after it. A multi-token or string stop does not end
  generation on the server; the row runs on to ``max_tokens`` (or a single-token stop) and is
  cut here, which costs decode steps but never changes what is returned. A row the server
  ended as ``stop`` without any requested stop in it is refused (a stop token leaking in).
- **Logprobs of the sampled distribution.** The server must run with
  ``--logprobs-mode processed_logprobs`` (checked at connect time by :func:`verify_server`);
  ``policy_logprobs`` (the raw T = 1 policy) equal them where the two coincide (greedy, or
  T = 1 without filters) and are ``None`` otherwise: vLLM returns one logprob per token.
- **The base model through a zero adapter.** vLLM 0.32's CPU LoRA kernels index the adapter
  slots with the request's slot id, and a request without an adapter has id -1, which Python
  indexing reads as the *last* slot: once an adapter with LoRA on ``lm_head`` has been served,
  base-model requests get its output-layer delta (measured: logprob gaps of 0.19 on tiny-vllm).
  So base requests are served by an adapter that puts a zero LoRA on ``lm_head`` only (exactly the
  base logits), and never carry id -1. Where the architecture takes no ``lm_head`` LoRA, no adapter
  can leave one behind, and plain base requests are safe.
- **Adapters by content.** A LoRA snapshot is served under a name derived from its weights
  (:class:`Adapter`), loaded once, so a sampler of step k can only sample step k's weights and
  never a stale prefix cache of an adapter reloaded in place.
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from rlrunbook.engines.base import Completion, GenerationRequest
from rlrunbook.engines.noise import mix_seed
from rlrunbook.engines.vllm_client import (
    RawChoice,
    VllmServerError,
    check_vllm_filters,
    completion_payload,
    lora_rank_flag,
)
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.tokens import check_token_ids, find_stop

DecodeBatch = Callable[[list[list[int]]], list[str]]
_PARALLEL_REQUESTS = 32  # enough in flight for the server to batch a step's rows
_engine_ids = itertools.count()


@dataclass(frozen=True)
class Adapter:
    """A LoRA snapshot to sample from: ``name`` derives from its weights; ``write(folder)`` saves it as peft."""

    name: str
    rank: int
    write: Callable[[Path], None]


class VllmSamplingEngine:
    """Samples completions from a vLLM server (base model or a LoRA snapshot).

    ``server`` is a :class:`rlrunbook.engines.vllm_server.ManagedServer` or an
    :class:`ExternalServer`: it provides ``client``, ``served_model``, ``epoch`` (bumped on restart,
    which drops loaded adapters) and the hooks ``before_adapter_load(rank)``, ``adapter_loaded()``
    and ``explain(error)``. ``model`` and ``pad_token_id`` name the in-process model a parity
    check teacher-forces against (:func:`rlrunbook.diagnostics.logprob_parity`); sampling never uses it.
    """

    def __init__(self, server, *, vocab_size: int, max_context: int | None, adapter_dir: Path,
                 unembed_shape: tuple[int, int], decode_batch: DecodeBatch | None = None, max_loaded: int = 4,
                 seed: int = 0, model=None, pad_token_id: int = 0):
        self.server = server
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.decode_batch = decode_batch
        self.max_loaded = max_loaded
        self.model = model
        self.pad_token_id = pad_token_id
        self._adapter_dir = Path(adapter_dir)
        self._prefix = f"rlrb{next(_engine_ids)}-{id(self) & 0xFFFFFF:06x}"  # never collides with another engine's
        self._loaded: OrderedDict[str, Path] = OrderedDict()
        self._loaded_epoch = -1
        self._unembed_shape = unembed_shape  # (vocabulary rows, hidden size) of lm_head: the zero adapter's shape
        self._base: tuple[int, str] | None = None  # (server epoch, name that serves the base model)
        self._lock = threading.Lock()
        self._seed, self._calls = seed, 0
        self._pool = ThreadPoolExecutor(_PARALLEL_REQUESTS, thread_name_prefix="rlrunbook-vllm")

    # -- requests ---------------------------------------------------------------------------
    def validate(self, prompt: Sequence[int], request: GenerationRequest, what: str = "prompt") -> None:
        """``InputError`` / ``ConfigError`` for what the server would refuse or sample differently."""
        check_token_ids(prompt, self.vocab_size, what)
        check_vllm_filters(request.filters)
        if request.stop_strings and self.decode_batch is None:
            raise ConfigError(f"stop strings {request.stop_strings!r} need a decoder; pass decode_batch= "
                              "(the tokenizer's batch_decode) or stop on token ids.")
        if self.max_context is not None and len(prompt) + request.max_tokens > self.max_context:
            raise InputError(
                f"{what} has {len(prompt)} tokens; with max_tokens={request.max_tokens} that exceeds the vLLM "
                f"server's max_model_len of {self.max_context}. Shorten the prompt, lower max_tokens, or raise "
                "TINKER_LOCAL_VLLM_MAX_MODEL_LEN."
            )

    def sample(self, prompts: Sequence[Sequence[int]], num_samples: int, request: GenerationRequest,
               adapter: Adapter | None = None) -> list[list[Completion]]:
        """Sample ``num_samples`` completions of every prompt; ``result[i][j]`` is sample j of prompt i."""
        if not prompts:
            raise InputError("no prompts given: pass at least one token-id prompt.")
        seed = request.seed if request.seed is not None else self._next_seed()
        return self._run([(list(p), num_samples, mix_seed(seed, i)) for i, p in enumerate(prompts)], request, adapter)

    def sample_jobs(self, jobs: Sequence, adapter: Adapter | None = None) -> list[list[Completion]]:
        """Sample several callers' jobs (``prompt``, ``num_samples``, ``request``) sharing one request shape."""
        if not jobs:
            return []
        if len({(j.request.max_tokens, j.request.filters, j.request.stop, j.request.stop_strings) for j in jobs}) != 1:
            raise InputError("jobs in one batched call must share max_tokens, filters, stop sequences and strings.")
        rows = [(list(j.prompt), j.num_samples,
                 j.request.seed if j.request.seed is not None else self._next_seed()) for j in jobs]
        return self._run(rows, jobs[0].request, adapter)

    def _next_seed(self) -> int:
        with self._lock:
            self._calls += 1
            return mix_seed(self._seed, self._calls)

    def _run(self, rows: list[tuple[list[int], int, int]], request: GenerationRequest,
             adapter: Adapter | None) -> list[list[Completion]]:
        for i, (prompt, n, _) in enumerate(rows):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise InputError(f"num_samples={n!r} must be a positive int.")
            self.validate(prompt, request, f"prompt {i}")
        model = self._served_name(adapter)
        server_stops = sorted({s[0] for s in request.stop if len(s) == 1})
        payloads = [completion_payload(model, prompt, n, request.filters, request.max_tokens, seed, server_stops)
                    for prompt, n, seed in rows]
        try:
            answers = list(self._pool.map(self.server.client.complete, payloads))
        except VllmServerError as error:
            raise self.server.explain(error) from None
        return [[self._finish(choice, request) for choice in choices] for choices in answers]

    def _finish(self, choice: RawChoice, request: GenerationRequest) -> Completion:
        tokens = choice.tokens
        ends = [find_stop(tokens, request.stop) if request.stop else None, self._string_end(tokens, request)]
        end = min((e for e in ends if e is not None), default=None)
        if end is None and (choice.finish_reason != "length" or len(tokens) != request.max_tokens):
            raise VllmServerError(
                f"the vLLM server ended a row after {len(tokens)} of {request.max_tokens} tokens "
                f"({choice.finish_reason!r}) without any requested stop in it: a stop the project did not ask for "
                "is active on the server (a model-specific default stop token). Start it with "
                "--generation-config vllm, or sample with TINKER_LOCAL_SAMPLER=hf."
            )
        keep = len(tokens) if end is None else end
        filters = request.filters
        raw_is_sampled = filters.greedy or (filters.temperature == 1.0 and not filters.filters_tokens)
        return Completion(tokens=tokens[:keep], logprobs=choice.logprobs[:keep],
                          policy_logprobs=choice.logprobs[:keep] if raw_is_sampled else None,
                          stop_reason="length" if end is None else "stop")

    def _string_end(self, tokens: list[int], request: GenerationRequest) -> int | None:
        """Tokens up to the one whose text completes a stop string (the HF engine's windowed decode)."""
        if not request.stop_strings or not tokens:
            return None
        assert self.decode_batch is not None  # validate() refused the request otherwise
        (full,) = self.decode_batch([tokens])
        if not any(s in full for s in request.stop_strings):
            return None
        window = 4 * max(len(s) for s in request.stop_strings) + 8
        texts = self.decode_batch([tokens[max(0, end - window):end] for end in range(1, len(tokens) + 1)])
        return next(end for end, text in enumerate(texts, 1) if any(s in text for s in request.stop_strings))

    # -- adapters ---------------------------------------------------------------------------
    def prepare(self, adapter: Adapter | None) -> str:
        """Load ``adapter`` now (when a training run starts), so that one the server refuses fails before any
        step; returns its served name."""
        return self._served_name(adapter)

    def _base_name(self) -> str:
        """The name that serves the base model exactly: the zero ``lm_head`` adapter (see the module docstring)."""
        with self._lock:
            if self._base is not None and self._base[0] == self.server.epoch:
                return self._base[1]
            name = f"{self._prefix}-base"
            folder = self._adapter_dir / name
            write_zero_unembed_adapter(folder, *self._unembed_shape)
            try:
                self.server.client.load_adapter(name, str(folder))
            except VllmServerError as error:
                if not ("expected target modules" in str(error) and "lm_head" in str(error)):
                    raise self.server.explain(error) from None
                name = self.server.served_model  # no lm_head LoRA on this architecture: -1 reads nothing
            self._base = (self.server.epoch, name)
            return name

    def _served_name(self, adapter: Adapter | None) -> str:
        if adapter is None:
            return self._base_name()
        with self._lock:
            self.server.before_adapter_load(adapter.rank)  # may restart the server (rank, schedule, memory)
            if self._loaded_epoch != self.server.epoch:  # a fresh server holds no adapter
                self._loaded.clear()
                self._loaded_epoch = self.server.epoch
            name = f"{self._prefix}-{adapter.name}"
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return name
            folder = self._adapter_dir / name
            if not (folder / "adapter_model.safetensors").is_file():
                partial = folder.with_name(folder.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                adapter.write(partial)
                partial.rename(folder)
            try:
                self.server.client.load_adapter(name, str(folder))
            except VllmServerError as error:
                if "max_lora_rank" in str(error):
                    raise ConfigError(
                        f"the vLLM server refuses this LoRA adapter of rank {adapter.rank}: it was started with a "
                        f"smaller --max-lora-rank ({error}). Restart it with --max-lora-rank {lora_rank_flag(adapter.rank)} "
                        "or train with a lower lora_rank; a managed server (no TINKER_LOCAL_VLLM_URL) follows the "
                        "adapter's rank by itself."
                    ) from None
                if "expected target modules" in str(error) and "lm_head" in str(error):
                    raise ConfigError(
                        "the vLLM server serves no LoRA on the output layer (lm_head) for this model's architecture "
                        "(vLLM 0.32 does for Llama, Qwen3, Mixtral and others, not for Qwen2). Train without it: "
                        "create_lora_training_client(..., train_unembed=False), or `rlrunbook train ... "
                        f"train_unembed=false`; or sample with TINKER_LOCAL_SAMPLER=hf. Server: {error}"
                    ) from None
                raise self.server.explain(error) from None
            self._loaded[name] = folder
            self.server.adapter_loaded()
            while len(self._loaded) > self.max_loaded:  # oldest versions go; a later sampler of one reloads it
                old, old_folder = self._loaded.popitem(last=False)
                self.server.client.unload_adapter(old)
                shutil.rmtree(old_folder, ignore_errors=True)
            return name

    def probe_name(self) -> str:
        """The served name of the base model, for connect-time checks."""
        return self._base_name()

    def close(self) -> None:
        """Unload this engine's adapters (the server may be shared) and delete their folders."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for name, folder in self._loaded.items():
                try:
                    if self._loaded_epoch == self.server.epoch and self.server.alive():
                        self.server.client.unload_adapter(name)
                except VllmServerError:
                    pass  # the server is gone or going: nothing is served any more
                shutil.rmtree(folder, ignore_errors=True)
            self._loaded.clear()
            base, self._base = self._base, None
            if base is not None and base[1] != self.server.served_model:
                try:
                    if base[0] == self.server.epoch and self.server.alive():
                        self.server.client.unload_adapter(base[1])
                except VllmServerError:
                    pass
            shutil.rmtree(self._adapter_dir / f"{self._prefix}-base", ignore_errors=True)
            shutil.rmtree(self._adapter_dir / f"{self._prefix}-base", ignore_errors=True)


def write_zero_unembed_adapter(folder: Path, vocab_rows: int, hidden: int) -> None:
    """A peft LoRA folder of rank 1 on ``lm_head`` only, all zeros: it adds exactly 0 to the logits."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1, "lora_dropout": 0.0,
              "bias": "none", "target_modules": ["lm_head"], "fan_in_fan_out": False, "use_rslora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(1, hidden),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(vocab_rows, 1)},
              str(folder / "adapter_model.safetensors"))


class ExternalServer:
    """A vLLM server the user started (``TINKER_LOCAL_VLLM_URL``): never restarted or stopped here."""

    epoch = 0

    def __init__(self, client, served_model: str):
        self.client = client
        self.served_model = served_model

    def before_adapter_load(self, rank: int) -> None:
        """Nothing to do: a rank above the server's limit is refused by the server and explained by the engine."""

    def adapter_loaded(self) -> None:
        """External servers are not restarted on a schedule."""

    def alive(self) -> bool:
        return self.client.healthy()

    def explain(self, error: VllmServerError) -> VllmServerError:
        if self.client.healthy():
            return error
        return VllmServerError(f"{error} The vLLM server at {self.client.base_url} no longer answers /health: it "
                               "stopped or crashed mid-run. The run directory keeps every finished step; restart "
                               "the server and resume from the last checkpoint (rlrunbook train --resume-from). A CPU "
                               "server dies on seeded requests unless started with --no-enable-chunked-prefill "
                               "(README: 'The vLLM sampler').")
