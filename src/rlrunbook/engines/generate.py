"""Sampling with ``transformers`` ``generate`` (``TINKER_LOCAL_SAMPLER=generate``): the reference engine.

It runs any causal LM transformers can generate with; the default in-process engine
(:mod:`rlrunbook.engines.hf`) runs the supported families with the trainer's own forward. Batched
token-id prompts, exact per-token logprobs.

How it departs from a plain ``generate(do_sample=True)`` call, and why:

- **One processor decides.** ``generate`` runs greedy (``do_sample=False``) with a fully explicit,
  neutral generation configuration (the model's own ``generation_config`` is replaced too:
  transformers fills every unset field from it, and ``top_k=None`` silently becomes 50). The
  only logits processor is :class:`_Sampler`: it applies temperature, top-k, top-p and min-p
  (:mod:`rlrunbook.engines.filters`), draws the token by the Gumbel-max trick with per-row
  counter-based noise (:mod:`rlrunbook.engines.noise`), and forces ``generate``'s argmax onto it.
  A row's sample depends on its own seed only, never on which rows share its batch.
- **Leak check.** A hook on the output layer keeps the model's raw last-position logits; the
  scores reaching :class:`_Sampler` must equal them exactly, so no processor that was not asked
  for (a repetition penalty, a default top-k) ran before it. The sampled distribution is then
  ``logits / T`` after the requested filters by construction.
- **O(rows) memory.** Logprobs of the chosen token (under the sampled distribution and under the
  raw T = 1 policy) are recorded at each step; no ``[rows, steps, vocab]`` history is kept.
- **Stops** are token-id sequences checked per row after every token; the returned tokens end with
  the stop sequence and hold nothing after it. **Stop strings** are the one place this engine
  decodes: after every token, a criterion decodes the tail of each unfinished row's generated
  tokens (never the prompt) and marks the row done once a stop string appears in that text; the
  returned tokens end at the token where the string completes. Nothing decoded is ever re-encoded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from rlrunbook.engines.base import Completion, GenerationRequest, SampleJob, split_by_job
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.in_process import InProcessEngine
from rlrunbook.engines.stops import DecodeBatch
from rlrunbook.engines.token_draw import draw_tokens
from rlrunbook.errors import GenerationLeakError
from rlrunbook.tokens import find_stop, pad_batch

# Every GenerationConfig field that adds a logits processor or changes decoding, at its neutral value.
_NEUTRAL_GENERATION_FIELDS = dict(
    num_beams=1, num_beam_groups=1, penalty_alpha=None, use_cache=True, do_sample=False,
    temperature=1.0, top_k=None, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
    repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
    encoder_no_repeat_ngram_size=0, bad_words_ids=None, force_words_ids=None, min_length=0,
    min_new_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None,
    remove_invalid_values=False, exponential_decay_length_penalty=None, suppress_tokens=None,
    begin_suppress_tokens=None, sequence_bias=None, guidance_scale=None, top_h=None,
    renormalize_logits=False, watermarking_config=None, diversity_penalty=0.0, length_penalty=1.0,
    stop_strings=None, max_time=None, eos_token_id=None, bos_token_id=None, decoder_start_token_id=None,
    assistant_model=None, prompt_lookup_num_tokens=None, cache_implementation=None,
)


def neutral_generation_config(**overrides: object) -> GenerationConfig:
    """A GenerationConfig with every distribution-changing field neutral, then ``overrides``."""
    known = GenerationConfig().to_dict()
    fields = {k: v for k, v in _NEUTRAL_GENERATION_FIELDS.items() if k in known}
    fields.update(overrides)
    return GenerationConfig(**fields)


class _LastLogits:
    """Forward hook on the output layer: keeps the raw logits of the last position of the latest call."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def __call__(self, module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
        self.value = output[:, -1].detach()


class _Sampler(LogitsProcessor):
    """Applies the filters, draws each row's token, records its logprobs; forces generate's argmax."""

    def __init__(self, filters: SamplingFilters, row_seeds: torch.Tensor, raw: _LastLogits):
        self.filters = filters
        self.row_seeds = row_seeds
        self.raw = raw
        self.step = 0
        self.tokens: list[torch.Tensor] = []
        self.sampled_logprobs: list[torch.Tensor] = []
        self.policy_logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._check_no_leak(scores)
        draw = draw_tokens(scores, self.filters, self.row_seeds, self.step)
        self.tokens.append(draw.token)
        self.sampled_logprobs.append(draw.sampled_logprob)
        self.policy_logprobs.append(draw.policy_logprob)
        self.step += 1
        forced = torch.full_like(scores, float("-inf"), dtype=torch.float32)
        return forced.scatter_(-1, draw.token[:, None], 0.0)

    def _check_no_leak(self, scores: torch.Tensor) -> None:
        raw = self.raw.value
        if raw is None or raw.shape != scores.shape:
            raise GenerationLeakError(
                "could not read the model's raw logits for the leak check (no output-layer call seen); "
                "the engine needs a model whose get_output_embeddings() produces the logits."
            )
        if not torch.equal(scores.float(), raw.float()):
            gap = (scores.float() - raw.float()).abs().nan_to_num(posinf=float("inf")).max().item()
            raise GenerationLeakError(
                f"generation step {self.step}: scores reaching the sampler differ from the model's logits by up "
                f"to {gap:.3g}. A logits processor that was not asked for is active (a generation_config "
                "default such as repetition_penalty, top_k, typical_p or no_repeat_ngram_size leaking in). "
                "Neutralise it in engines/hf.py's generation config."
            )


class _StopSequences(StoppingCriteria):
    """Marks a row finished once its generated tokens end with any stop sequence."""

    def __init__(self, stops: tuple[tuple[int, ...], ...], prompt_width: int, device: torch.device):
        self._stops = [torch.tensor(s, dtype=torch.long, device=device) for s in stops]
        self._prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self._prompt_width
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for stop in self._stops:
            if generated >= len(stop):
                done |= (input_ids[:, -len(stop):] == stop).all(dim=1)
        return done


class _StopStrings(StoppingCriteria):
    """Marks a row finished once the text of its generated tokens contains any stop string.

    Only a tail window of each row is decoded: a match that completes at the newest token spans
    at most ``len(string)`` characters, a character is at most 4 bytes and every token carries at
    least one byte, so ``4 * len(string)`` tokens (plus a margin) always hold it. Matches are
    looked for after every token, so the first step a string appears is where it completed.
    ``ends[row]`` is the number of generated tokens at that step (``None`` until it stops).
    """

    def __init__(self, strings: tuple[str, ...], prompt_width: int, rows: int, decode_batch: DecodeBatch):
        self._strings = strings
        self._prompt_width = prompt_width
        self._window = 4 * max(len(s) for s in strings) + 8
        self._decode_batch = decode_batch
        self.ends: list[int | None] = [None] * rows

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self._prompt_width
        pending = [row for row, end in enumerate(self.ends) if end is None]
        if pending and generated > 0:
            start = max(self._prompt_width, input_ids.shape[1] - self._window)
            texts = self._decode_batch(input_ids[pending, start:].tolist())
            for row, text in zip(pending, texts, strict=True):
                if any(s in text for s in self._strings):
                    self.ends[row] = generated
        return torch.tensor([end is not None for end in self.ends], dtype=torch.bool, device=input_ids.device)


class GenerateEngine(InProcessEngine):
    """Batched sampling from a (possibly LoRA-wrapped) causal LM with transformers' ``generate``.

    ``model`` is used as it is at call time, so a caller that changes adapter weights between
    calls samples from the new weights. Unseeded requests get seeds from the engine's own
    counter (``seed``), so a process that makes the same calls sees the same samples.
    """

    name = "generate"

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, vocab_size: int,
                 max_context: int | None = None, max_batch_rows: int = 256, seed: int = 0,
                 decode_batch: DecodeBatch | None = None):
        super().__init__(pad_token_id=pad_token_id, vocab_size=vocab_size, max_context=max_context,
                         max_batch_rows=max_batch_rows, seed=seed, decode_batch=decode_batch)
        self.model = model
        self._base_model().generation_config = neutral_generation_config(pad_token_id=pad_token_id)

    def _base_model(self) -> torch.nn.Module:
        get_base = getattr(self.model, "get_base_model", None)
        return get_base() if callable(get_base) else self.model

    def sample_jobs(self, jobs: Sequence[SampleJob], weights_key: object = None) -> list[list[Completion]]:
        """Sample several callers' jobs in as few generate calls as possible.

        Jobs must share ``max_tokens``, filters and stops (their seeds may differ). Row ``j`` of a
        job is seeded by ``(job seed, j)``, so each job's samples are what it would get alone.
        """
        if not jobs:
            return []
        rows, request = self.seeded_rows(jobs)
        completions: list[Completion] = []
        for start in range(0, len(rows), self.max_batch_rows):
            completions += self._sample_rows(rows[start:start + self.max_batch_rows], request)
        return split_by_job(jobs, completions)

    @torch.no_grad()
    def _sample_rows(self, rows: list[tuple[list[int], int]], request: GenerationRequest) -> list[Completion]:
        device = self.device
        batch = pad_batch([prompt for prompt, _ in rows], self.pad_token_id, side="left")
        width = batch.input_ids.shape[1]
        raw = _LastLogits()
        sampler = _Sampler(request.filters, torch.tensor([s for _, s in rows], dtype=torch.int64, device=device), raw)
        config = neutral_generation_config(max_new_tokens=request.max_tokens, pad_token_id=self.pad_token_id,
                                           return_dict_in_generate=True)
        criteria: list[StoppingCriteria] = [_StopSequences(request.stop, width, device)] if request.stop else []
        strings = None
        if request.stop_strings:
            assert self.decode_batch is not None  # validate() refused the request otherwise
            strings = _StopStrings(request.stop_strings, width, len(rows), self.decode_batch)
            criteria.append(strings)
        stopping = StoppingCriteriaList(criteria) if criteria else None
        handle = self._base_model().get_output_embeddings().register_forward_hook(raw)
        try:
            out = self.model.generate(
                input_ids=batch.input_ids.to(device),
                attention_mask=batch.attention_mask.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=stopping,
            )
        finally:
            handle.remove()
        generated = out.sequences[:, width:]  # [R, T]
        steps = generated.shape[1]
        recorded = torch.stack(sampler.tokens[:steps], dim=1)
        if not torch.equal(recorded, generated):
            raise GenerationLeakError("generate emitted tokens other than the ones the sampler drew.")
        sampled_rows = torch.stack(sampler.sampled_logprobs[:steps], dim=1).cpu().tolist()
        policy_rows = torch.stack(sampler.policy_logprobs[:steps], dim=1).cpu().tolist()
        completions = []
        string_ends = strings.ends if strings is not None else [None] * len(rows)
        rows_out = zip(generated.cpu().tolist(), sampled_rows, policy_rows, string_ends, strict=True)
        for tokens, sampled, policy, string_end in rows_out:
            ends = [e for e in (find_stop(tokens, request.stop) if request.stop else None, string_end) if e is not None]
            end = min(ends) if ends else None
            keep = len(tokens) if end is None else end
            completions.append(Completion(tokens=tokens[:keep], logprobs=sampled[:keep],
                                          policy_logprobs=policy[:keep],
                                          stop_reason="length" if end is None else "stop"))
        return completions
