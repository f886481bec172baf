"""The vLLM sampler's contract beyond parity: LoRA sync, stops cut as in the HF engine, seeds.

Expected values are derived in the tests: a stopped sample must equal the same seed's unstopped
sample cut after the first complete stop (found by a plain scan here, not by the engine's code);
a stop string must end the tokens at the first prefix whose decoded text contains it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tinker import types
from vllm_support import chat_prompts, train_steps

from rlrunbook.backend.vllm_sampling import VllmSamplers
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters

pytestmark = pytest.mark.vllm
MODEL = "tiny-vllm"


@pytest.fixture
def engine(vllm_settings):
    """The vLLM engine of a plain tiny-vllm host (base weights), connected to the session's server."""
    from rlrunbook.backend.model_host import load_host

    samplers = VllmSamplers(vllm_settings)
    yield samplers.engine_for(load_host(MODEL, vllm_settings))
    samplers.close()


def _first_end(tokens: list[int], stop: tuple[int, ...]) -> int | None:
    for end in range(len(stop), len(tokens) + 1):
        if tuple(tokens[end - len(stop) : end]) == stop:
            return end
    return None


def test_lora_sync_new_weights_new_logprobs_old_sampler_unchanged(vllm_service):
    """A sampler samples its own snapshot: after an optimizer step the next sampler's logprobs change,
    and the previous sampler still returns exactly what it returned before the step."""
    training = vllm_service.create_lora_training_client(MODEL, rank=8, seed=0)
    prompt = types.ModelInput.from_ints(chat_prompts(training.get_tokenizer(), 2)[1])
    params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=7, stop=[])
    before = training.save_weights_and_get_sampling_client()
    first = before.sample(prompt, 4, params).result().sequences
    train_steps(training, 3)
    after = training.save_weights_and_get_sampling_client()
    moved = after.sample(prompt, 4, params).result().sequences
    again = before.sample(prompt, 4, params).result().sequences
    assert [list(s.tokens) for s in again] == [list(s.tokens) for s in first]
    assert torch.allclose(
        torch.tensor([list(s.logprobs) for s in again]),
        torch.tensor([list(s.logprobs) for s in first]),
        atol=1e-5,
    )
    lp_first = torch.tensor([list(s.logprobs) for s in first])
    lp_moved = torch.tensor([list(s.logprobs) for s in moved])
    assert [list(s.tokens) for s in moved] != [list(s.tokens) for s in first] or (
        lp_moved - lp_first
    ).abs().max() > 1e-2
    # The trained sampler's logprobs are the trained weights' (the trainer scores its tokens the same).
    seq = list(moved[0].tokens)
    from rlrunbook.tokens import build_datum_arrays

    arrays = build_datum_arrays(prompt.to_ints(), seq)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(arrays.input_tokens),
        loss_fn_inputs={"target_tokens": arrays.target_tokens, "weights": arrays.weights},
    )
    trainer = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert (trainer[-len(seq) :] - torch.tensor(list(moved[0].logprobs))).abs().max() <= 1e-4


def _tok():
    from rlrunbook.models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(MODEL))


def test_same_seed_same_tokens(engine):
    prompts = chat_prompts(_tok(), 3)
    request = GenerationRequest(max_tokens=16, seed=11)
    a, b = engine.sample(prompts, 3, request), engine.sample(prompts, 3, request)
    assert [[c.tokens for c in row] for row in a] == [[c.tokens for c in row] for row in b]
    other = engine.sample(prompts, 3, dataclasses.replace(request, seed=12))
    assert [[c.tokens for c in row] for row in other] != [[c.tokens for c in row] for row in a]


@pytest.mark.parametrize("prompt_index", [0, 1, 2, 3])
def test_multi_token_and_single_token_stops_cut_exactly(engine, prompt_index):
    """Tokens and logprobs end right after the first complete stop (a 2-token sequence or a single id,
    whichever completes first), as in the HF engine; the same seed's unstopped sample is the reference."""
    prompt = chat_prompts(_tok(), 4)[prompt_index]
    free_request = GenerationRequest(max_tokens=24, seed=3 + prompt_index)
    ((free,),) = engine.sample([prompt], 1, free_request)
    assert len(free.tokens) == 24 and free.stop_reason == "length"
    pair, single = tuple(free.tokens[5:7]), (free.tokens[9],)
    for stops in ((pair,), (single,), (pair, single)):
        ((stopped,),) = engine.sample([prompt], 1, dataclasses.replace(free_request, stop=stops))
        end = min(e for e in (_first_end(free.tokens, s) for s in stops) if e is not None)
        assert stopped.tokens == free.tokens[:end], stops
        assert stopped.stop_reason == "stop"
        assert torch.allclose(torch.tensor(stopped.logprobs), torch.tensor(free.logprobs[:end]), atol=1e-5)
        assert (
            stopped.policy_logprobs == stopped.logprobs
        )  # T = 1, no filters: the sampled distribution is the policy


def test_stop_string_ends_at_the_token_that_completes_it(vllm_service):
    """SDK stop strings: the tokens end where the decoded text first contains the string."""
    sampler = vllm_service.create_sampling_client(base_model=MODEL)
    tokenizer = sampler.get_tokenizer()
    prompt = types.ModelInput.from_ints(chat_prompts(tokenizer, 3)[2])
    free = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=24, seed=5, stop=[])).result().sequences[0]
    )
    text = tokenizer.decode(list(free.tokens[6:8]), skip_special_tokens=False)
    assert text.strip(), "pick tokens with visible text"
    stopped = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=24, seed=5, stop=[text]))
        .result()
        .sequences[0]
    )
    end = next(
        e for e in range(1, 25) if text in tokenizer.decode(list(free.tokens[:e]), skip_special_tokens=False)
    )
    assert list(stopped.tokens) == list(free.tokens[:end]) and stopped.stop_reason == "stop"


def test_stop_none_is_eos_and_empty_disables(vllm_service):
    sampler = vllm_service.create_sampling_client(base_model=MODEL)
    tokenizer = sampler.get_tokenizer()
    prompts = chat_prompts(tokenizer, 6)
    eos = tokenizer.eos_token_id
    for prompt in prompts:
        model_input = types.ModelInput.from_ints(prompt)
        off = sampler.sample(model_input, 2, types.SamplingParams(max_tokens=20, seed=9, stop=[])).result()
        assert all(len(s.tokens) == 20 and s.stop_reason == "length" for s in off.sequences)
        on = sampler.sample(model_input, 2, types.SamplingParams(max_tokens=20, seed=9)).result()
        for s, free in zip(on.sequences, off.sequences, strict=True):
            end = _first_end(list(free.tokens), (eos,))
            assert list(s.tokens) == list(free.tokens[: end or 20])
            assert s.stop_reason == ("stop" if end else "length")


def test_temperature_filters_without_policy_logprobs(engine):
    """At T = 0.7 vLLM returns only the sampled distribution's logprobs: policy_logprobs is None, not invented."""
    ((row,),) = engine.sample(
        [chat_prompts(_tok(), 1)[0]],
        1,
        GenerationRequest(max_tokens=8, seed=1, filters=SamplingFilters(temperature=0.7)),
    )
    assert row.policy_logprobs is None and len(row.logprobs) == len(row.tokens) == 8
