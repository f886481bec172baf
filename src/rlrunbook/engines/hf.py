"""Sampling with ``transformers`` ``generate``: batched, token-id prompts, exact per-token logprobs.

Where it departs from a plain ``generate`` call, and why:

- The generation configuration is fully explicit and the model's own ``generation_config`` is
  replaced by a neutral one, because transformers fills every unset field from the model
  (a checkpoint's ``repetition_penalty=1.05`` would silently reshape the distribution).
  After each call the processed scores are checked against ``logits / T``: equal wherever a
  token was not filtered out, and nowhere ``-inf`` when no filter applies.
- Stop conditions are token-id sequences checked per row after every token (single- and
  multi-token, in batched mode); the returned tokens end with the stop sequence.
- Logprobs come from the scores generate actually sampled from, and the raw policy logprobs
  from its logits. Both histories are ``[rows, steps, V]``; ``max_batch_rows`` bounds that memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from rlrunbook.engines.base import Completion, GenerationRequest
from rlrunbook.errors import GenerationLeakError, InputError
from rlrunbook.tokens import check_token_ids, find_stop, pad_batch

# Every GenerationConfig field that adds a logits processor or changes decoding, at its neutral value.
_NEUTRAL_GENERATION_FIELDS = dict(
    num_beams=1, num_beam_groups=1, penalty_alpha=None, use_cache=True,
    repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
    encoder_no_repeat_ngram_size=0, bad_words_ids=None, force_words_ids=None, min_length=0,
    min_new_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None,
    remove_invalid_values=False, exponential_decay_length_penalty=None, suppress_tokens=None,
    begin_suppress_tokens=None, sequence_bias=None, guidance_scale=None, typical_p=1.0,
    epsilon_cutoff=0.0, eta_cutoff=0.0, top_h=None, renormalize_logits=False, watermarking_config=None,
    diversity_penalty=0.0, length_penalty=1.0, stop_strings=None, max_time=None, eos_token_id=None,
    bos_token_id=None, decoder_start_token_id=None, assistant_model=None, prompt_lookup_num_tokens=None,
    cache_implementation=None,
)


def neutral_generation_config(**overrides: object) -> GenerationConfig:
    """A GenerationConfig with every distribution-changing field neutral, then ``overrides``."""
    fields = dict(_NEUTRAL_GENERATION_FIELDS)
    fields.update(temperature=1.0, top_k=None, top_p=1.0, min_p=None, do_sample=False)
    fields.update(overrides)
    known = GenerationConfig().to_dict()
    return GenerationConfig(**{k: v for k, v in fields.items() if k in known or k in overrides})


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


class HFSamplingEngine:
    """Batched sampling from a (possibly LoRA-wrapped) causal LM.

    ``model`` is used as it is at call time, so a caller that changes adapter weights between
    calls samples from the new weights. ``check_scores`` runs the leak check on every call.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        vocab_size: int,
        max_context: int | None = None,
        max_batch_rows: int = 256,
        check_scores: bool = True,
    ):
        self.model = model
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.max_batch_rows = max_batch_rows
        self.check_scores = check_scores
        # The model's own generation config is what generate falls back on for unset fields.
        self._base_model().generation_config = neutral_generation_config(pad_token_id=pad_token_id)

    def _base_model(self) -> torch.nn.Module:
        get_base = getattr(self.model, "get_base_model", None)
        return get_base() if callable(get_base) else self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, request: GenerationRequest
    ) -> list[list[Completion]]:
        """Sample ``num_samples`` completions of every prompt; ``result[i][j]`` is sample j of prompt i."""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise InputError(f"num_samples={num_samples!r} must be a positive int.")
        if not prompts:
            raise InputError("no prompts given: pass at least one token-id prompt.")
        for i, prompt in enumerate(prompts):
            check_token_ids(prompt, self.vocab_size, f"prompt {i}")
            if self.max_context is not None and len(prompt) + request.max_tokens > self.max_context:
                raise InputError(
                    f"prompt {i} has {len(prompt)} tokens; with max_tokens={request.max_tokens} that "
                    f"exceeds the model's context of {self.max_context}. Shorten the prompt or lower max_tokens."
                )
        rows = [list(p) for p in prompts for _ in range(num_samples)]
        completions: list[Completion] = []
        for chunk_index, start in enumerate(range(0, len(rows), self.max_batch_rows)):
            seed = None if request.seed is None else request.seed + chunk_index
            completions += self._sample_rows(rows[start:start + self.max_batch_rows], request, seed)
        return [completions[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]

    @torch.no_grad()
    def _sample_rows(
        self, rows: list[list[int]], request: GenerationRequest, seed: int | None
    ) -> list[Completion]:
        device = self.device
        batch = pad_batch(rows, self.pad_token_id, side="left")
        width = batch.input_ids.shape[1]
        filters = request.filters
        config = neutral_generation_config(
            do_sample=not filters.greedy,
            temperature=filters.temperature if not filters.greedy else 1.0,
            # top_k=None means "unset" and generate fills in 50; 0 disables it. Greedy ignores warpers.
            top_k=None if filters.greedy else (filters.top_k if filters.top_k != -1 else 0),
            top_p=filters.top_p,
            min_p=filters.min_p if filters.min_p > 0 else None,
            max_new_tokens=request.max_tokens,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=True,
        )
        stopping = StoppingCriteriaList([_StopSequences(request.stop, width, device)]) if request.stop else None
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=batch.input_ids.to(device),
                attention_mask=batch.attention_mask.to(device),
                generation_config=config,
                stopping_criteria=stopping,
            )
        generated = out.sequences[:, width:]  # [R, T]
        sampled_lp = torch.empty(generated.shape, dtype=torch.float32, device=device)
        policy_lp = torch.empty_like(sampled_lp)
        for step, (scores, logits) in enumerate(zip(out.scores, out.logits, strict=True)):
            if self.check_scores:
                self._check_step_scores(scores, logits, request, step)
            token = generated[:, step:step + 1]
            sampled_lp[:, step] = torch.log_softmax(scores.float(), -1).gather(-1, token).squeeze(-1)
            policy_lp[:, step] = torch.log_softmax(logits.float(), -1).gather(-1, token).squeeze(-1)
        tokens_rows = generated.cpu().tolist()
        sampled_rows = sampled_lp.cpu().tolist()
        policy_rows = policy_lp.cpu().tolist()
        completions = []
        for tokens, sampled, policy in zip(tokens_rows, sampled_rows, policy_rows, strict=True):
            end = find_stop(tokens, request.stop) if request.stop else None
            keep = len(tokens) if end is None else end
            completions.append(Completion(
                tokens=tokens[:keep],
                logprobs=(sampled if not request.filters.greedy else policy)[:keep],
                policy_logprobs=policy[:keep],
                stop_reason="length" if end is None else "stop",
            ))
        return completions

    @staticmethod
    def _check_step_scores(
        scores: torch.Tensor, logits: torch.Tensor, request: GenerationRequest, step: int
    ) -> None:
        """Processed scores must be logits / T where kept, and everywhere kept when nothing filters."""
        filters = request.filters
        expected = logits.float() if filters.greedy else logits.float() / filters.temperature
        kept = torch.isfinite(scores)
        leak = None
        if not filters.filters_tokens and not bool(kept.all()):
            leak = f"{int((~kept).sum())} scores are -inf although no filter is set"
        elif not torch.allclose(scores[kept].float(), expected[kept], rtol=1e-5, atol=1e-5):
            gap = (scores[kept].float() - expected[kept]).abs().max().item()
            leak = f"processed scores differ from logits/T by up to {gap:.3g}"
        if leak is not None:
            raise GenerationLeakError(
                f"generation step {step}: {leak}. A logits processor that was not asked for is active "
                "(a model generation_config default such as repetition_penalty, typical_p or "
                "no_repeat_ngram_size leaking in). Neutralise it in engines/hf.py's generation config."
            )
